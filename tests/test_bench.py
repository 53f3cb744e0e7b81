import json
import math
import os

from hilore_jax import cli
from hilore_jax.bench import run as bench


def test_bench_writes_all_outputs_with_every_method_under_budget(tmp_path):
  cfg = cli.load_config(None, [
      "model.vocab_size=37", "model.hidden_size=24", "model.intermediate_size=40", "model.num_hidden_layers=2",
      "model.num_attention_heads=4", "model.num_key_value_heads=2", "memory.group_size=8", "memory.budget_probes=2",
      "bench.batch_size=4", "bench.group_size=2", "bench.seq_len=15", "bench.prompt_len=5", "bench.reps=1",
      "bench.budget_ratios=[1.3]", "bench.risk_batches=2", "grpo.beta=0.02"])
  out = str(tmp_path / "bench")
  result = bench.run(cfg, out, progress=lambda s: None)
  assert sorted(os.listdir(out)) == ["frontier.png", "results.json", "results.md", "risk.md"]
  with open(os.path.join(out, "results.json")) as f:
    saved = json.load(f)
  rows = saved["rows"]
  assert {"machine", "config", "rows"} <= set(saved)
  assert [(r["method"], r["budget_ratio"]) for r in rows][:3] == [("none", None), ("gc", None), ("sac", 1.3)]
  assert len(rows) == 2 + 8
  for r in rows:
    assert set(bench.ROW_KEYS) <= set(r)
    assert r["tokens_per_s"] > 0 and r["compiles"] <= 1
    if r["budget_bytes"]:
      assert r["peak_bytes"] <= r["budget_bytes"], r["method"]
    assert abs(r["frac_H"] + r["frac_L"] + r["frac_R"] - 1) < 1e-9
  by = {(r["method"], r["budget_ratio"]): r for r in rows}
  # the reference is full checkpointing: keeping or recomputing is exact up to float reassociation
  assert by[("none", None)]["grad_rel_err_mean"] < 1e-5 and by[("gc", None)]["grad_rel_err_mean"] < 1e-5
  assert by[("uniform_int8", 1.3)]["frac_L"] > 0 and by[("uniform_int8", 1.3)]["grad_rel_err_mean"] > 1e-5
  assert by[("optimal_hr", 1.3)]["frac_L"] == 0 and by[("optimal_hr", 1.3)]["grad_rel_err_mean"] < 1e-5
  with open(os.path.join(out, "results.md")) as f:
    md = f.read()
  assert "| hilore | 1.30 |" in md and "## Targets" in md
  with open(os.path.join(out, "risk.md")) as f:
    assert "| full |" in f.read()
  assert not math.isnan(result["risk"]["full"]["spearman"])
