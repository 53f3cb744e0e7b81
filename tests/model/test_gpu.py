"""GPU-only checks (skipped on CPU; scripts/gpu_check.sh runs them): host offload (O) round trip with residuals
on pinned_host, and a planned step's measured peak_bytes_in_use within its budget."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from hilore_jax import model

pytestmark = pytest.mark.skipif(not model.offload_supported(), reason="needs a device with a pinned_host memory kind")
HERE = os.path.dirname(os.path.abspath(__file__))


def test_offloaded_residuals_round_trip_through_pinned_host(tiny_cfg):
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0), init_std=0.3)
  ids = jnp.array([[3, 5, 7, 11, 13, 17, 19], [2, 4, 6, 8, 10, 12, 14]])
  L = tiny_cfg.num_hidden_layers
  off = model.LayerPolicy(remat=True, save=(model.Q,), offload=(model.MLP_GATE, model.MLP_UP, model.V))
  loss = lambda q, pols: jnp.sum(jnp.tanh(model.forward(tiny_cfg, q, ids, layer_policies=pols)))
  grad = jax.jit(jax.grad(loss), static_argnums=1)
  g_off, g_ref = grad(p, (off,) * L), grad(p, (model.NO_REMAT,) * L)
  flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(g)])
  err = float(jnp.linalg.norm(flat(g_off) - flat(g_ref)) / jnp.linalg.norm(flat(g_ref)))
  assert err < 1e-5, err  # a copy to host and back changes no bit; only float reassociation remains
  # the offloaded names leave for pinned_host in the program itself (not just in the policy)
  hlo = grad.lower(p, (off,) * L).as_text()
  assert "pinned_host" in hlo
  assert "pinned_host" not in grad.lower(p, (model.FULL_REMAT,) * L).as_text()


def test_planned_step_peak_bytes_in_use_within_budget(tmp_path):
  env = {**os.environ, "HILORE_CACHE": str(tmp_path / "cache"), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  proc = subprocess.run([sys.executable, os.path.join(HERE, "gpu_peak_worker.py")], capture_output=True, text=True,
                        env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  print(r)
  assert r["compiled_bytes"] <= r["budget_bytes"]
  # what the step added on top of its arguments (state and batch), as the device allocator counted it
  assert r["peak_bytes_in_use"] - r["base_bytes"] <= r["budget_bytes"], r
  assert r["peak_before"] - r["base_bytes"] < r["peak_bytes_in_use"] - r["base_bytes"]  # the step set the peak
