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
            violation rate crosses the target (experiments/exposure/e1b_arms.py), no plan compiled
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

from experiments.exposure import e1 as exposure_e1, study as exposure_study
from experiments.exposure import e1b_criteria as crit
from experiments.exposure.e1b_arms import compare, mask
from experiments.exposure.sweep import lowp_set
from hilore_jax import model
from hilore_jax.errors import ConfigError
from hilore_jax.memory import MemoryManager, calibration, gate, predictors, probe


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
  out = {"config": _config_path(), "command": " ".join(["python -m experiments.exposure.main", *sys.argv[1:]]),
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
            "aggressive_lset": mask([lset], len(s.units))[0], "tolerance": np.float64(tol)}
  return {"regime": regime, "calibration": calib, "arrays": arrays, "static_mm": static_mm, "cals": cals,
          "allowance": allowance, "aggressive": aggressive.policies, "mc_tol": mc_tol,
          "other": (other, cal_other)}


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
