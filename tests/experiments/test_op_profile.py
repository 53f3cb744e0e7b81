import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.profile import hlo as hlo_ops, ops as op_profile, run as plan_profile
from experiments.common import config as bench_config
from hilore_jax.errors import ConfigError

TINY = ["model.vocab_size=37", "model.hidden_size=24", "model.intermediate_size=40", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "memory.group_size=8",
        "memory.budget_probes=2", "bench.batch_size=4", "bench.group_size=2", "bench.seq_len=15",
        "bench.prompt_len=5", "bench.budget_ratios=[1.3]", "bench.risk_batches=0", "grpo.beta=0.02"]


def _ev(name, tid, ts, dur, run="r1", module="m", end_ts=None):
  return {"name": name, "tid": tid, "ts": ts, "dur": dur, "end_ts": end_ts, "ph": "X",
          "args": {"hlo_op": name, "hlo_module": module, "run_id": run}}


def test_nested_ops_keep_their_own_time_and_overlaps_split_evenly():
  # thread 1: a loop [0, 100] around a [10, 40] and b [50, 90]; thread 2: c [30, 60] overlaps a, the loop and b.
  # By hand: the loop's own time is [0,10] + [40,50] + [90,100] with [40,50] shared with c: 10 + 5 + 10 = 25;
  # a = 20 + 5 (shared [30,40]); b = 30 + 5 (shared [50,60]); c = 3 x 5
  events = [_ev("while.1", 1, 0, 100), _ev("a", 1, 10, 30), _ev("b", 1, 50, 40), _ev("c", 2, 30, 30)]
  (r,) = op_profile.attribute(events)
  us = {k: v * 1e6 for k, v in r["op_s"].items()}
  np.testing.assert_allclose([us["while.1"], us["a"], us["b"], us["c"]], [25, 25, 35, 15])
  assert r["span_s"] * 1e6 == pytest.approx(100) and r["busy_s"] * 1e6 == pytest.approx(100)
  assert r["count"] == {"while.1": 1, "a": 1, "b": 1, "c": 1} and r["threads"] == 2


def test_gaps_between_ops_are_the_executors_and_an_async_op_counts_until_its_completion():
  # a run with a 10 us gap between its ops, and an op whose completion event comes 25 us after its thunk returned
  events = [_ev("a", 1, 0, 10, run="r2"), _ev("b", 1, 20, 10, run="r2"),
            _ev("d", 1, 100, 5, run="r3", end_ts=130), _ev("e", 1, 110, 10, run="r3")]
  r2, r3 = op_profile.attribute(events)
  ops = {"a": hlo_ops.HloOp("a", "dot", "matmul", 8.0), "b": hlo_ops.HloOp("b", "copy", "copy", 4.0)}
  s = op_profile.summarise([r2], ops)
  assert s["span_s"] * 1e6 == pytest.approx(30) and s["ops_s"] * 1e6 == pytest.approx(20)
  assert s["by_category"]["executor"]["time_s"] * 1e6 == pytest.approx(10)
  assert s["by_category"]["matmul"]["bytes"] == 8.0 and s["unknown_ops"] == []
  # d's work runs [100, 130] beside e [110, 120]: the overlap is shared
  assert r3["async_ops"] == 1 and r3["span_s"] * 1e6 == pytest.approx(30)
  assert r3["op_s"]["d"] * 1e6 == pytest.approx(25) and r3["op_s"]["e"] * 1e6 == pytest.approx(5)


def test_hlo_ops_categorise_a_compiled_program():
  def f(w_LDD, x_BD):
    def body(x, w):
      return jnp.tanh(x @ w), None

    y, _ = jax.lax.scan(body, x_BD, w_LDD)
    return jnp.sum(y.T ** 2)

  w, x = jnp.ones((3, 24, 24)) * 0.01, jnp.ones((7, 24))
  ops = hlo_ops.hlo_ops(jax.jit(jax.grad(f)).lower(w, x).compile().as_text())
  cats = {o.category for o in ops.values()}
  assert {"matmul", "elementwise", "loop"} <= cats
  for o in ops.values():  # a dot, alone or inside a fusion, is a matmul; a loop moves no bytes of its own
    if o.opcode in ("dot", "convolution") or "dot" in o.fused:
      assert o.category == "matmul", o
    if o.category == "loop":
      assert o.bytes == 0.0
  dot = next(o for o in ops.values() if o.category == "matmul")
  assert dot.bytes >= 7 * 24 * 4  # at least its [7, 24] float32 activation is read or written
  assert hlo_ops.category("fusion", {"parameter", "dynamic-update-slice", "bitcast"}) == "copy"
  assert hlo_ops.category("fusion", {"parameter", "exponential", "reduce"}) == "elementwise"
  assert hlo_ops.category("custom-call", set(), "__onednn$matmul") == "matmul"
  assert hlo_ops.shape_bytes("(s32[], f32[4,15,24]{2,1,0}, bf16[3])") == 4 + 4 * 4 * 15 * 24 + 2 * 3


def test_a_pair_is_resolved_only_with_enough_rounds():
  fast, slow = [10.0, 11.0, 9.0, 10.5, 10.2], [0.0, 0.5, -0.3, 0.2, 0.1]
  assert plan_profile.pair_resolved(fast, slow)["faster"] == 1
  assert plan_profile.pair_resolved(slow, fast)["faster"] == -1
  assert plan_profile.pair_resolved(fast[:3], slow[:3])["faster"] == 0
  plans = [{"label": "a", "g": fast, "p": 1.0}, {"label": "b", "g": slow, "p": 2.0}, {"label": "c", "g": slow,
                                                                                       "p": 0.5}]
  o = plan_profile.orders(plans, "g", {"pred": "p"})
  assert o["resolved"] == 2 and o["predictors"]["pred"] == {"agree": 1, "disagree": 1, "tie": 0}


@pytest.mark.slow
def test_profile_traces_every_plan_and_its_ops_account_for_the_program(tmp_path):
  reps = 3
  cfg, bc = bench_config.load(None, TINY + ["bench.methods=[none,gc,optimal_hr]"], "bench")
  out = str(tmp_path / "prof")
  result = plan_profile.run_profile(cfg, bc, out, reps=reps, progress=lambda s: None)
  assert {"profile.json", "profile.md", "traces"} <= set(os.listdir(out))
  with open(os.path.join(out, "profile.json")) as f:
    saved = json.load(f)
  by = {p["label"]: p for p in saved["plans"]}
  assert list(by) == ["none", "gc", "optimal_hr@1.3", "gc_unrolled", "none_unrolled"]
  assert by["gc"]["layer_scan"] and not by["gc_unrolled"]["layer_scan"] and by["gc_unrolled"]["control"]
  assert by["none"]["predicted_rerun_s"] == 0 < by["gc"]["predicted_rerun_s"] == by["gc_unrolled"]["predicted_rerun_s"]
  for label, p in by.items():
    assert glob.glob(os.path.join(out, "traces", label, "plugins", "profile", "*", "*.trace.json.gz"))
    assert glob.glob(os.path.join(out, "traces", label, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    t = p["trace"]
    for prog in ("grad", "update"):
      s = t[prog]
      assert s["runs"] == reps and s["unknown_ops"] == [], (label, prog)  # every traced op is in the program's HLO
      cats = sum(c["time_s"] for c in s["by_category"].values())
      assert cats == pytest.approx(s["span_s"], rel=1e-9)  # ops + the executor's gaps = the program's span
      # ops never cover more than the span (a loop double-counting its body would); the gradient program's ops
      # cover most of it (6-10% goes to the executor between microsecond thunks at these toy sizes). The short
      # update program's share varies with the machine's load (22-70% measured), so it gets only the upper bound.
      assert s["ops_s"] / s["span_s"] <= 1 + 1e-9, (label, prog, s["ops_s"], s["span_s"])
      if prog == "grad":
        assert s["ops_s"] / s["span_s"] >= 0.3, (label, s["ops_s"], s["span_s"])
    # both programs ran inside the host's wall time around each traced step
    assert t["grad"]["span_s"] + t["update"]["span_s"] <= np.mean(t["host_step_s"]) * 1.01
    grad_ops = t["grad"]["ops"]
    matmuls = [o for o in grad_ops if o["opcode"] == "dot" or "dot" in o["fused"]]
    assert matmuls and all(o["category"] == "matmul" for o in matmuls) and t["grad"]["by_category"]["matmul"][
        "time_s"] > 0
    assert all(o["category"] in hlo_ops.CATEGORIES for o in grad_ops)
  loops = lambda label: [o for o in by[label]["trace"]["grad"]["ops"] if o["opcode"] == "while"]
  assert loops("gc") and not loops("gc_unrolled")  # the control runs GC's layers without the scan
  assert set(result["orders"]) == {"wall (this run, untraced)", "bench (results.json)"}
  with open(os.path.join(out, "profile.md")) as f:
    md = f.read()
  assert "## Summary" in md and "| gc_unrolled (control) | no |" in md and "**predicted** rerun ms" in md


@pytest.mark.slow
def test_plans_rebuilt_from_results_rows_and_ordered_by_their_rounds(tmp_path):
  cfg, bc = bench_config.load(None, TINY + ["bench.methods=[none,gc]"], "bench")
  none, gc = {"remat": False}, {"remat": True}
  mixed = [{"remat": True, "save": ["q", "k", "v"]}, {"remat": True}]
  rows = [{"method": "none", "budget_ratio": None, "policies": [none, none], "predicted_rerun_s": 0.0, "flops": 2.0,
           "gains_pct": [-3.0, -2.5, -3.5, -2.8, -3.1], "frac_H": 1.0, "frac_L": 0.0, "frac_R": 0.0},
          {"method": "gc", "budget_ratio": None, "policies": [gc, gc], "predicted_rerun_s": 2.0, "flops": 3.0,
           "gains_pct": [0.0] * 5, "frac_H": 0.0, "frac_L": 0.0, "frac_R": 1.0},
          {"method": "optimal_hr", "budget_ratio": 1.1, "policies": mixed, "predicted_rerun_s": 1.0, "flops": 2.5,
           "gains_pct": [9.0, 10.0, 11.0, 9.5, 10.5], "frac_H": 0.5, "frac_L": 0.0, "frac_R": 0.5}]
  results = {"config": {**cfg.to_dict(), "bench": dataclasses.asdict(bc)}, "rows": rows}
  result = plan_profile.run_profile(cfg, bc, str(tmp_path / "p"), reps=2, results=results, progress=lambda s: None)
  by = {p["label"]: p for p in result["plans"]}
  assert by["optimal_hr@1.1"]["bench"]["plan_source"] == "results" and not by["optimal_hr@1.1"]["layer_scan"]
  o = result["orders"]["bench (results.json)"]
  # measured (the rows' rounds): optimal_hr > gc > none; the cost model puts No-GC first: two disagreements
  assert o["resolved"] == 3 and o["predictors"]["cost model (predicted rerun s)"] == {"agree": 1, "disagree": 2,
                                                                                      "tie": 0}
  other, _ = bench_config.load(None, TINY + ["model.hidden_size=32"], "bench")
  with pytest.raises(ConfigError, match="model"):
    plan_profile.check_results(other, bc, results)
