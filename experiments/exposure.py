"""Does run-time exposure predict and decide? Real rollout minibatches of a policy (a warm-started tiny model, or a
pretrained one: model.path), several rollouts of grpo.num_iterations passes (later passes are off-policy and clip);
calibration on the first minibatches, each at the params and optimizer state its update saw; everything later held
out. Per held-out minibatch and unit the measured error of that unit alone as L, of every risk metric
(memory/risk.py); every predictor's scores and the one that ranks errors best within unit; per arm (optimal_hr,
hilore_static, hilore with exposure off / on, an oracle allocating from the measured errors) the plan at the
calibrated delta and its realised error, and a sweep over delta read at one violation rate (recompute FLOPs removed,
the cost model's predicted removal; experiments/exposure_sweep.py). Step times only with bench_exposure.timing. Writes
exposure.json, exposure.md, exposure.png, exposure_sweep.png and exposure_arrays.npz (every held-out error and score,
each minibatch's ||g|| and each unit's absolute error). Long on purpose: the study's steps, in order, in one run()."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model, stats
from hilore_jax.loop import step_hooks
from experiments import exposure_e1, exposure_risk, exposure_sweep, spill
from experiments.config import ExposureBenchConfig
from experiments.exposure_report import (compare_arms, e1_markdown, plot, plot_sweep, report, spearman_summary,
                                         where_it_varies)
from experiments.exposure_timing import time_plans
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError
from hilore_jax.memory import MemoryManager, calibration, predictors, probe, risk
from hilore_jax.memory.config import GateConfig
from hilore_jax.rl import train_step

log = logging.getLogger(__name__)
ARMS = ("optimal_hr", "hilore_static", "hilore_exposure_off", "hilore_exposure_on", "oracle")
ALWAYS = GateConfig(mode="always")  # the exposure arms run buckets whatever the gate measured (it is reported)
SWEPT = ("hilore_static", "hilore_exposure_off", "hilore_exposure_on", "oracle")  # the risk-budgeted arms


@dataclasses.dataclass
class Record:
  """One minibatch as an update saw it: the policy's params (and optimizer state) then, the batch (host arrays),
  on a later pass the log-probs at those params (`logp`, else None: the batch's old ones), what describes it."""

  step: int
  pass_: int
  index: int
  kept_params: Any  # the params, or spill.Spilled: read back on each access of .params
  batch: Any
  describe: dict
  logp: np.ndarray | None = None
  kept_opt: Any = None
  params = property(lambda self: spill.load(self.kept_params))
  opt_state = property(lambda self: spill.load(self.kept_opt))


def without_gradients(refs: list, units) -> list:
  """The references, each without its exact gradient where every error it serves is read off its weight-read unit
  errors (calibration.set_error_of): 0.5 GB each for SmolLM2, and a bench holds dozens."""
  return [dataclasses.replace(r, grad=None)
          if r.weight_errors is not None and calibration.additive(units, r.available()) else r for r in refs]


def collect(trainer, steps: int, progress=print, opt_state: bool = True, spill_dir: str | None = None) -> list[Record]:
  """Warm-start (if set), then `steps` rollouts, each trained for grpo.num_iterations passes under the run's own
  step, recording every minibatch with the params (and optimizer state) its update saw: on disk under spill_dir."""
  c = trainer.config
  if c.train.warmstart_steps:
    trainer.warmstart()
    progress(f"warm-start loss {trainer.warmstart_losses[0]:.3f} -> {trainer.warmstart_losses[-1]:.3f}")
  if c.grpo.beta > 0:
    trainer.ref_params = jax.tree_util.tree_map(jnp.copy, trainer.state["params"])
  records = []
  for step in range(steps):
    roll = trainer.next_rollout()
    plan = trainer.plan_update(roll, np.random.default_rng([c.seed, step]), step)
    if not len(plan):  # every group's rewards equal and filtered out: nothing to update
      progress(f"rollout {step + 1}/{steps}: no update rows (every group zero-std and grpo.filter_zero_std)")
      continue
    plan = trainer.add_logprobs(plan)
    for it in range(c.grpo.num_iterations):
      for j, b in enumerate(plan.pass_batches(it, trainer.spec.use_old_logp)):
        where = None if spill_dir is None else os.path.join(spill_dir, f"{len(records)}")  # the step donates the state
        params = spill.keep(trainer.state["params"], where and where + "p")
        opt = spill.keep(trainer.state["opt_state"], where and where + "o") if opt_state else None
        trainer.state, m = trainer.stepper(trainer.spec, trainer.state, b)
        # its own log-probs (a forward at `params`), not the previous pass's (before its own update there)
        logp, rec = m.pop(train_step.TOKEN_LOGP), jax.device_get(b)
        mask = rec.mask
        records.append(Record(step, it, j, params, rec, {
            "zero_adv_share": float(np.mean(rec.adv == 0)), "clipfrac": float(m["clipfrac"]),
            "completion_len_mean": float(mask.sum(1).mean()), "completion_len_max": int(mask.sum(1).max()),
            "reward_mean": float(roll.rewards.mean())}, np.asarray(logp) if it > 0 else None, opt))
    progress(f"rollout {step + 1}/{steps}: reward {float(roll.rewards.mean()):.3f}, completion length "
             f"{float(roll.mask.sum(1).mean()):.1f} (max {int(roll.mask.sum(1).max())} of {roll.mask.shape[1]})")
  return records


def split(records: list[Record], calib: int) -> tuple[list[Record], list[Record]]:
  """(calibration, held out): the first `calib` minibatches, and every minibatch of a strictly later rollout (so
  no held-out minibatch shares a rollout, let alone a batch, with calibration)."""
  if calib >= len(records):
    raise ConfigError(f"bench_exposure.calib_minibatches ({calib}) leaves no held-out minibatch of {len(records)}")
  cal = records[:calib]
  last = max(r.step for r in cal)
  held = [r for r in records if r.step > last]
  if not held:
    raise ConfigError("no rollout after the calibration minibatches: raise bench_exposure.rollout_steps")
  return cal, held


def arm_managers(cfg: Config, be: ExposureBenchConfig, hooks) -> dict[str, MemoryManager]:
  mc = cfg.memory.at_budget(None)  # memory.budget_ratio for every arm, never an absolute budget
  if mc.buckets <= 1:
    raise ConfigError("memory.buckets must be > 1 for the exposure-on arm (1 is the exposure-off arm)")
  return {"optimal_hr": MemoryManager(dataclasses.replace(mc, policy="optimal_hr"), hooks),
          "hilore_static": MemoryManager(dataclasses.replace(mc, policy="hilore_static"), hooks),
          "hilore_exposure_off": MemoryManager(dataclasses.replace(mc, policy="hilore", buckets=1), hooks),
          "hilore_exposure_on": MemoryManager(dataclasses.replace(mc, policy="hilore", gate=ALWAYS), hooks),
          # the minibatch's *measured* single-unit errors as its scores (probe.give_errors before allocate): the same
          # grid, buckets, solver and budget fit, with a perfect predictor
          "oracle": probe.oracle(dataclasses.replace(mc, policy="hilore", gate=ALWAYS), hooks)}


def calibrate_on(manager: MemoryManager, cal: list[Record]):
  """Calibrate on the records, each measured at the params and optimizer state its own update saw."""
  contexts = [spill.KeptContext(r, r.logp) for r in cal]
  manager.setup(cal[0].params, [r.batch for r in cal], 0, contexts=contexts)


def measure_held_out(hooks, mc, held: list[Record], units, progress=print):
  """(records with a gradient, their references, {metric: [M, U] each unit's error alone}): every metric the
  records allow, units at memory.calib_layers' layers measured and the rest interpolated over depth."""
  layers = calibration.probed_layers(hooks.model_cfg.num_hidden_layers, mc.calib_layers)
  kept, refs, errs = [], [], []
  instrumented = mc.calib_decompose and calibration.additive(units, (mc.risk_metric,))  # one backward each
  for i, r in enumerate(held):
    # with an optimizer state every metric includes the update's, which needs probes: they compare against the
    # probe program's own gradient, never the instrumented one's
    ref = calibration.reference(hooks, calibration.UpdateContext(r.params, r.opt_state), r.batch, mc.risk_metric,
                                mc.lowp_format, mc.group_size,
                                instrumented and (r.opt_state is None or hooks.optimizer_update is None))
    if ref.grad_norm == 0:  # no gradient (every advantage zero, no KL yet): no error to measure
      continue
    kept.append(r)
    errs.append(calibration.measure_unit_errors(hooks, r.params, r.batch, units, mc.group_size, mc.lowp_format,
                                                ref, layers, ref.available(), mc.calib_decompose))
    refs += without_gradients([ref], units)  # every later error is read off the unit errors
    if (i + 1) % 5 == 0:
      progress(f"measured {i + 1}/{len(held)} held-out minibatches")
  err = np.stack(errs)  # [M, U, metrics]
  return kept, refs, {m: err[:, :, k] for k, m in enumerate(refs[0].available())}, layers


def run(cfg: Config, be: ExposureBenchConfig, out_dir: str, progress=print) -> dict:
  """Collect, calibrate, measure the held-out minibatches, compare predictors, allocate under every arm and sweep
  delta; write the report."""
  from hilore_jax.loop.trainer import Trainer

  if cfg.grpo.num_iterations < 2:
    raise ConfigError("bench_exposure needs grpo.num_iterations >= 2 (off-policy passes, where ratios clip)")
  if cfg.memory.risk_metric == "update" and not be.update_error:
    raise ConfigError("memory.risk_metric=update needs bench_exposure.update_error=true (optimizer states)")
  os.makedirs(out_dir, exist_ok=True)
  t_start = time.perf_counter()
  trainer = Trainer(dataclasses.replace(cfg, out_dir=os.path.join(out_dir, "collect"),
                                        memory=dataclasses.replace(cfg.memory, policy="none")))
  spill_dir = os.path.join(out_dir, "records")  # removed at the end: a real model's params are GBs per rollout
  records = collect(trainer, be.rollout_steps, progress, be.update_error, spill_dir)
  cal, held = split(records, be.calib_minibatches)
  cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, calib_batches=len(cal)))  # all of them
  held = held[:be.held_out or None]
  spec = dataclasses.replace(trainer.spec, use_old_logp=True)
  hooks = step_hooks.memory_hooks(trainer.stepper, spec, cfg.optimizer.max_grad_norm)
  L = trainer.model_cfg.num_hidden_layers
  units = calibration.lowp_units(L, cfg.memory.lowp_kinds)
  mc, tol, metric = cfg.memory, cfg.memory.grad_err_tolerance, cfg.memory.risk_metric
  calib_mm = MemoryManager(dataclasses.replace(mc.at_budget(None, "hilore"), gate=ALWAYS), hooks)
  # the bench gives cotangent_forward the forward's errors (token_err below), and refits predictors on one measurement
  probe.use_forward_errors(calib_mm)
  probe.keep_measurements(calib_mm)
  calibrate_on(calib_mm, cal)
  measured = probe.measurements(calib_mm)
  measured.refs = without_gradients(measured.refs, units)  # kept for the predictors' fits, which read only norms
  if not any(r.grad_norm > 0 for r in measured.refs):
    raise ConfigError("no calibration minibatch has a gradient (rewards all equal, no KL yet): choose a task or "
                      "temperature with mixed rewards, or raise bench_exposure.calib_minibatches")
  progress(f"calibrated on {len(cal)} minibatches ({metric} error), each at its own params")

  n_held = len(held)
  held, refs, err_by, layers = measure_held_out(hooks, mc, held, units, progress)
  err_MU, mu = err_by[metric], [i for i, (l, _) in enumerate(units) if layers is None or l in layers]
  # per-token errors of the forward the step runs anyway: the old-log-prob forward at the rollout's first params
  start = {r.step: r for r in records if r.pass_ == 0 and r.index == 0}
  fwd = jax.jit(lambda p, b: calibration.token_errors(hooks, p, b, units, mc.group_size, mc.lowp_format))
  seen: dict = {}  # a row set's two passes are one batch at one rollout's params: one forward for both
  key = lambda r: (r.step, np.asarray(r.batch.tokens).tobytes(), np.asarray(r.batch.prompt_ids).tobytes())
  token_err = [seen[key(r)] if key(r) in seen else seen.setdefault(key(r), fwd(start[r.step].params, r.batch))
               for r in held]

  progress("risk prediction on the held-out minibatches")
  scores = exposure_risk.predictor_scores(calib_mm, held, token_err)
  raw = {k: v[0][:, mu] for k, v in scores.items()}
  risk_prediction, chosen = predictors.compare(raw, err_MU[:, mu], be.bootstrap)
  by_metric = {m: predictors.compare(raw, e[:, mu], be.bootstrap)[0] for m, e in err_by.items()}
  table = {**scores, **exposure_risk.other_scores(calib_mm, held, token_err, chosen)}
  static = np.asarray(calib_mm.state.calibration.static_error)
  table["baseline: static per unit"] = (np.tile(static, (len(held), 1)), np.ones(len(units)))
  risk_table = {k: spearman_summary(r[:, mu], err_MU[:, mu], be.bootstrap, pooled_MU=(r * s)[:, mu])
                for k, (r, s) in table.items()}
  rho_U = predictors.within_unit_spearman(raw[chosen], err_MU[:, mu])
  kinds = [units[i][1] for i in mu]
  by_kind = {k: float(np.median(x[np.isfinite(x)])) if np.isfinite(x).any() else float("nan")
             for k in sorted(set(kinds)) for x in [rho_U[[j for j, y in enumerate(kinds) if y == k]]]}
  exposure_risk.save_arrays(os.path.join(out_dir, "exposure_arrays.npz"), units, mu, err_by, table,
                            [r.grad_norm for r in refs])
  progress(f"chosen predictor {chosen}: within-unit rho {risk_prediction[chosen]['within_unit_rho_median']:.2f}")

  # every arm on one calibration: the chosen predictor's, fitted on the same measurements
  sw = predictors.with_predictor(mc.exposure, chosen)
  cal_state = calib_mm.fit_calibration(measured, sw)
  managers = arm_managers(dataclasses.replace(cfg, memory=dataclasses.replace(mc, exposure=sw)), be, hooks)
  for m in managers.values():
    probe.use_forward_errors(m)
    m.setup(cal[0].params, [r.batch for r in cal], 0, calibration_state=cal_state)
  on = managers["hilore_exposure_on"]
  m0 = measured
  every = [list(range(len(units)))]
  unscaled = np.ones(len(m0.err)) if m0.row_scale is None else np.asarray(m0.row_scale)  # as the probes measure
  all_l = ([float(calibration.set_error_of(e, every)[0]) / s for e, s in zip(m0.err, unscaled)]  # exact, no probe
           if mc.calib_decompose and calibration.additive(units, (metric,)) else
           [float(calibration.set_errors(hooks, c.params, b, units, every, mc.group_size, mc.lowp_format, r)[0])
            for c, b, r in zip(m0.contexts, m0.batches, m0.refs)])
  gc_peak = hooks.compile_peak(model.uniform(L, model.FULL_REMAT), cal[0].batch)
  none_peak = hooks.compile_peak(model.uniform(L, model.NO_REMAT), cal[0].batch)
  regime = {"gc_peak_bytes": gc_peak, "none_peak_bytes": none_peak, "none_over_gc": none_peak / gc_peak,
            "budget_bytes": on.state.budget_bytes, "memory_binds": none_peak > on.state.budget_bytes,
            "all_L_error": float(np.median(all_l)), "tolerance": tol, "risk_binds": float(np.median(all_l)) > tol}
  progress(f"regime: No-GC/GC peak {regime['none_over_gc']:.2f}x, budget {cfg.memory.budget_ratio}x; every unit L "
           f"{regime['all_L_error']:.2e} vs tolerance {tol:.0e}")

  arms, pairs, closed, sweep, equal = {}, {}, {}, {}, {}
  if be.arms:
    cache: dict = {}

    # sets of WEIGHT_READS units measured at every layer: their errors from the units' own (exact, no probe)
    exact_units = mc.calib_decompose and calibration.additive(units, refs[0].available())

    def realised(i: int, lset: tuple) -> dict:  # every metric of minibatch i's gradient with lset L
      if (i, lset) not in cache:
        r, ms = held[i], refs[i].available()
        cache[(i, lset)] = dict(zip(ms, calibration.set_error_of(np.stack([err_by[m][i] for m in ms], 1),
                                                                 [list(lset)])[0] if exact_units else
                                    calibration.set_errors(hooks, r.params, r.batch, units, [list(lset)],
                                                           mc.group_size, mc.lowp_format, refs[i], ms)[0]))
      return cache[(i, lset)]

    per_arm = {a: [] for a in ARMS}
    for i, r in enumerate(held):
      probe.give_errors(managers["oracle"], err_MU[i])
      for a in ARMS:
        al = managers[a].allocate([r.batch], [r.logp], [token_err[i]])[0]
        per_arm[a].append({"policies": al.policies, "bucket": al.bucket, "plan_risk": float(al.plan.risk),
                           "predicted_s": float(al.plan.time_s), "active": al.active_constraint, "step": r.step,
                           "pass": r.pass_, "errors": realised(i, exposure_sweep.lowp_set(al.policies, units)),
                           **{k: al.metrics[f"alloc/{k}"] for k in ("frac_H", "frac_L", "frac_R")}})
    plan_flops = exposure_sweep.PlanFlops(hooks.gradient, L, held[0].params, held[0].batch)
    gc_flops, gc_s = plan_flops(model.uniform(L, model.FULL_REMAT)), on.gc_plan().time_s
    rounds = time_plans(trainer, spec, per_arm, held[0], be.reps, cfg.seed) if be.timing else None
    for a in ARMS:
      es = per_arm[a]
      errs = np.array([e["errors"][metric] for e in es])
      viol = (errs > tol).astype(float)
      distinct = list(dict.fromkeys(e["policies"] for e in es))
      arms[a] = {"recompute_removed_pct": exposure_sweep.removed_pct(
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
      if rounds is not None:
        arms[a].update(rounds[a])
    pairs, closed = compare_arms(arms)
    # one byte allowance for every arm and delta, the smallest any of their buckets fitted: the arms differ in risk
    # alone (the swept plans are not compiled)
    allowance = min([a for m in SWEPT for b, a in managers[m].state.allowance.items()
                     if int(b) not in managers[m].state.fallback_gc] or [on.state.budget_bytes - on.state.gc_bytes])
    progress(f"sweeping delta x {list(be.sweep)} for {', '.join(SWEPT)} at an allowance of {allowance} B")
    for a in SWEPT:
      sweep[a] = exposure_sweep.sweep_arm(lambda b, d, m=managers[a]: m.plan_at(b, d, allowance),
                                          [e["bucket"] for e in per_arm[a]], be.sweep, cal_state.delta,
                                          lambda i, s: realised(i, s)[metric], plan_flops, gc_flops, gc_s, tol, units)
      equal[a] = exposure_sweep.at_violation(sweep[a], be.violation_target)
    if be.recalibrate_rollout:  # issue 36's periodic-static arm, recalibrated on that rollout's minibatches
      sweep["hilore_periodic_static"], equal["hilore_periodic_static"] = exposure_e1.periodic_sweep(
          mc, be, hooks, records, held, allowance, lambda i, s: realised(i, s)[metric], plan_flops, gc_flops, gc_s,
          tol, units)

  progress("which error definition predicts the update's effect")
  effects = exposure_risk.update_effects(hooks, held, refs, units, mc)
  kl_spread = {}
  if cfg.grpo.beta > 0 and cfg.grpo.kl_estimator == "k3" and be.kl_clamps:
    progress(f"||g||'s spread with grpo.kl_clamp in {list(be.kl_clamps)}")
    hooks_for = lambda c: step_hooks.memory_hooks(None, dataclasses.replace(
        spec, loss_cfg=dataclasses.replace(spec.loss_cfg, kl_clamp=c)))
    kl_spread = exposure_risk.kl_clamp_spread(hooks_for, held, [r.grad_norm for r in refs], be.kl_clamps)

  counts = {"calibration": len(cal), "held_out": len(held), "held_out_zero_gradient_skipped": n_held - len(held),
            "calib_steps": sorted({r.step for r in cal}), "held_out_steps": sorted({r.step for r in held}),
            "units_measured": len(mu), "units": len(units)}
  result = {"config": {**cfg.to_dict(), "bench_exposure": dataclasses.asdict(be)}, "regime": regime,
            "minibatches": counts, "error_definition": f"{metric}: {risk.DEFINITIONS[metric]}",
            "chosen_predictor": chosen, "risk_prediction": risk_prediction,
            "risk_prediction_by_metric": by_metric, "equal_violation": equal, "sweep": sweep,
            "sweep_allowance_bytes": allowance if be.arms else None,
            "calibration": {"delta": cal_state.delta, "coherence": cal_state.coherence,
                            "calibration_error": cal_state.calibration_error, "grad_scale": cal_state.grad_scale,
                            "gate": cal_state.gate},
            "arms": arms, "pairs": pairs, "oracle_gap_closed": closed, "risk": risk_table, "risk_by_kind": by_kind,
            "kl_clamp": kl_spread, "error_definition_vs_effect": effects,
            "varies": where_it_varies([r.describe for r in held], [r.pass_ for r in held], err_MU[:, mu], kinds),
            "units": [f"{l}:{k}" for l, k in units], "seconds": time.perf_counter() - t_start,
            "backend": jax.default_backend(), "jax": jax.__version__}
  with open(os.path.join(out_dir, "exposure.json"), "w") as f:
    json.dump(result, f, indent=1, default=float)
  with open(os.path.join(out_dir, "exposure.md"), "w") as f:
    f.write(report(result))
  plot(result, os.path.join(out_dir, "exposure.png"))
  plot_sweep(result, os.path.join(out_dir, "exposure_sweep.png"))
  if be.e1_json:  # issue 36's E1 summary: P1-P4 with cluster CIs over row sets, and the gate's decision
    e1 = exposure_e1.write(be, metric, cal, held, err_by, units, mu, table, chosen, sweep, cal_state, tol)
    with open(os.path.join(out_dir, "exposure_e1.md"), "w") as f:
      f.write(e1_markdown(e1))
  shutil.rmtree(spill_dir, ignore_errors=True)
  return result
