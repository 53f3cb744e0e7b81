"""Issue 47's E1b (experiments/exposure/e1b_criteria.py) on tiny synthetic sweeps: the tolerance rule, the doubling
sweep, reading an arm where it first crosses (undefined where it never does), the criteria and the decision."""

import functools
import json
import os

import numpy as np
import pytest

from experiments.exposure import e1b_criteria as crit
from experiments.common.config import E1bSettings, E1Criteria

E = E1bSettings(json="x.json")
M = 12  # minibatches: 6 row sets x 2 passes
CLUSTERS = [f"{j // 2}:{j % 2}" for j in range(M)]


def test_tolerance_is_half_the_aggressive_plans_median_and_binding_is_a_share_over_it():
  err = [1.0, 2.0, 3.0, 4.0, 10.0]
  assert crit.tolerance_rule(err, 0.5) == pytest.approx(1.5)
  b = crit.risk_binds(err, 1.5, 0.75)
  assert b["share_over_tolerance"] == pytest.approx(0.8) and b["binds"]
  assert not crit.risk_binds(err, 3.5, 0.75)["binds"]  # 2 of 5 over


def _point(d, viol_of, removed_of, saturate_at=np.inf):
  """A sweep point at delta d: the first round(viol_of(d) * M) minibatches over tol 1, each removing removed_of(d)."""
  k = int(round(viol_of(d) * M))
  err = [2.0] * k + [0.5] * (M - k)
  rem = [removed_of(d)] * M
  return {"delta": d, "violation_rate": k / M, "recompute_removed_pct": removed_of(d), "frac_L": min(d, 1.0),
          "predicted_removed_pct": 0.0, "saturated": d >= saturate_at,
          "per_minibatch": {"err": err, "removed_pct": rem, "frac_L": [min(d, 1.0)] * M}}


def test_the_sweep_doubles_until_it_crosses_then_bisects_that_octave():
  seen = []
  viol = lambda d: 0.0 if d < 3.0 else 0.5  # crosses 10% between 2 and 4 (at 3)

  def at(d):
    seen.append(d)
    return _point(d, viol, lambda x: 10 * x)

  e = E1bSettings(json="x", sweep_start=0.25, refine=2)
  pts, status = crit.sweep_until(at, 1.0, e)
  assert status == "crossed" and seen[:5] == [0.0, 0.25, 0.5, 1.0, 2.0] and seen[5] == 4.0
  # bisections in log delta: sqrt(2 * 4) = 2.83 (under), then sqrt(2.83 * 4) = 3.36 (over)
  assert seen[6:] == pytest.approx([np.sqrt(8), np.sqrt(np.sqrt(8) * 4)])
  assert [p["delta"] for p in pts] == sorted(seen)
  r = crit.read(pts, 0.10)
  assert r["interpolated"] and r["between"] == pytest.approx([np.sqrt(8), np.sqrt(np.sqrt(8) * 4)])
  t = 0.10 / 0.5  # 0 -> 50% between the two bracketing points
  assert r["recompute_removed_pct"] == pytest.approx(10 * (np.sqrt(8) + t * (np.sqrt(np.sqrt(8) * 4) - np.sqrt(8))))


def test_a_start_over_the_target_halves_and_a_saturated_arm_is_undefined_never_zero():
  seen = []

  def at(d):
    seen.append(d)
    return _point(d, lambda x: 0.5 if x > 0.1 else 0.0, lambda x: x)

  pts, status = crit.sweep_until(at, 1.0, E1bSettings(json="x", sweep_start=1.0, refine=0))
  assert status == "crossed" and seen == [0.0, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.125]
  # memory binds first: the plans stop changing at delta 4 with no violation; never read at that last point
  pts, status = crit.sweep_until(lambda d: _point(d, lambda x: 0.0, lambda x: min(x, 4.0), saturate_at=4.0), 1.0,
                                 E1bSettings(json="x", sweep_start=1.0))
  assert status == "memory binds first" and pts[-1]["delta"] == 4.0
  r = crit.read(pts, 0.10)
  assert not r["interpolated"] and np.isnan(r["recompute_removed_pct"]) and np.isnan(r["frac_L"])
  pts, status = crit.sweep_until(lambda d: _point(d, lambda x: 0.0, lambda x: x), 1.0,
                                 E1bSettings(json="x", sweep_start=1.0, max_doublings=3))
  assert status == "max doublings" and max(p["delta"] for p in pts) == 8.0
  # over the target already at delta 0 (units of zero calibrated risk L with no budget): one point, undefined
  pts, status = crit.sweep_until(lambda d: _point(d, lambda x: 0.5, lambda x: x), 1.0, E)
  assert status == crit.OVER_AT_ZERO and len(pts) == 1 and np.isnan(crit.read(pts, 0.10)["recompute_removed_pct"])


def _sweep(cross_at: float, rate: float):
  """An arm whose violation rate jumps from 0 to 50% at delta cross_at, removing rate x delta."""
  return [_point(d, lambda x: 0.0 if x < cross_at else 0.5, lambda x: rate * x) for d in (0.0, 1.0, 2.0, 4.0, 8.0)]


def test_primary_and_secondary_by_hand_and_re_read_at_another_tolerance():
  # static crosses between 1 and 2 (read 20% of the way: delta 1.2), oracle and static_clip between 2 and 4 (2.4)
  sweeps = {"hilore_exposure_off": _sweep(2.0, 10.0), "oracle": _sweep(4.0, 10.0),
            "static_clip": _sweep(4.0, 9.0), "hilore_exposure_on": _sweep(2.0, 10.0)}
  static_at, oracle_at, clip_at = 10 * 1.2, 10 * 2.4, 9 * 2.4
  p = crit.primary(sweeps, ceiling_pct=50.0, optimal_hr_pct=10.0, clusters=CLUSTERS, tol=1.0, e=E, n_boot=50)
  assert p["value"] == pytest.approx((oracle_at - static_at) / 40.0) and p["met"] and p["ci_low"] > 0
  at_cal = {"hilore_exposure_off": {"violation_rate": 0.05}, "static_clip": {"violation_rate": 0.08}}
  q = crit.secondary(sweeps, at_cal, CLUSTERS, 1.0, E, 50)
  assert q["value"] == pytest.approx((clip_at - static_at) / (oracle_at - static_at)) and q["met"]
  assert q["violation_points_over_static"] == pytest.approx(0.03) and q["violation_within"]
  at_cal["static_clip"]["violation_rate"] = 0.12  # 7 points over static's at the calibrated delta
  assert crit.secondary(sweeps, at_cal, CLUSTERS, 1.0, E, 50)["met"] is False
  # every error (0.5 or 2) under a tolerance of 3: nothing crosses, so nothing is defined
  again = crit.primary(sweeps, 50.0, 10.0, CLUSTERS, tol=3.0, e=E, n_boot=50)
  assert again["met"] is None and np.isnan(again["value"]) and "never crossed" in again["note"]
  assert crit.resampled(sweeps["oracle"], np.arange(M), 3.0)[-1]["violation_rate"] == 0.0


def test_an_arm_that_never_crosses_leaves_the_primary_undefined_and_the_decisions():
  flat = [_point(d, lambda x: 0.0, lambda x: x) for d in (0.0, 1.0, 2.0)]
  sweeps = {"hilore_exposure_off": _sweep(2.0, 10.0), "oracle": flat}
  p = crit.primary(sweeps, 50.0, 10.0, CLUSTERS, 1.0, E, 50)
  assert p["met"] is None and p["undefined_resample_share"] == 1.0
  binds = {"met": True, "risk": {"binds": True}}
  assert crit.decision({"met": False, "risk": {"binds": False}}, None, None)["verdict"] == crit.UNTESTABLE
  assert crit.decision(binds, p, None)["verdict"] == "primary undefined"
  missed = {"met": False}
  assert "closes on CPU" in crit.decision(binds, missed, None)["verdict"]
  assert crit.decision(binds, {"met": True}, {"met": True})["default"] == "clip-scaled static risk, no gate"
  assert "gate" in crit.decision(binds, {"met": True}, {"met": False})["default"]


def test_the_markdown_carries_the_regime_and_the_verdicts(tmp_path):
  sweeps = {"hilore_exposure_off": _sweep(2.0, 10.0), "oracle": _sweep(4.0, 10.0), "static_clip": _sweep(4.0, 9.0),
            "hilore_exposure_on": _sweep(2.0, 10.0)}
  at_cal = {a: {"violation_rate": 0.05, "recompute_removed_pct": 12.0, "frac_L": 0.1} for a in sweeps}
  prim = crit.primary(sweeps, 50.0, 10.0, CLUSTERS, 1.0, E, 50)
  sec = crit.secondary(sweeps, at_cal, CLUSTERS, 1.0, E, 50)
  regime = {"clipfrac_second_pass": 0.3, "length_p90_p10": 5.0, "e1_met": True, "none_over_gc": 3.0,
            "memory_binds": True, "allowance_bytes": 1000, "tolerance": 0.01, "tolerance_rule": "0.5 x median",
            "aggressive_plan": {"l_units": 30, "active": "memory", "err_calibration": [0.02, 0.03]},
            "risk": {"share_over_tolerance": 1.0, "need": 0.75, "binds": True}, "met": True}
  s = {"config": "c.yaml", "command": "cmd", "predictor": "cotangent_forward", "settings": {"violation_target": 0.1},
       "regime": regime, "held_out": {"minibatches": M, "clusters": 6, "rollouts": [1, 2, 3]},
       "reference": {"ceiling_removed_pct": 50.0, "optimal_hr_removed_pct": 10.0},
       "arms": {a: {"at_target": {**crit.read(sweeps[a], 0.1), "active_around": [{"memory": 3, "risk": 9}]},
                    "sweep_status": "crossed", "points": 5, "at_calibrated_delta": at_cal[a]} for a in sweeps},
       "primary": prim, "secondary": sec, "shares_reported": {"hilore_exposure_on": sec},
       "calibration": {"gate": {"spread": 2.5, "unclipped_share": 0.5, "loo_rho": 0.1, "risk_binds": True,
                                "measured_on": False}},
       "decision": crit.decision(regime, prim, sec)}
  md = crit.markdown(json.loads(json.dumps(s, default=float))).splitlines()
  row = lambda start: next(line for line in md if line.startswith(start))
  assert row("| primary").endswith("| met |") and row("| secondary").endswith("| met |")
  assert "memory 3, risk 9" in row("| oracle |") and "Met." in md[2]
  assert md[-1].startswith("Decision: static_clip carries the gain")


@functools.cache
def _calibrated():
  """The tiny decoder's records, hooks and hilore calibrated on rollout 0: built once, each study only reads them."""
  import dataclasses
  import sys

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  import manager_util

  from experiments.exposure import study as exposure_study
  from hilore_jax import config, model
  from hilore_jax.memory import calibration
  from hilore_jax.memory.config import MemoryConfig

  from hilore_jax.memory import profile

  hooks, params = manager_util.hooks(1.0)
  # recompute priced 50x its measured time (the tiny decoder's ops take microseconds, its codecs as long): L pays for
  # its units, as on SmolLM2, whatever this machine measured
  measured_ops = profile.profile_ops(manager_util.CFG, 8, manager_util.P + manager_util.N, 8)
  priced = {**measured_ops, "ops": {k: 50 * v for k, v in measured_ops["ops"].items()}}
  hooks = dataclasses.replace(hooks, op_profile=lambda *a: priced)
  rng = np.random.default_rng(3)
  adv = np.array([1.5, -0.5, -0.5, -0.5, 1.0, -1.0, 1.0, -1.0])
  records = []
  for step in range(3):
    batches = [manager_util.batch(rng, adv * scale) for scale in (0.02, 3.0)]
    for it in range(2):
      for j, b in enumerate(batches):
        records.append(exposure_study.Record(step, it, j, params, b, {"clipfrac": 0.1 * it}))
  mc = MemoryConfig(policy="hilore", budget_ratio=1.5, group_size=8, calib_batches=4, calib_sets=2,
                    budget_probes=2, buckets=3, risk_metric="clipped", lowp_kinds=tuple(model.decoder.WEIGHT_READS))
  cfg = dataclasses.replace(config.Config(), memory=mc)
  units = calibration.lowp_units(2, mc.lowp_kinds)
  cal, held = records[:4], records[4:]
  calib_mm, measured = exposure_study.calibrated(mc, hooks, cal, units)
  return cfg, hooks, records, cal, held, units, calib_mm, measured


def _study(tmp_path, **e1b):
  """A Study on the tiny decoder without a trainer: rollout 0 calibrates (2 row sets x 2 passes), rollouts 1-2 are
  held out; advantages scaled per row set so ||g|| falls on both sides of the clip c = 1."""
  import time
  import types

  from experiments.exposure import study as exposure_study
  from experiments.common.config import ExposureBenchConfig

  cfg, hooks, records, cal, held, units, calib_mm, measured = _calibrated()
  be = ExposureBenchConfig(bootstrap=40, e1b=E1bSettings(json=str(tmp_path / "data" / "e1b.json"), **e1b),
                           criteria=E1Criteria(regime_length_ratio_min=1.0))  # completions of 3..7 tokens
  trainer = types.SimpleNamespace(state={}, ref_params={})
  return exposure_study.Study(cfg, be, str(tmp_path), trainer, None, hooks, records, cal, held, units, calib_mm,
                              measured, str(tmp_path / "records"), time.perf_counter())


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_op_times")  # plans from measured op times differ with the machine's load
def test_e1b_end_to_end_on_a_tiny_decoder_and_its_arrays_re_read_every_sweep(tmp_path, monkeypatch):
  from experiments.exposure import e1b as exposure_e1b, e1b_arms

  monkeypatch.setattr("sys.argv", ["bench_exposure", "--config", "c.yaml"])
  s = _study(tmp_path, binds_share=0.01, tolerance_share=0.5, refine=1)
  out = exposure_e1b.study(s)
  saved = json.loads((tmp_path / "data" / "e1b.json").read_text())
  a = np.load(tmp_path / "data" / "e1b_arrays.npz")
  rg = saved["regime"]
  agg = a["aggressive_lset"]
  assert agg.any() and rg["aggressive_plan"]["l_units"] == agg.sum()
  agg_err = np.sqrt((a["cal_err"][:, agg] ** 2).sum(1))  # the plan's calibration errors from its units'
  assert rg["tolerance"] == pytest.approx(0.5 * np.median(agg_err)) and rg["met"] and out["decision"]["verdict"]
  assert set(saved["arms"]) == set(e1b_arms.ARMS) and saved["held_out"]["minibatches"] == 8
  for arm in e1b_arms.ARMS:  # every sweep point's violation rate, re-read from the arrays alone
    for p, lsets in zip(saved["sweeps"][arm], a[f"{arm}_lsets"]):
      err = np.sqrt(np.where(lsets, a["err_clipped"] ** 2, 0.0).sum(1))
      assert p["violation_rate"] == pytest.approx(np.mean(err > a["tolerance"]))
      np.testing.assert_allclose(p["per_minibatch"]["err"], err, rtol=1e-9)
    r = saved["arms"][arm]
    assert r["crossed"] == (r["sweep_status"] == "crossed")
    assert r["crossed"] == bool(np.isfinite(r["at_target"]["recompute_removed_pct"]))
  # static_clip is static's plan wherever g_hat is at or over the clip (f = 1), at every delta
  full = np.flatnonzero(a["g_hat"] >= 1.0)
  d_static, d_clip = a["hilore_exposure_off_delta"], a["static_clip_delta"]
  for k, d in enumerate(d_clip):
    if d in d_static:
      np.testing.assert_array_equal(a["static_clip_lsets"][k][full],
                                    a["hilore_exposure_off_lsets"][list(d_static).index(d)][full])
  assert {"primary", "secondary", "P4"} <= set(saved) and saved["calibration"]["gate"]["risk_binds"] is True
  assert (tmp_path / "e1b.md").read_text().count("| primary") == 1


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_op_times")  # plans from measured op times differ with the machine's load
def test_e1b_stops_before_the_held_out_pass_where_the_risk_budget_does_not_bind(tmp_path, monkeypatch):
  from experiments.exposure import e1b as exposure_e1b, study as exposure_study

  monkeypatch.setattr("sys.argv", ["bench_exposure"])
  s = _study(tmp_path, binds_share=1.0, tolerance_share=1.0)  # tol = the median: never over it on every minibatch
  monkeypatch.setattr(exposure_study, "held_out", lambda *a, **k: pytest.fail("held-out pass after a failed check"))
  out = exposure_e1b.study(s)
  assert not out["regime"]["risk"]["binds"] and out["decision"]["verdict"] == crit.UNTESTABLE
  assert "arms" not in out and out["calibration"]["gate"]["risk_binds"] is False
  assert not out["calibration"]["gate"]["measured_on"]


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_op_times")  # plans from measured op times differ with the machine's load
def test_static_clips_plan_is_statics_at_delta_over_the_clip_share(tmp_path):
  # the study plans static_clip as static at delta / f (f = min(1, g_hat / c)); that is the plan of risks static x f
  # at delta, solved as such
  import dataclasses

  from experiments.exposure import e1b_arms
  from hilore_jax.memory import MemoryManager, risk

  s = _study(tmp_path)
  mc = dataclasses.replace(s.cfg.memory, buckets=1)
  cal = s.calib_mm.fit_calibration(s.measured, mc.exposure)
  batches = [r.batch for r in s.cal]
  static = MemoryManager(mc, s.hooks)
  static.setup(s.cal[0].params, batches, 0, calibration_state=cal)
  static.allocate(batches[:1])
  allowance = static.state.allowance["0"]
  for f in (0.5, 0.125):
    scaled = MemoryManager(mc, s.hooks)
    scaled.setup(s.cal[0].params, batches, 0, calibration_state=dataclasses.replace(
        cal, static_risk=list(risk.static_clip(cal.static_risk, f, 1.0))))
    e1b_arms.assume_fitted(scaled, 0, allowance)
    scaled.allocate(batches[:1])
    for d in (0.5 * cal.delta, cal.delta, 4 * cal.delta):
      assert scaled.plan_at(0, d, allowance)[1] == static.plan_at(0, d / f, allowance)[1]
  assert static.plan_at(0, 0.25 * cal.delta, allowance)[1] != static.plan_at(0, 4 * cal.delta, allowance)[1]


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_op_times")  # free codecs: L pays where memory binds, whatever this machine measures
def test_e1b_under_lora_runs_from_the_committed_config_to_its_json(tmp_path, monkeypatch):
  # the real run's command (configs/exposure_e1b_smollm2.yaml, lora.rank=16 and the LoRA json), on the tiny decoder
  # and tiny rollouts: collection, calibration and the held-out pass through the adapters' error channels, every
  # arm's sweep and the files; the regime thresholds lowered so the run goes past its checks to the end
  # (rollouts 0-1 calibrate on their 8 minibatches, rollout 2's 4 held out; one bisection: the sweep's doubling and
  # bisection are checked in the tiny study's test above)
  import repo
  from experiments.exposure import e1b_arms, main
  from trainer_util import TINY

  data = tmp_path / "data" / "exposure_e1b_lora.json"
  tiny = [o for o in TINY if o.startswith(("model.", "train.warmstart"))]
  argv = ["--config", "configs/exposure_e1b_smollm2.yaml", "lora.rank=16", f"bench_exposure.e1b.json={data}",
          "model.path=null", *tiny, "task.prompt_format=template", "rollout.num_prompts=3", "rollout.num_generations=4",
          "rollout.max_prompt_len=6", "rollout.max_new_tokens=5", "train.minibatch_size=6", "optimizer.lr=0.01",
          "memory.group_size=8", "memory.budget_ratio=1.5", "memory.budget_probes=2", "bench_exposure.rollout_steps=3",
          "bench_exposure.calib_minibatches=8", "bench_exposure.bootstrap=20",
          "bench_exposure.criteria.regime_clipfrac_min=0", "bench_exposure.criteria.regime_length_ratio_min=1",
          "bench_exposure.e1b.binds_share=0.01", "bench_exposure.e1b.refine=1", "--out", str(tmp_path / "run")]
  monkeypatch.chdir(repo.ROOT)  # the config by the command's own relative path
  monkeypatch.setattr("sys.argv", ["experiments.exposure.main", *argv])
  main.main(argv)
  saved = json.loads(data.read_text())
  a = np.load(tmp_path / "data" / "exposure_e1b_lora_arrays.npz")
  assert saved["config"] == "configs/exposure_e1b_smollm2.yaml" and "lora.rank=16" in saved["command"]
  assert saved["regime"]["met"] and saved["held_out"]["minibatches"] > 0 and set(saved["arms"]) == set(e1b_arms.ARMS)
  assert np.all(a["err_clipped"] > 0) and np.all(np.isfinite(a["err_clipped"]))  # the channels' errors, per unit
  for r in saved["arms"].values():
    assert r["crossed"] == bool(np.isfinite(r["at_target"]["recompute_removed_pct"]))
  assert saved["decision"]["verdict"] and (tmp_path / "run" / "e1b.md").exists()
