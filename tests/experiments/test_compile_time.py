"""The traced train step's size does not grow with depth for a plan of a few policy runs (each run one layer scan,
model/layers.py); every layer's own policy, or every layer a plain call, grows with it; the compile-time bench
measures what it says."""

import jax
import jax.numpy as jnp
import pytest
from jaxpr_util import eqn_count
from trainer_util import TINY

from hilore_jax import model
from experiments.compile_time import run as compile_time
from experiments.common import config as bench_config


def _grad_size(cfg, num_layers: int, policies) -> int:
  cfg = cfg.replace(num_hidden_layers=num_layers)
  p = model.init_params(cfg, jax.random.PRNGKey(0))
  ids = jnp.array([[3, 5, 7, 11, 13]])
  loss = lambda q: jnp.sum(model.forward(cfg, q, ids, layer_policies=policies))
  return eqn_count(jax.make_jaxpr(jax.grad(loss))(p).jaxpr)


@pytest.mark.slow
def test_step_size_does_not_grow_with_depth_for_a_few_policy_runs(tiny_cfg):
  for policy in (model.FULL_REMAT, compile_time.LOWP):
    sizes = {n: _grad_size(tiny_cfg, n, (policy,) * n) for n in (2, 5, 9)}
    assert len(set(sizes.values())) == 1, sizes
  mixed = {n: _grad_size(tiny_cfg, n, compile_time.plans(n)["hilore_mixed"]) for n in (6, 12)}
  assert mixed[12] == mixed[6], mixed  # three runs at any depth
  per_layer = {n: _grad_size(tiny_cfg, n, compile_time.plans(n)["per_layer"]) for n in (6, 12)}
  assert per_layer[12] > per_layer[6] * 1.5, per_layer  # a run per layer
  unrolled = {n: _grad_size(tiny_cfg.replace(scan_layers=False), n, compile_time.plans(n)["hilore_mixed"])
              for n in (6, 12)}
  assert unrolled[12] > unrolled[6] * 1.5, unrolled


@pytest.mark.slow
def test_bench_compile_rows(tmp_path):
  cfg, bc = bench_config.load(None, [*TINY, f"out_dir={tmp_path}", "bench.batch_size=4", "bench.group_size=2",
                                     "bench.seq_len=11", "bench.prompt_len=4"], "bench")
  rows = compile_time.measure(cfg, bc, depths=(3,), names=("gc", "hilore_mixed"), progress=lambda s: None)
  assert [(r["layers"], r["plan"], r["policy_runs"]) for r in rows] == [(3, "gc", 1), (3, "hilore_mixed", 3)]
  assert all(r["compile_s"] > 0 and r["peak_bytes"] > 0 for r in rows)
  assert "| 3 |" in compile_time.table(rows)


def test_bench_compile_bad_arguments_are_one_line_errors():
  from experiments.compile_time import main as bench_compile

  for args, msg in ((["--layers", "4,x"], "--layers must be comma-separated integers"),
                    (["--plans", "gc,nope"], "unknown --plans ['nope']"),
                    (["--shape", "nope"], "unknown --shape 'nope'"),
                    (["--shape", "smollm2-135m"], "--shape needs --out DIR")):
    with pytest.raises(SystemExit) as e:
      bench_compile.main(args)
    assert str(e.value).startswith("config error: ") and msg in str(e.value), e.value


TINY_SHAPE = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 61, "hidden_size": 24, "intermediate_size": 40,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512}


@pytest.mark.slow
def test_bench_compile_depth_rows_and_plan_runs(tmp_path):
  import json

  from experiments.compile_time import main as bench_compile

  shape = tmp_path / "config.json"
  shape.write_text(json.dumps(TINY_SHAPE))
  out = tmp_path / "depth"
  base = ["--shape", str(shape), "--completion", "16", "--attention", "xla", "--out", str(out)]
  bench_compile.main([*base, "--layers", "4", "--unrolled"])
  (first,) = json.load(open(out / "depth.json"))
  # a rerun measures only what is missing: depth 3 (scanned), with depth 4's row as it was
  bench_compile.main([*base, "--layers", "3,4"])
  rows = json.load(open(out / "depth.json"))
  assert [(r["layers"], r["method"]) for r in rows] == [(4, "hilore"), (3, "hilore")] and rows[0] == first
  for r in rows:
    assert r["policy_runs"] <= 4 and r["compile_s"] > 0 and 0 < r["peak_rss_gib"] < 8 and r["peak_bytes"] > 0
  assert first["unrolled_compile_s"] > 0 and first["unrolled_peak_bytes"] > 0 and "unrolled_compile_s" not in rows[1]
  assert "| 4 |" in (out / "depth.md").read_text() and "| 3 |" in (out / "depth.md").read_text()
  bench_compile.main([*base, "--layers", "4", "--runs", "0,1"])
  cost = json.load(open(out / "plan_runs.json"))
  assert [(r["plan_runs"], r["policy_runs"] == 1) for r in cost] == [(0, cost[0]["policy_runs"] == 1), (1, True)]
  assert cost[1]["predicted_s"] >= cost[0]["predicted_s"] - 1e-12  # one run is a constraint, never a gain
