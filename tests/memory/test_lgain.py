"""Whether calibrating L can change the plan (memory/lgain.py): the noise of a predicted difference and the decision
by hand, and through the manager: no calibration where L is not worth it, and only the L plan's kinds where it is."""

import dataclasses
import math

import manager_util
import numpy as np
import pytest

from hilore_jax.memory import MemoryManager, calibrate, lgain, methods, planner
from hilore_jax.memory import profile as units
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.model import decoder
from hilore_jax.model import units as U

B, T = 2, 9


def _units(cfg, err: dict):
  ops = {op: 1e-3 for op in decoder.OPS}
  prof = {"ops": ops, "ops_err": err, "codec": {k: {"int8": 2e-4} for k in U.LOWP_UNITS},
          "codec_err": {k: {"int8": 0.5} for k in U.LOWP_UNITS}}
  return units.enumerate_units(cfg, B, T, 8, prof), prof


def test_noise_of_a_predicted_difference_by_hand(tiny_cfg):
  us, prof = _units(tiny_cfg, {"q_proj": 0.1})  # only q_proj's median is uncertain: 10%
  gc = methods.plan("gc", us, prof["ops"], 0)
  keep = methods.plan("none", us, prof["ops"], 0)  # nothing reruns
  # GC reruns q_proj in each of the 3 layers, keeping everything never: 3 x 1 ms x 10%, the layers' errors one
  # shared median's, so they add up and do not cancel
  assert lgain.op_counts(gc, us)[("op", "q_proj")] == 3 and ("op", "q_proj") not in lgain.op_counts(keep, us)
  assert lgain.noise_s(gc, keep, us, prof) == pytest.approx(3 * 1e-3 * 0.1)
  assert lgain.noise_s(gc, gc, us, prof) == 0.0
  # L units: their codec's error too (every unit L in every layer vs none)
  lowp = methods.Plan(tuple("L" if u.bytes_l is not None else "H" for u in us), (None,) * len(us), 0, 0.0, 0.0)
  n_lowp = sum(u.bytes_l is not None for u in us) // 3  # L kinds per layer
  assert lgain.noise_s(lowp, keep, us, prof) == pytest.approx(3 * 2e-4 * 0.5 * math.sqrt(n_lowp))
  assert lgain.noise_s(gc, keep, us, {"ops": prof["ops"]}) == 0.0  # a profile without errors (given times)
  assert lgain.lowp_kinds(lowp, us) == [k for k in U.LOWP_UNITS]
  # the update step GC predicts: forward (every producer once a layer), its recompute, a backward of twice the forward
  assert lgain.update_s(gc, prof["ops"], 3) == pytest.approx(3 * 3 * len(U.PRODUCERS) * 1e-3 + gc.time_s)


def test_the_decision_by_hand(tiny_cfg):
  us, prof = _units(tiny_cfg, {})
  plan = lambda t, lowp=(): methods.Plan(tuple("L" if u.kind in lowp and u.layer == 0 else "R" for u in us),
                                         (None,) * len(us), 0, t, 0.0)
  rf, lp = plan(0.9), plan(0.8, ("q", "attn_norm"))
  rec = lgain.decide("fitted", rf, lp, 1.0, 0.01, 0.05, us)  # 10% of GC's recompute, 2% noise (2 sigma)
  assert rec["calibrate"] and rec["gain"] == pytest.approx(0.1) and rec["noise"] == pytest.approx(0.02)
  assert rec["kinds"] == ["attn_norm", "q"] and "calibrating attn_norm, q" in rec["reason"]
  noisy = lgain.decide("fitted", rf, lp, 1.0, 0.06, 0.05, us)
  assert not noisy["calibrate"] and noisy["kinds"] == [] and "inside the measured noise (12.0%)" in noisy["reason"]
  small = lgain.decide("cost model", rf, lp, 1.0, 0.0, 0.2, us)
  assert not small["calibrate"] and "below memory.min_l_gain (20.0%)" in small["reason"]
  assert not lgain.decide("fitted", rf, plan(0.95, ("q",)), 1.0, 0.0, 0.0, us)["calibrate"]  # slower: no gain
  assert not lgain.decide("fitted", rf, None, 1.0, 0.0, 0.0, us)["calibrate"]  # no L plan fitted the budget
  assert not lgain.decide("fitted", rf, plan(0.5), 1.0, 0.0, 0.0, us)["calibrate"]  # faster, but without any L


@pytest.fixture(scope="module")
def tiny():
  hooks, params = manager_util.hooks()
  rng = np.random.default_rng(0)
  batches = [manager_util.batch(rng, np.array([1.5, -0.5, -1.0, 1.0, 0.5, -1.5]) * s) for s in (1.0, 2.0)]
  mc = MemoryConfig(policy="hilore", budget_ratio=1.5, group_size=8, calib_batches=2, calib_sets=1, budget_probes=2,
                    buckets=1, warmup="none", cache=False, verify_steps=0, drift_check_every=0)
  return hooks, params, batches, mc


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_op_times")
def test_calibration_runs_only_where_l_can_change_the_plan_and_only_for_its_kinds(tiny, monkeypatch):
  hooks, params, batches, mc = tiny
  measured = []
  measure = calibrate.measure
  monkeypatch.setattr(calibrate, "measure", lambda h, m, u, *a, **k: measured.append(list(u)) or measure(h, m, u, *a,
                                                                                                         **k))
  solves, plan = [], methods.plan
  monkeypatch.setattr(methods, "plan", lambda m, *a, **k: solves.append((m, k.get("max_runs"))) or plan(m, *a, **k))
  # L predicted to save under 99% of GC's recompute: the risk-free fit runs, nothing is measured
  off = MemoryManager(dataclasses.replace(mc, min_l_gain=0.99), hooks)
  (alloc,) = off.step(params, batches[:1], 0)
  # the screen's L plans drop the run shape (a relaxation: an upper bound on L's gain, a fast solve); the risk-free
  # plans keep it, as the run's own
  assert set(solves) - {("gc", None)} == {("optimal_hr", mc.plan_runs), ("hilore", 0)} and mc.plan_runs > 0
  monkeypatch.setattr(methods, "plan", plan)
  assert not measured and off.state.calibration is None and off.state.calibrations == 0
  assert not off.state.lgain["calibrate"] and "below memory.min_l_gain" in off.state.lgain["reason"]
  assert alloc.metrics["alloc/frac_L"] == 0.0 and off.state.risk_free == [0] and not off.exposure_on
  floor = methods.plan("optimal_hr", off.unit_list(batches[0]), off.state.profile["ops"],
                       off.state.lgain["risk_free_allowance"], max_runs=mc.plan_runs)
  assert alloc.plan.choice == floor.choice  # the risk-free fit's plan (at most memory.plan_runs runs, as the manager)
  # any gain: calibrated, only the kinds the plan with every L unit free of risk holds in L, at every layer
  on = MemoryManager(dataclasses.replace(mc, min_l_gain=0.0), hooks)
  on.step(params, batches, 0)
  kinds = on.state.lgain["kinds"]
  assert on.state.lgain["calibrate"] and on.state.lgain["stage"] == "fitted" and kinds
  _, zero_risk = planner.solve(on.planner, on.planner_state, 0, on.state.lgain["lowp_allowance"], zero_risk=True)
  assert kinds == lgain.lowp_kinds(zero_risk, on.unit_list(batches[0]))
  assert measured == [[(layer, k) for layer in range(2) for k in U.LOWP_UNITS if k in kinds]]
  assert on.state.calibration.kinds == kinds and on.lowp_ids == measured[0]
  assert len(on.state.calibration.static_risk) == len(measured[0]) and on.state.calibrations == 1
  # no kind outside them is L in any of its plans
  plan = on.bucket_plan(0)
  assert {u.kind for u, c in zip(on.unit_list(batches[0]), plan.choice) if c == "L"} <= set(kinds)


@pytest.mark.usefixtures("fixed_op_times")
def test_no_plan_is_fitted_where_even_the_risk_free_plan_saves_too_little(tiny):
  hooks, params, batches, mc = tiny
  peaks = []
  counted = dataclasses.replace(hooks, compile_peak=lambda pols, b: peaks.append(pols) or hooks.compile_peak(pols, b))
  # every plan predicted to save under 99% of the update step: GC's program, no probe compile, nothing calibrated
  off = MemoryManager(dataclasses.replace(mc, min_l_gain=0.99, min_plan_gain=0.99), counted)
  (alloc,) = off.step(params, batches[:1], 0)
  assert off.state.lgain["gc_only"] and 0 < off.state.lgain["plan_gain"] < 0.99
  assert "below memory.min_plan_gain (99.0%)" in off.state.lgain["reason"]
  assert off.state.guard == "gc" and off.state.calibration is None and alloc.metrics["alloc/guard_gc"] == 1.0
  assert len(peaks) == 1  # GC's own compiled peak (the budget), and no probe
  # at 0 (the default) the same manager fits the risk-free plan: probe compiles, a plan that keeps something
  peaks.clear()
  on = MemoryManager(dataclasses.replace(mc, min_l_gain=0.99), counted)
  (alloc,) = on.step(params, batches[:1], 0)
  assert not on.state.lgain.get("gc_only") and on.state.guard != "gc" and len(peaks) > 1
  assert alloc.metrics["alloc/frac_H"] > 0.0
