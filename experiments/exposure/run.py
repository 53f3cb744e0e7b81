"""Does run-time exposure predict and decide? On the rollouts and calibration of experiments/exposure/study.py: per
held-out minibatch and unit the measured error of that unit alone as L, of every risk metric (memory/risk.py); every
predictor's scores and the one that ranks errors best within unit; per arm (optimal_hr, hilore_static, hilore with
exposure off / on, an oracle allocating from the measured errors) the plan at the calibrated delta and its realised
error, and a sweep over delta read at one violation rate (recompute FLOPs removed, the cost model's predicted
removal; experiments/exposure/sweep.py). Step times only with bench_exposure.timing. Writes exposure.json,
exposure.md, exposure.png, exposure_sweep.png and exposure_arrays.npz (every held-out error and score, each
minibatch's ||g|| and each unit's absolute error). run() runs the phases in order: prepare, held_out, predict,
compare, write."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Any, Callable

import jax
import numpy as np

from hilore_jax import model, stats
from hilore_jax.loop import step_hooks
from experiments.exposure import e1 as exposure_e1, risk as exposure_risk, sweep as exposure_sweep
from experiments.common.config import ExposureBenchConfig
from experiments.exposure.report import (compare_arms, e1_markdown, plot, plot_sweep, report, spearman_summary,
                                         where_it_varies)
from experiments.exposure.study import (ALWAYS, HeldOut, Study, held_out, prepare)
from experiments.exposure.study import (Record, calibrate_on, collect, measure_held_out, split,  # noqa: F401
                                        without_gradients)
from experiments.exposure.timing import time_plans
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError
from hilore_jax.memory import MemoryManager, calibration, predictors, probe, risk

log = logging.getLogger(__name__)
ARMS = ("optimal_hr", "hilore_static", "hilore_exposure_off", "hilore_exposure_on", "oracle")
SWEPT = ("hilore_static", "hilore_exposure_off", "hilore_exposure_on", "oracle")  # the risk-budgeted arms


def arm_managers(cfg: Config, be: ExposureBenchConfig, hooks) -> dict[str, MemoryManager]:
  mc = cfg.memory.at_budget(None)  # memory.budget_ratio for every arm, never an absolute budget
  if mc.buckets <= 1:
    raise ConfigError("memory.buckets must be > 1 for the exposure-on arm (1 is the exposure-off arm)")
  # every arm calibrates and scores with the forward's per-token errors the bench gives allocate
  arm = lambda **kw: MemoryManager(dataclasses.replace(mc, **kw), hooks, probe=probe.StudyProbe(forward_errors=True))
  return {"optimal_hr": arm(policy="optimal_hr"), "hilore_static": arm(policy="hilore_static"),
          "hilore_exposure_off": arm(policy="hilore", buckets=1),
          "hilore_exposure_on": arm(policy="hilore", gate=ALWAYS),
          # the minibatch's *measured* single-unit errors as its scores (probe.give_errors before allocate): the same
          # grid, buckets, solver and budget fit, with a perfect predictor
          "oracle": MemoryManager(dataclasses.replace(mc, policy="hilore", gate=ALWAYS), hooks,
                                  probe=probe.StudyProbe(forward_errors=True, oracle=True))}


def run(cfg: Config, be: ExposureBenchConfig, out_dir: str, progress=print) -> dict:
  """Collect, calibrate, measure the held-out minibatches, compare predictors, allocate under every arm and sweep
  delta; write the report."""
  s = prepare(cfg, be, out_dir, progress)
  h = held_out(s, progress)
  p = predict(s, h, progress)
  a = compare(s, h, p, progress)
  result = write(s, h, p, a, progress)
  shutil.rmtree(s.spill_dir, ignore_errors=True)
  return result


@dataclasses.dataclass
class Prediction:
  """The predictors on the held-out minibatches: the score table ((raw, susceptibility) per score), the chosen one
  and its comparison figures, the units measured (mu) and the deciding metric's errors."""

  table: dict
  chosen: str
  risk_prediction: dict
  by_metric: dict
  risk_table: dict
  by_kind: dict
  mu: list
  err_MU: np.ndarray


def predict(s: Study, h: HeldOut, progress=print) -> Prediction:
  """Every predictor's held-out scores against the deciding metric's errors; the chosen one ranks them best."""
  metric, units = s.cfg.memory.risk_metric, s.units
  err_MU, mu = h.err_by[metric], [i for i, (l, _) in enumerate(units) if h.layers is None or l in h.layers]
  progress("risk prediction on the held-out minibatches")
  scores = exposure_risk.predictor_scores(s.calib_mm, h.records, h.token_err)
  raw = {k: v[0][:, mu] for k, v in scores.items()}
  risk_prediction, chosen = predictors.compare(raw, err_MU[:, mu], s.be.bootstrap)
  by_metric = {m: predictors.compare(raw, e[:, mu], s.be.bootstrap)[0] for m, e in h.err_by.items()}
  table = {**scores, **exposure_risk.other_scores(s.calib_mm, h.records, h.token_err, chosen)}
  static = np.asarray(s.calib_mm.state.calibration.static_error)
  table["baseline: static per unit"] = (np.tile(static, (len(h.records), 1)), np.ones(len(units)))
  risk_table = {k: spearman_summary(r[:, mu], err_MU[:, mu], s.be.bootstrap, pooled_MU=(r * sc)[:, mu])
                for k, (r, sc) in table.items()}
  rho_U = predictors.within_unit_spearman(raw[chosen], err_MU[:, mu])
  kinds = [units[i][1] for i in mu]
  by_kind = {k: float(np.median(x[np.isfinite(x)])) if np.isfinite(x).any() else float("nan")
             for k in sorted(set(kinds)) for x in [rho_U[[j for j, y in enumerate(kinds) if y == k]]]}
  exposure_risk.save_arrays(os.path.join(s.out_dir, "exposure_arrays.npz"), units, mu, h.err_by, table,
                            [r.grad_norm for r in h.refs])
  progress(f"chosen predictor {chosen}: within-unit rho {risk_prediction[chosen]['within_unit_rho_median']:.2f}")
  return Prediction(table, chosen, risk_prediction, by_metric, risk_table, by_kind, mu, err_MU)


def regime_of(s: Study, manager: MemoryManager) -> dict:
  """E1's regime figures: No-GC's compiled peak against GC's and the budget, and every unit L's median calibration
  error against the tolerance (exact from the units' own errors where they add; else one probe each)."""
  mc, hooks, units, m0, metric = s.cfg.memory, s.hooks, s.units, s.measured, s.cfg.memory.risk_metric
  L, tol = hooks.model_cfg.num_hidden_layers, mc.grad_err_tolerance
  every = [list(range(len(units)))]
  unscaled = np.ones(len(m0.err)) if m0.row_scale is None else np.asarray(m0.row_scale)  # as the probes measure
  all_l = ([float(calibration.set_error_of(e, every)[0]) / sc for e, sc in zip(m0.err, unscaled)]  # exact, no probe
           if mc.calib_decompose and calibration.additive(units, (metric,)) else
           [float(calibration.set_errors(hooks, c.params, b, units, every, mc.group_size, mc.lowp_format, r)[0])
            for c, b, r in zip(m0.contexts, m0.batches, m0.refs)])
  gc_peak = hooks.compile_peak(model.uniform(L, model.FULL_REMAT), s.cal[0].batch)
  none_peak = hooks.compile_peak(model.uniform(L, model.NO_REMAT), s.cal[0].batch)
  return {"gc_peak_bytes": gc_peak, "none_peak_bytes": none_peak, "none_over_gc": none_peak / gc_peak,
          "budget_bytes": manager.state.budget_bytes, "memory_binds": none_peak > manager.state.budget_bytes,
          "all_L_error": float(np.median(all_l)), "tolerance": tol, "risk_binds": float(np.median(all_l)) > tol}


@dataclasses.dataclass
class Comparison:
  """The arms on one calibration (the chosen predictor's): the regime, each arm's plans at the calibrated delta,
  the paired comparisons, and the delta sweep read at the violation target."""

  cal_state: Any
  regime: dict
  arms: dict
  pairs: dict
  closed: dict
  sweep: dict
  equal: dict
  allowance: int | None


def compare(s: Study, h: HeldOut, p: Prediction, progress=print) -> Comparison:
  """Every arm's plan per held-out minibatch at the calibrated delta and its realised error, and (bench_exposure.arms)
  each risk-budgeted arm swept over delta at one byte allowance."""
  cfg, be, mc, hooks = s.cfg, s.be, s.cfg.memory, s.hooks
  metric, tol, L = mc.risk_metric, mc.grad_err_tolerance, hooks.model_cfg.num_hidden_layers
  # every arm on one calibration: the chosen predictor's, fitted on the same measurements
  sw = predictors.with_predictor(mc.exposure, p.chosen)
  cal_state = s.calib_mm.fit_calibration(s.measured, sw)
  managers = arm_managers(dataclasses.replace(cfg, memory=dataclasses.replace(mc, exposure=sw)), be, hooks)
  for m in managers.values():
    m.setup(s.cal[0].params, [r.batch for r in s.cal], 0, calibration_state=cal_state)
  on = managers["hilore_exposure_on"]
  regime = regime_of(s, on)
  progress(f"regime: No-GC/GC peak {regime['none_over_gc']:.2f}x, budget {mc.budget_ratio}x; every unit L "
           f"{regime['all_L_error']:.2e} vs tolerance {tol:.0e}")
  if not be.arms:
    return Comparison(cal_state, regime, {}, {}, {}, {}, {}, None)
  realised = realised_errors(s, h)
  per_arm = allocate_arms(s, h, p, managers, realised)
  held = h.records
  plan_flops = exposure_sweep.PlanFlops(hooks.gradient, L, held[0].params, held[0].batch)
  gc_flops, gc_s = plan_flops(model.uniform(L, model.FULL_REMAT)), on.gc_plan().time_s
  rounds = time_plans(s.trainer, s.spec, per_arm, held[0], be.reps, cfg.seed) if be.timing else None
  arms = {}
  for a in ARMS:
    arms[a] = arm_summary(per_arm[a], metric, tol, plan_flops, gc_flops, gc_s)
    if rounds is not None:
      arms[a].update(rounds[a])
  pairs, closed = compare_arms(arms)
  sweep, equal, allowance = sweep_arms(s, h, managers, per_arm, realised, cal_state.delta, plan_flops, (gc_flops, gc_s),
                                      progress)
  return Comparison(cal_state, regime, arms, pairs, closed, sweep, equal, allowance)


def realised_errors(s: Study, h: HeldOut) -> Callable[[int, tuple], dict]:
  """(i, lset) -> every metric of held-out minibatch i's gradient with lset L, memoised: exact from the units' own
  errors where they add (sets of WEIGHT_READS units measured at every layer), else one probe gradient."""
  mc, units, held, refs, cache = s.cfg.memory, s.units, h.records, h.refs, {}
  exact_units = mc.calib_decompose and calibration.additive(units, refs[0].available())

  def realised(i: int, lset: tuple) -> dict:
    if (i, lset) not in cache:
      r, ms = held[i], refs[i].available()
      cache[(i, lset)] = dict(zip(ms, calibration.set_error_of(np.stack([h.err_by[m][i] for m in ms], 1),
                                                               [list(lset)])[0] if exact_units else
                                  calibration.set_errors(s.hooks, r.params, r.batch, units, [list(lset)],
                                                         mc.group_size, mc.lowp_format, refs[i], ms)[0]))
    return cache[(i, lset)]

  return realised


def allocate_arms(s: Study, h: HeldOut, p: Prediction, managers: dict[str, MemoryManager],
                  realised) -> dict[str, list[dict]]:
  """Every arm's allocation per held-out minibatch at the calibrated delta, with its realised errors (the oracle
  given the minibatch's measured errors first)."""
  per_arm = {a: [] for a in ARMS}
  for i, r in enumerate(h.records):
    probe.give_errors(managers["oracle"], p.err_MU[i])
    for a in ARMS:
      al = managers[a].allocate([r.batch], [r.logp], [h.token_err[i]])[0]
      per_arm[a].append({"policies": al.policies, "bucket": al.bucket, "plan_risk": float(al.plan.risk),
                         "predicted_s": float(al.plan.time_s), "active": al.active_constraint, "step": r.step,
                         "pass": r.pass_, "errors": realised(i, exposure_sweep.lowp_set(al.policies, s.units)),
                         **{k: al.metrics[f"alloc/{k}"] for k in ("frac_H", "frac_L", "frac_R")}})
  return per_arm


def sweep_arms(s: Study, h: HeldOut, managers: dict[str, MemoryManager], per_arm: dict, realised, delta: float,
               plan_flops, gc: tuple[float, float], progress=print) -> tuple[dict, dict, int]:
  """Each risk-budgeted arm swept over multiples of the calibrated delta at one byte allowance, read at the violation
  target (with bench_exposure.recalibrate_rollout also issue 36's periodic-static arm): (sweep, equal, allowance)."""
  be, mc, units, (gc_flops, gc_s) = s.be, s.cfg.memory, s.units, gc
  metric, tol, on = mc.risk_metric, mc.grad_err_tolerance, managers["hilore_exposure_on"]
  # one byte allowance for every arm and delta, the smallest any of their buckets fitted: the arms differ in risk
  # alone (the swept plans are not compiled)
  allowance = min([a for m in SWEPT for b, a in managers[m].state.allowance.items()
                   if int(b) not in managers[m].state.fallback_gc] or [on.state.budget_bytes - on.state.gc_bytes])
  progress(f"sweeping delta x {list(be.sweep)} for {', '.join(SWEPT)} at an allowance of {allowance} B")
  err_of = lambda i, lset: realised(i, lset)[metric]
  sweep, equal = {}, {}
  for a in SWEPT:
    sweep[a] = exposure_sweep.sweep_arm(lambda b, d, m=managers[a]: m.plan_at(b, d, allowance),
                                        [e["bucket"] for e in per_arm[a]], be.sweep, delta, err_of, plan_flops,
                                        gc_flops, gc_s, tol, units)
    equal[a] = exposure_sweep.at_violation(sweep[a], be.violation_target)
  if be.recalibrate_rollout:  # issue 36's periodic-static arm, recalibrated on that rollout's minibatches
    sweep["hilore_periodic_static"], equal["hilore_periodic_static"] = exposure_e1.periodic_sweep(
        mc, be, s.hooks, s.records, h.records, allowance, err_of, plan_flops, gc_flops, gc_s, tol, units)
  return sweep, equal, allowance


def arm_summary(es: list[dict], metric: str, tol: float, plan_flops, gc_flops: float, gc_s: float) -> dict:
  """One arm's figures over its held-out allocations (recompute removed, predicted removal, errors, violations,
  shares, plans, buckets, the active constraints) and each minibatch's record."""
  errs = np.array([e["errors"][metric] for e in es])
  viol = (errs > tol).astype(float)
  distinct = list(dict.fromkeys(e["policies"] for e in es))
  return {"recompute_removed_pct": exposure_sweep.removed_pct(
              float(np.mean([plan_flops(e["policies"]) for e in es])), gc_flops, plan_flops.none),
          "predicted_removed_pct": 100 * (gc_s - np.mean([e["predicted_s"] for e in es])) / max(gc_s, 1e-12),
          "err_mean": float(errs.mean()), "err_max": float(errs.max()),
          "err_mean_by_metric": {m: float(np.mean([e["errors"][m] for e in es])) for m in es[0]["errors"]},
          "violation_rate": float(viol.mean()), "violation_ci": list(stats.bootstrap_ci(viol)),
          **{k: float(np.mean([e[k] for e in es])) for k in ("frac_L", "frac_R")},
          "distinct_plans": len(distinct), "buckets": len({e["bucket"] for e in es}),
          "active": sorted({e["active"] for e in es}),
          "per_minibatch": [{**{k: v for k, v in e.items() if k != "policies"},
                             "plan": [dataclasses.asdict(q) for q in e["policies"]]} for e in es]}


def write(s: Study, h: HeldOut, p: Prediction, c: Comparison, progress=print) -> dict:
  """The update-effect and KL-clamp side studies, then exposure.json / .md / .png / _sweep.png (and E1's summary
  where bench_exposure.e1_json is set)."""
  cfg, be, mc, held, refs, units = s.cfg, s.be, s.cfg.memory, h.records, h.refs, s.units
  metric = mc.risk_metric
  progress("which error definition predicts the update's effect")
  effects = exposure_risk.update_effects(s.hooks, held, refs, units, mc)
  kl_spread = {}
  if cfg.grpo.beta > 0 and cfg.grpo.kl_estimator == "k3" and be.kl_clamps:
    progress(f"||g||'s spread with grpo.kl_clamp in {list(be.kl_clamps)}")
    hooks_for = lambda clamp: step_hooks.memory_hooks(None, dataclasses.replace(
        s.spec, loss_cfg=dataclasses.replace(s.spec.loss_cfg, kl_clamp=clamp)))
    kl_spread = exposure_risk.kl_clamp_spread(hooks_for, held, [r.grad_norm for r in refs], be.kl_clamps)
  kinds = [units[i][1] for i in p.mu]
  counts = {"calibration": len(s.cal), "held_out": len(held), "held_out_zero_gradient_skipped": h.skipped,
            "calib_steps": sorted({r.step for r in s.cal}), "held_out_steps": sorted({r.step for r in held}),
            "units_measured": len(p.mu), "units": len(units)}
  cs = c.cal_state
  result = {"config": {**cfg.to_dict(), "bench_exposure": dataclasses.asdict(be)}, "regime": c.regime,
            "minibatches": counts, "error_definition": f"{metric}: {risk.DEFINITIONS[metric]}",
            "chosen_predictor": p.chosen, "risk_prediction": p.risk_prediction,
            "risk_prediction_by_metric": p.by_metric, "equal_violation": c.equal, "sweep": c.sweep,
            "sweep_allowance_bytes": c.allowance,
            "calibration": {"delta": cs.delta, "coherence": cs.coherence, "calibration_error": cs.calibration_error,
                            "grad_scale": cs.grad_scale, "gate": cs.gate},
            "arms": c.arms, "pairs": c.pairs, "oracle_gap_closed": c.closed, "risk": p.risk_table,
            "risk_by_kind": p.by_kind, "kl_clamp": kl_spread, "error_definition_vs_effect": effects,
            "varies": where_it_varies([r.describe for r in held], [r.pass_ for r in held], p.err_MU[:, p.mu], kinds),
            "units": [f"{l}:{k}" for l, k in units], "seconds": time.perf_counter() - s.t_start,
            "backend": jax.default_backend(), "jax": jax.__version__}
  with open(os.path.join(s.out_dir, "exposure.json"), "w") as f:
    json.dump(result, f, indent=1, default=float)
  with open(os.path.join(s.out_dir, "exposure.md"), "w") as f:
    f.write(report(result))
  plot(result, os.path.join(s.out_dir, "exposure.png"))
  plot_sweep(result, os.path.join(s.out_dir, "exposure_sweep.png"))
  if be.e1_json:  # issue 36's E1 summary: P1-P4 with cluster CIs over row sets, and the gate's decision
    e1 = exposure_e1.write(be, metric, s.cal, held, h.err_by, units, p.mu, p.table, p.chosen, c.sweep, cs,
                           mc.grad_err_tolerance)
    with open(os.path.join(s.out_dir, "exposure_e1.md"), "w") as f:
      f.write(e1_markdown(e1))
  return result
