"""What the packing and token budget tests share: a stepper, the check that packed microbatches give the unpacked
minibatch's loss, metrics, gradient and log-probs, and the short runs that compare a packed trainer with an unpacked
one (on one device, and on a 2-device fsdp mesh in a subprocess)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import repo
from trainer_util import tiny_config

from hilore_jax import model, sharding
from hilore_jax.loop import engine, metrics
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig


def rel(a, b) -> float:
  """max |a - b| / max |b|."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def stepper(params, with_state: bool = False):
  """A one-device Stepper holding params (SGD); with_state: (the Stepper, its state)."""
  mesh, opt = sharding.make_mesh(), optax.sgd(0.1)
  state, shardings = engine.init_state(mesh, opt, jax.eval_shape(lambda: params), lambda sh: jax.device_put(params, sh))
  st = engine.Stepper(mesh, opt, state, shardings)
  return (st, state) if with_state else st


def spec(cfg, loss_agg: str, N: int) -> train_step.StepSpec:
  """A full-remat off-policy step with a reference (beta 0.05) under loss_agg."""
  lc = GRPOConfig(loss_agg=loss_agg, max_completion_len=N, beta=0.05)
  return train_step.StepSpec(cfg, lc, model.uniform(cfg.num_hidden_layers, model.FULL_REMAT), use_old_logp=True,
                             use_ref_logp=True)


# the compiled programs by their static arguments, once per process: tests that check another layout against the
# same unpacked minibatch (shared and unshared, packed and budgeted) compute its reference gradient once
_gradient = jax.jit(train_step.gradient_step, static_argnums=2)
_packed_gradient = jax.jit(train_step.packed_gradient, static_argnums=(5, 6))
_packed_start = jax.jit(train_step.packed_start)


def assert_packed_equals_unpacked(params, batch, packed_batch, micros, spec) -> dict:
  """The packed gradient over micros (of packed_batch) equals batch's unpacked one to 1e-5; its metrics."""
  want_g, want_m = _gradient(params, batch, spec)
  acc, norm = _packed_start(params, packed_batch)
  for m in micros:
    acc = _packed_gradient(params, packed_batch, m.arrays(), norm, acc, spec, m.layout)
  grads, stats, logp = acc
  got_m = train_step.step_metrics({**stats, train_step.TOKEN_LOGP: logp})
  assert rel(got_m["loss"], want_m["loss"]) <= 1e-5
  for k in ("tokens", "clipfrac", "kl", "entropy", "abs_log_ratio"):
    np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=1e-5, atol=1e-7)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g)):
    assert rel(g, w) <= 1e-5
  mask = batch.mask > 0
  np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(want_m[train_step.TOKEN_LOGP])[mask], rtol=1e-5)
  return want_m


def run(out, *overrides):
  """(Trainer, metrics rows) of a 1-step GC run of the tiny config with overrides."""
  from hilore_jax.loop.trainer import Trainer

  # two passes over each rollout (old log-probs) and a KL term (reference log-probs): every packed pass runs, and the
  # second update starts from the first's parameters, so one step compares two updates (a second step only sampled
  # again); Adam's eps of 1e-3 keeps an update near-linear in its gradient, so float32 noise stays float32 noise
  c = tiny_config(out, "train.steps=1", "grpo.num_iterations=2", "rollout.max_new_tokens=7", "grpo.beta=0.01",
                  "optimizer.eps=0.001", "eval.at_start=false", "eval.at_end=false", "memory.policy=gc",
                  "grpo.filter_zero_std=false", *overrides)
  t = Trainer(c)
  t.train()
  return t, metrics.read_metrics(os.path.join(out, "metrics.jsonl"))


_unpacked = {}


def unpacked(tmp_path_factory, *overrides):
  """`run` without packing, once per process for its overrides: the reference several tests compare with (and never
  change)."""
  if overrides not in _unpacked:
    _unpacked[overrides] = run(tmp_path_factory.mktemp("unpacked"), *overrides)
  return _unpacked[overrides]


_ON_FSDP = """
import json, sys
sys.path[:0] = [{here!r}, {tests!r}, {root!r}]
from devices import force_cpu_devices
force_cpu_devices(2)
import jax, numpy as np
from hilore_jax import runtime
runtime.enable_compilation_cache()
from packed_util import run
off, _ = run({out!r} + '/off', 'mesh.data=1', 'mesh.fsdp=2')
got = {{}}
for name, overrides in {runs!r}.items():
  on, _ = run({out!r} + '/' + name, 'mesh.data=1', 'mesh.fsdp=2', *overrides)
  pairs = zip(jax.tree.leaves(on.state['params']), jax.tree.leaves(off.state['params']))
  got[name] = {{'shapes': [list(s) for s in on.packer.shapes],
               'params_match': all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5) for x, y in pairs)}}
print('RESULT ' + json.dumps(got))
"""


def updates_on_fsdp(out, runs: dict[str, tuple[str, ...]]) -> dict:
  """`run` with each of runs' overrides (name: overrides) on a 1 x 2 fsdp mesh of forced CPU devices, in one
  subprocess beside one unpacked run: per name, its packer's shapes and whether its parameters ended as the unpacked
  run's (to 1e-4)."""
  code = _ON_FSDP.format(here=os.path.dirname(os.path.abspath(__file__)), tests=repo.TESTS, root=repo.ROOT,
                         out=str(out), runs={k: tuple(v) for k, v in runs.items()})
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
