"""The traced train step's size does not grow with depth when every layer has the same policy (the layer scan); a
mixed plan unrolls (model/decoder.py says why); the compile-time bench measures what it says."""

import jax
import jax.numpy as jnp
import pytest
from trainer_util import TINY

from hilore_jax import model
from experiments import compile_time
from experiments import config as bench_config


def _eqns(jaxpr) -> int:
  """Equations in a jaxpr, counting those of every sub-jaxpr (scan, remat, custom_vjp bodies)."""
  n = 0
  for e in jaxpr.eqns:
    n += 1
    for v in e.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          n += _eqns(inner)
  return n


def _grad_size(cfg, num_layers: int, policies) -> int:
  cfg = cfg.replace(num_hidden_layers=num_layers)
  p = model.init_params(cfg, jax.random.PRNGKey(0))
  ids = jnp.array([[3, 5, 7, 11, 13]])
  loss = lambda q: jnp.sum(model.forward(cfg, q, ids, layer_policies=policies))
  return _eqns(jax.make_jaxpr(jax.grad(loss))(p).jaxpr)


@pytest.mark.slow
def test_step_size_does_not_grow_with_depth_for_equal_policy_layers(tiny_cfg):
  for policy in (model.FULL_REMAT, compile_time.LOWP):
    sizes = {n: _grad_size(tiny_cfg, n, (policy,) * n) for n in (2, 5, 9)}
    assert len(set(sizes.values())) == 1, sizes
  # mixed plans unroll, so they grow with depth like a plan that differs on every layer
  mixed = {n: _grad_size(tiny_cfg, n, compile_time.plans(n)["hilore_mixed"]) for n in (6, 12)}
  assert mixed[12] > mixed[6] * 1.5, mixed
  per_layer = {n: _grad_size(tiny_cfg, n, compile_time.plans(n)["per_layer"]) for n in (6, 12)}
  assert per_layer[12] > per_layer[6] * 1.5, per_layer


@pytest.mark.slow
def test_bench_compile_rows(tmp_path):
  cfg, bc = bench_config.load(None, [*TINY, f"out_dir={tmp_path}", "bench.batch_size=4", "bench.group_size=2",
                                     "bench.seq_len=11", "bench.prompt_len=4"], "bench")
  rows = compile_time.measure(cfg, bc, depths=(3,), names=("gc", "hilore_mixed"), progress=lambda s: None)
  assert [(r["layers"], r["plan"], r["policy_runs"]) for r in rows] == [(3, "gc", 1), (3, "hilore_mixed", 3)]
  assert all(r["compile_s"] > 0 and r["peak_bytes"] > 0 for r in rows)
  assert "| 3 |" in compile_time.table(rows)


def test_bench_compile_bad_arguments_are_one_line_errors():
  from experiments import bench_compile

  for args, msg in ((["--layers", "4,x"], "--layers must be comma-separated integers"),
                    (["--plans", "gc,nope"], "unknown --plans ['nope']")):
    with pytest.raises(SystemExit) as e:
      bench_compile.main(args)
    assert str(e.value).startswith("config error: ") and msg in str(e.value), e.value
