"""Issue 47's experiment E1b: where the risk budget binds, does a perfect predictor remove more recompute than static
risk, and does clip-scaled static risk carry it? On exposure_study's rollouts (rollout 0 calibrates, the later ones
are held out), in phases:

  budget    fit the most aggressive plan memory allows (static risk, delta unbounded) to the budget on the compiled
            step: its byte allowance is every arm's; the tolerance follows from its calibration errors by rule
  regime    E1's two checks, memory binds, and the risk budget binds; any failing: recorded, and the run stops
            before the held-out pass
  held out  one instrumented gradient per held-out minibatch (every weight-read unit's error)
  arms      static (hilore, exposure off), static_clip (static x min(1, g_hat / c)), exposure on (buckets of the
            run-time score), oracle (buckets of the measured errors); each swept over delta by doubling until its
            violation rate crosses the target (experiments/exposure_e1b_criteria.py), no plan compiled
  write     the summary (bench_exposure.e1b.json, and e1b.md / e1b.json in the run's directory) and every array
            beside the json (<stem>_arrays.npz): any criterion can be re-read at another tolerance

Every realised error is exact from the units' own errors (weight-read units: calibration.set_error_of)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time

import jax
import numpy as np

from experiments import exposure_e1, exposure_study
from experiments import exposure_e1b_criteria as crit
from experiments.exposure_sweep import PlanFlops, lowp_set, removed_pct
from hilore_jax import model
from hilore_jax.errors import ConfigError
from hilore_jax.memory import MemoryManager, calibration, gate, predictors, probe, risk

ARMS = ("hilore_exposure_off", "static_clip", "hilore_exposure_on", "oracle_bucketed", "oracle")
STATIC_DELTA = ("hilore_exposure_off", "static_clip", "oracle")  # arms whose risks are errors: static's delta
BIG = 1 << 50  # bytes: an allowance no plan reaches (does memory bind a plan?)


def run(cfg, be, out_dir: str, progress=print) -> dict:
  """The whole study; the records' params (on disk) are removed at the end, whatever happens."""
  s = exposure_study.prepare(cfg, be, out_dir, progress, keep_state=False)
  try:
    return study(s, progress)
  finally:
    shutil.rmtree(s.spill_dir, ignore_errors=True)


def study(s: exposure_study.Study, progress=print) -> dict:
  mc, e = s.cfg.memory, s.be.e1b
  if not (mc.calib_decompose and calibration.additive(s.units, (mc.risk_metric,))):
    raise ConfigError("E1b reads every plan's error from its units' (memory.lowp_kinds: weight-read kinds only, "
                      "memory.calib_decompose: true)")
  b = budget(s, progress)
  regime = {**exposure_e1.regime(s.cal, s.be.criteria), **b["regime"]}
  regime["e1_met"] = regime.pop("met")
  regime["met"] = bool(regime["e1_met"] and regime["memory_binds"] and regime["risk"]["binds"])
  out = {"config": _config_path(), "command": " ".join(["python -m experiments.bench_exposure", *sys.argv[1:]]),
         "settings": dataclasses.asdict(e), "predictor": mc.exposure.predictor, "regime": regime,
         "calibration": b["calibration"]}
  arrays = b["arrays"]
  if not regime["met"]:
    progress(f"E1b regime not met ({crit.decision(regime, None, None)['verdict']}): no held-out pass")
  else:
    h = exposure_study.held_out(s, progress)
    out.update(compare(s, h, b, arrays, progress))
  out["decision"] = crit.decision(regime, out.get("primary"), out.get("secondary"))
  out.update(seconds=time.perf_counter() - s.t_start, backend=jax.default_backend(), jax=jax.__version__)
  return write(s, out, arrays)


def _config_path() -> str:
  argv = sys.argv[1:]
  return argv[argv.index("--config") + 1] if "--config" in argv[:-1] else ""


def budget(s: exposure_study.Study, progress=print) -> dict:
  """The most aggressive plan memory allows, fitted to the budget (its allowance every arm's), the tolerance rule
  and the risk-binds check on the calibration minibatches, the calibrations at that tolerance and the gate."""
  mc, hooks, m, e = s.cfg.memory, s.hooks, s.measured, s.be.e1b
  sw, c, L = mc.exposure, hooks.max_grad_norm, hooks.model_cfg.num_hidden_layers
  cal0 = s.calib_mm.fit_calibration(m, sw)
  static_mm = MemoryManager(dataclasses.replace(mc.at_budget(None, "hilore"), buckets=1), hooks)
  static_mm.setup(s.cal[0].params, [r.batch for r in s.cal], 0,
                  calibration_state=dataclasses.replace(cal0, delta=float("inf")))
  aggressive = static_mm.allocate([s.cal[0].batch])[0]  # fitted on the compiled step: probe compiles
  st = static_mm.state
  fits = 0 not in st.fallback_gc
  allowance = st.allowance["0"] if fits else 0
  lset = lowp_set(aggressive.policies, s.units)
  agg_err = np.array([float(calibration.set_error_of(err_U, [list(lset)])[0]) for err_U in m.err])
  tol = crit.tolerance_rule(agg_err, e.tolerance_share) if lset else 0.0
  binds = crit.risk_binds(agg_err, tol, e.binds_share) if lset else {"share_over_tolerance": 0.0,
                                                                       "need": e.binds_share, "binds": False}
  none_peak = hooks.compile_peak(model.uniform(L, model.NO_REMAT), s.cal[0].batch)
  progress(f"E1b: the most aggressive plan memory allows puts {len(lset)} of {len(s.units)} units L (allowance "
           f"{allowance} B); tolerance {tol:.3g}; over it on {binds['share_over_tolerance']:.0%} of calibration")
  # no L set (memory allows none): the tolerance rule has nothing to scale, and the arms are calibrated at E1's
  # tolerance only to report the gate (the run stops at the regime check)
  mc_tol = dataclasses.replace(mc.at_budget(None, "hilore"), grad_err_tolerance=tol or mc.grad_err_tolerance)
  cals, fitters = {}, {}
  for mode in ("never", "always"):  # static's delta calibrated on static risk; exposure's on its scores
    fitters[mode] = MemoryManager(dataclasses.replace(mc_tol, gate=dataclasses.replace(mc.gate, mode=mode)), hooks,
                                  probe=probe.StudyProbe(forward_errors=True))
    cals[mode] = fitters[mode].fit_calibration(m, sw)
  mm, logp = fitters["always"], [ctx.logp for ctx in m.contexts]
  # the predictor's raw scores of the calibration minibatches, as calibration fits and the gate ranks them
  inputs = predictors.ScoreInputs(m.prompt_profile, m.profile, np.ones(len(s.units)), cals["never"].grad_scale)
  raw_KU = probe.scores(mm, m.batches, inputs, sw, logp, m.token_err)
  norms = [r.grad_norm for r in m.refs]
  gate_rec = gate.evaluate(m.err, raw_KU, norms, c, dataclasses.replace(mc.gate, mode="auto"), mc.buckets,
                           risk_binds=binds["binds"])
  g_hat = cals["never"].grad_scale * probe.l1(mm, m.batches, sw, logp)
  # the same predictor under the other token-norm coherence, its grad_scale refitted: whether the calibration's
  # ranking (the gate's leave-one-out rho) follows the normaliser rather than the errors (a diagnosis, no arm)
  other = dataclasses.replace(sw, coherence="incoherent" if sw.coherence == "coherent" else "coherent")
  cal_other = mm.fit_calibration(m, other)
  raw_other = probe.scores(mm, m.batches, predictors.ScoreInputs(*inputs[:3], cal_other.grad_scale), other, logp,
                           m.token_err)
  regime = {"memory_binds": bool(none_peak > st.budget_bytes), "none_over_gc": none_peak / st.gc_bytes,
            "budget_bytes": st.budget_bytes, "gc_bytes": st.gc_bytes, "allowance_bytes": allowance,
            "plan_fits_budget": fits, "tolerance": tol, "tolerance_rule": f"{e.tolerance_share} x median",
            "aggressive_plan": {"l_units": len(lset), "frac_L": aggressive.metrics["alloc/frac_L"],
                                "active": aggressive.active_constraint, "err_calibration": agg_err.tolist()},
            "risk": binds}
  calib = {"delta_static": cals["never"].delta, "delta_exposure": cals["always"].delta,
           "coherence": cals["never"].coherence, "grad_scale": cals["never"].grad_scale, "gate": gate_rec,
           "grad_norms": norms, "g_hat": g_hat.tolist(),
           "ranking": {sw.coherence: crit.ranking(raw_KU, m.err), other.coherence: crit.ranking(raw_other, m.err)}}
  arrays = {"units": np.array([f"{layer}:{k}" for layer, k in s.units]), "cal_err": m.err, "cal_raw": raw_KU,
            "cal_grad_norm": np.asarray(norms), "cal_g_hat": g_hat,
            f"cal_raw_{other.coherence}": raw_other, "static_p90": np.asarray(cals["never"].static_risk),
            "aggressive_lset": _mask([lset], len(s.units))[0], "tolerance": np.float64(tol)}
  return {"regime": regime, "calibration": calib, "arrays": arrays, "static_mm": static_mm, "cals": cals,
          "allowance": allowance, "aggressive": aggressive.policies, "mc_tol": mc_tol,
          "other": (other, cal_other)}


def _mask(lsets, U: int) -> np.ndarray:
  out = np.zeros((len(lsets), U), bool)
  for i, ls in enumerate(lsets):
    out[i, list(ls)] = True
  return out


def _assume_fitted(mm: MemoryManager, bucket: int, allowance: int):
  """The bucket's plan fitted at the shared allowance, as a restored state would carry it: no compile."""
  mm.state.allowance[str(bucket)] = allowance
  mm.state.verified = sorted(set(mm.state.verified) | {bucket})


def compare(s: exposure_study.Study, h: exposure_study.HeldOut, b: dict, arrays: dict, progress=print) -> dict:
  """Every arm's plans per held-out minibatch at the shared allowance, swept over delta; the criteria."""
  mc, hooks, e, units, held = s.cfg.memory, s.hooks, s.be.e1b, s.units, h.records
  metric, tol, allowance, U, M = mc.risk_metric, b["regime"]["tolerance"], b["allowance"], len(s.units), len(held)
  static_mm, cals, sw = b["static_mm"], b["cals"], mc.exposure
  err_MU = np.asarray(h.err_by[metric], float)
  buckets = {}
  for arm in ("hilore_exposure_on", "oracle_bucketed"):
    mm = MemoryManager(dataclasses.replace(b["mc_tol"], gate=exposure_study.ALWAYS), hooks,
                       probe=probe.StudyProbe(forward_errors=True, oracle=arm == "oracle_bucketed"))
    mm.setup(s.cal[0].params, [r.batch for r in s.cal], 0, calibration_state=cals["always"])
    _assume_fitted(mm, 0, allowance)
    mm.defer_fits = True  # a new bucket takes the shared allowance (below), never a fit of its own
    ids = []
    for i, r in enumerate(held):
      if arm == "oracle_bucketed":
        probe.give_errors(mm, err_MU[i])
      ids.append(mm.allocate([r.batch], [r.logp], [h.token_err[i]])[0].bucket)
      _assume_fitted(mm, ids[-1], allowance)
    buckets[arm] = (mm, ids)
  # the oracle: each minibatch planned from its own measured unit errors, no buckets (whose sqrt(2) grid floors a
  # unit at a quarter of its calibration level: the most any predictor could know); oracle_bucketed is E1's oracle
  exact = []
  for i, r in enumerate(held):
    mm = MemoryManager(dataclasses.replace(b["mc_tol"], buckets=1), hooks)
    mm.setup(s.cal[0].params, [q.batch for q in s.cal], 0,
             calibration_state=dataclasses.replace(cals["never"], static_risk=err_MU[i].tolist()))
    _assume_fitted(mm, 0, allowance)
    mm.allocate([r.batch])  # its shape known: plans at any delta without a compile
    exact.append(mm)
  on_mm = buckets["hilore_exposure_on"][0]
  logp = [r.logp for r in held]
  g_hat = cals["always"].grad_scale * probe.l1(on_mm, [r.batch for r in held], sw, logp)
  f = risk.clip_scale(g_hat, hooks.max_grad_norm)
  # static_clip's risks are static's times f_i, so its plan at delta is static's at delta / f_i (the MILP's risk
  # row scaled), exactly; f_i = 0 (no updated token) lets every unit be L
  plan_of = {"hilore_exposure_off": lambda i, d, a: static_mm.plan_at(0, d, a),
             "static_clip": lambda i, d, a: static_mm.plan_at(0, d / f[i] if f[i] > 0 else float("inf"), a),
             "oracle": lambda i, d, a: exact[i].plan_at(0, d, a),
             **{arm: (lambda i, d, a, mm=mm, ids=ids: mm.plan_at(ids[i], d, a)) for arm, (mm, ids) in buckets.items()}}
  L = hooks.model_cfg.num_hidden_layers
  flops = PlanFlops(hooks.gradient, L, held[0].params, held[0].batch)
  gc_flops, gc_s = flops(model.uniform(L, model.FULL_REMAT)), static_mm.gc_plan().time_s
  rtol = max(1e-6, mc.mip_gap)

  def point_at(arm: str, d: float) -> dict:
    plans = [plan_of[arm](i, d, allowance) for i in range(M)]
    lsets = [lowp_set(pols, units) for _, pols in plans]
    err = [float(calibration.set_error_of(err_MU[i], [list(ls)])[0]) for i, ls in enumerate(lsets)]
    rem = [removed_pct(flops(pols), gc_flops, flops.none) for _, pols in plans]
    frac_l = [p.fractions()["frac_L"] for p, _ in plans]
    free = [plan_of[arm](i, float("inf"), allowance)[1] for i in range(M)]
    return {"delta": float(d), "violation_rate": float(np.mean(np.asarray(err) > tol)), "err_mean": float(np.mean(err)),
            "recompute_removed_pct": float(np.mean(rem)), "frac_L": float(np.mean(frac_l)),
            "l_units": float(np.mean([len(ls) for ls in lsets])),
            "predicted_removed_pct": 100 * (gc_s - float(np.mean([p.time_s for p, _ in plans]))) / max(gc_s, 1e-12),
            "saturated": all(pols == fr for (_, pols), fr in zip(plans, free)),
            "per_minibatch": {"err": err, "removed_pct": rem, "frac_L": frac_l}, "_lsets": lsets}

  def active_at(arm: str, d: float) -> dict:  # which budget binds each minibatch's plan (as the manager reports)
    out: dict = {}
    for i in range(M):
      t = plan_of[arm](i, d, allowance)[0].time_s * (1 - rtol) - 1e-12
      mem = plan_of[arm](i, d, BIG)[0].time_s < t
      rsk = plan_of[arm](i, float("inf"), allowance)[0].time_s < t
      k = "both" if mem and rsk else "memory" if mem else "risk" if rsk else "none"
      out[k] = out.get(k, 0) + 1
    return out

  sweeps, status, reads, at_cal = {}, {}, {}, {}
  delta0 = cals["never"].delta
  for arm in ARMS:
    progress(f"E1b: sweeping {arm} from {e.sweep_start:g} x delta {delta0:.3g}, doubling")
    sweeps[arm], status[arm] = crit.sweep_until(lambda d, a=arm: point_at(a, d), delta0, e)
    reads[arm] = crit.read(sweeps[arm], e.violation_target)
    d_cal = cals["never" if arm in STATIC_DELTA else "always"].delta
    at_cal[arm] = {k: v for k, v in point_at(arm, d_cal).items() if k not in ("per_minibatch", "_lsets")}
    at_cal[arm]["active"] = active_at(arm, d_cal)
  for arm in ARMS:  # the active constraints where each arm crossed
    pts = sweeps[arm]
    for a_, b_ in zip(pts, pts[1:]):
      if a_["violation_rate"] <= e.violation_target < b_["violation_rate"]:
        a_["active"], b_["active"] = active_at(arm, a_["delta"]), active_at(arm, b_["delta"])
        reads[arm]["active_around"] = [a_["active"], b_["active"]]
        break
  ceiling = removed_pct(flops(b["aggressive"]), gc_flops, flops.none)
  floor = removed_pct(flops(static_mm.plan_at(0, 0.0, allowance)[1]), gc_flops, flops.none)
  clusters = [f"{r.step}:{r.index}" for r in held]
  prim = crit.primary(sweeps, ceiling, floor, clusters, tol, e, s.be.bootstrap)
  sec = crit.secondary(sweeps, at_cal, clusters, tol, e, s.be.bootstrap)
  shares = {a: crit.secondary(sweeps | {"static_clip": sweeps[a]}, at_cal | {"static_clip": at_cal[a]}, clusters,
                              tol, e, s.be.bootstrap) for a in ("hilore_exposure_on", "oracle_bucketed")}
  scores = {"run-time score": on_mm.unit_scores([r.batch for r in held], logp, h.token_err),
            "baseline: static per unit": np.tile(arrays["static_p90"], (M, 1)),
            "static_clip": risk.static_clip(arrays["static_p90"], g_hat, hooks.max_grad_norm)}
  m, (other, cal_other) = s.measured, b["other"]
  inputs = predictors.ScoreInputs(m.prompt_profile, m.profile, np.ones(U), cals["always"].grad_scale)
  batches = [r.batch for r in held]
  raw_held = {sw.coherence: probe.scores(on_mm, batches, inputs, sw, logp, h.token_err),
              other.coherence: probe.scores(on_mm, batches, predictors.ScoreInputs(*inputs[:3], cal_other.grad_scale),
                                            other, logp, h.token_err)}
  ranking_held = {k: {key: v for key, v in crit.ranking(r, err_MU).items() if key != "loo_rho_U"}
                  for k, r in raw_held.items()}
  p4 = exposure_e1.p4_paper(scores, err_MU, clusters, s.be.criteria, s.be.bootstrap, "run-time score")
  arrays.update(err_clipped=h.err_by.get("clipped", err_MU), err_relative=h.err_by["relative"],
                grad_norm=np.asarray([r.grad_norm for r in h.refs]), g_hat=g_hat, clusters=np.array(clusters),
                rollouts=np.array([r.step for r in held]), passes=np.array([r.pass_ for r in held]),
                score_runtime=scores["run-time score"], **{f"raw_{k}": r for k, r in raw_held.items()},
                **{f"bucket_{a}": np.array(ids) for a, (_, ids) in buckets.items()},
                **{f"{a}_delta": np.array([p["delta"] for p in sweeps[a]]) for a in ARMS},
                **{f"{a}_lsets": np.stack([_mask(p.pop("_lsets"), U) for p in sweeps[a]]) for a in ARMS},
                **{f"{a}_removed_pct": np.array([p["per_minibatch"]["removed_pct"] for p in sweeps[a]]) for a in ARMS})
  arms = {a: {"at_target": reads[a], "crossed": status[a] == "crossed", "sweep_status": status[a],
              "points": len(sweeps[a]), "at_calibrated_delta": at_cal[a],
              "distinct_buckets": len(set(buckets[a][1])) if a in buckets else 1} for a in ARMS}
  return {"held_out": {"minibatches": M, "clusters": len(set(clusters)), "rollouts": sorted({r.step for r in held}),
                       "zero_gradient_skipped": h.skipped},
          "reference": {"ceiling_removed_pct": ceiling, "optimal_hr_removed_pct": floor},
          "arms": arms, "sweeps": sweeps, "primary": prim, "secondary": sec, "shares_reported": shares,
          "g_hat_vs_grad_norm_rho": gate.spearman(g_hat, [r.grad_norm for r in h.refs]), "P4": p4,
          "ranking_held_out": ranking_held}


def write(s: exposure_study.Study, out: dict, arrays: dict) -> dict:
  """e1b.json and e1b.md in the run's directory; the json (and its arrays beside it) at bench_exposure.e1b.json."""
  e = s.be.e1b
  stem = os.path.splitext(e.json)[0]
  out["arrays"] = os.path.basename(stem) + "_arrays.npz"
  for path in (os.path.join(s.out_dir, "e1b.json"), e.json):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
      json.dump(out, fh, indent=1, default=float)
  np.savez_compressed(stem + "_arrays.npz", **arrays)
  with open(os.path.join(s.out_dir, "e1b.md"), "w") as fh:
    fh.write(crit.markdown(out))
  return out
