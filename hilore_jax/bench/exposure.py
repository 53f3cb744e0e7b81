"""Does run-time exposure predict and decide? Real rollout minibatches of a warm-started policy (several rollouts,
grpo.num_iterations passes, so later passes are off-policy and clip), calibration on the first minibatches and
everything else held out; per held-out minibatch and unit the measured error of that unit alone as L, and per arm
(optimal_hr, adacc_style, hilore with exposure off / on, an oracle allocating from the measured errors) the plan,
its realised gradient error against the exact gradient, its compiled peak and its step time, all on one solver,
one budget rule and one budget fit. Writes exposure.json, exposure.md and exposure.png."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model, step_hooks
from hilore_jax.bench import flops, stats
from hilore_jax.bench.exposure_report import (compare_arms, plot, report, spearman_summary, where_it_varies,
                                               within_unit_spearman)
from hilore_jax.bench.config import ExposureBenchConfig
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError
from hilore_jax.memory import MemoryManager, calibration
from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.rl import train_step

log = logging.getLogger(__name__)
ARMS = ("optimal_hr", "adacc_style", "hilore_exposure_off", "hilore_exposure_on", "oracle")


@dataclasses.dataclass
class Record:
  """One minibatch as an update saw it: the policy's params then, the batch (host arrays), the previous pass's
  per-token log-probs when off-policy (`logp`, else None), and what describes it."""

  step: int
  pass_: int
  index: int
  params: Any
  batch: Any
  describe: dict
  logp: np.ndarray | None = None


def collect(trainer, steps: int, progress=print) -> list[Record]:
  """Warm-start, then `steps` rollouts, each trained for grpo.num_iterations passes under the run's own step,
  recording every minibatch with the params its update saw."""
  c = trainer.config
  if c.train.warmstart_steps:
    trainer.warmstart()
    progress(f"warm-start loss {trainer.warmstart_losses[0]:.3f} -> {trainer.warmstart_losses[-1]:.3f}")
  if c.grpo.beta > 0:
    trainer.ref_params = jax.tree_util.tree_map(jnp.copy, trainer.state["params"])
  records = []
  for step in range(steps):
    roll = trainer.next_rollout()
    minibatches, _ = trainer.build_update_batch(roll, np.random.default_rng([c.seed, step]), step)
    if not minibatches:  # every group's rewards equal and filtered out: nothing to update
      progress(f"rollout {step + 1}/{steps}: no update rows (every group zero-std and grpo.filter_zero_std)")
      continue
    minibatches, _ = trainer.add_logprobs(minibatches)
    prev = None
    for it in range(c.grpo.num_iterations):
      cur = []
      for j, b in enumerate(trainer.pass_batches(minibatches, it)):
        params = jax.tree_util.tree_map(jnp.copy, trainer.state["params"])  # the step donates the state
        trainer.state, m = trainer.stepper(trainer.spec, trainer.state, b)
        cur.append(m.pop(train_step.TOKEN_LOGP))
        rec = jax.device_get(b)
        mask = rec.mask
        records.append(Record(step, it, j, params, rec, {
            "zero_adv_share": float(np.mean(rec.adv == 0)), "clipfrac": float(m["clipfrac"]),
            "completion_len_mean": float(mask.sum(1).mean()), "completion_len_max": int(mask.sum(1).max()),
            "reward_mean": float(roll.rewards.mean())}, None if prev is None else np.asarray(prev[j])))
      prev = cur
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


class OracleManager(MemoryManager):
  """hilore whose per-unit scores are the minibatch's *measured* single-unit errors (set before allocate): the
  same grid, buckets, solver and budget fit, with a perfect predictor."""

  measured: np.ndarray | None = None

  def unit_scores(self, minibatches, profile_UT=None, susceptibility_U=None, logp=None):
    if profile_UT is not None:
      return super().unit_scores(minibatches, profile_UT, susceptibility_U, logp)
    return np.atleast_2d(self.measured)


def arm_managers(cfg: Config, be: ExposureBenchConfig, hooks) -> dict[str, MemoryManager]:
  mc = dataclasses.replace(cfg.memory, budget_ratio=be.budget_ratio, budget_bytes=None)
  if mc.buckets <= 1:
    raise ConfigError("memory.buckets must be > 1 for the exposure-on arm (1 is the exposure-off arm)")
  return {"optimal_hr": MemoryManager(dataclasses.replace(mc, policy="optimal_hr"), hooks),
          "adacc_style": MemoryManager(dataclasses.replace(mc, policy="adacc_style"), hooks),
          "hilore_exposure_off": MemoryManager(dataclasses.replace(mc, policy="hilore", buckets=1), hooks),
          "hilore_exposure_on": MemoryManager(dataclasses.replace(mc, policy="hilore"), hooks),
          "oracle": OracleManager(dataclasses.replace(mc, policy="hilore"), hooks)}


# ----------------------------------------------------------------------------- risk prediction


def risk_scores(manager: MemoryManager, hooks, held: list[Record], units) -> dict[str, np.ndarray]:
  """[M, U] scores of the held-out minibatches: the run-time score and its ablations (susceptibility is one factor
  per unit, so it cannot change a within-unit ranking), the old scalar, simple baselines, and the score with the
  forward's own per-token errors (not available at run time)."""
  c = manager.state.calibration
  sus, prof = np.asarray(c.susceptibility), np.asarray(c.profile, np.float32)
  batches = [r.batch for r in held]
  out = {"run-time score": manager.unit_scores(batches, logp=[r.logp for r in held])}
  for a in ("ratio_clip", "update_mask", "kl", "activation"):
    sw = ExposureSwitches(**{a: False})
    fn = jax.jit(lambda b, lp, sw=sw: calibration.runtime_raw(hooks, b, prof, sw, lp))
    out[f"without {a}"] = np.stack([np.asarray(fn(r.batch, r.logp)) for r in held]) * sus
  w = jax.jit(lambda b, lp: hooks.token_weights(None, b, ExposureSwitches(), lp))
  conc = [float(jnp.sqrt(jnp.sum(x * x)) / jnp.maximum(jnp.sum(x), 1e-30)) for x in (w(r.batch, r.logp) for r in held)]
  U = len(units)
  out["previous run-time scalar (||w||2/||w||1, every unit)"] = np.repeat(np.array(conc)[:, None], U, 1)
  out["baseline: advantage only (sum |A|)"] = np.repeat(np.array([np.abs(b.adv).sum() for b in batches])[:, None],
                                                        U, 1)
  out["baseline: completion tokens"] = np.repeat(np.array([b.mask.sum() for b in batches], float)[:, None], U, 1)
  out["baseline: static per unit"] = np.tile(np.asarray(c.static_error), (len(batches), 1))
  fwd = jax.jit(lambda p, b: calibration.raw_exposure(hooks, p, b, units, ExposureSwitches(), manager.mc.group_size,
                                                      manager.mc.lowp_format))
  out["with the forward's per-token errors (not run-time)"] = np.stack(
      [np.asarray(fwd(r.params, r.batch)) for r in held]) * sus
  return out


# ----------------------------------------------------------------------------- the run


def _time_grad(step, params, batch, calls: int = 3) -> float:
  ts = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(step.grad(params, batch))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def run(cfg: Config, be: ExposureBenchConfig, out_dir: str, progress=print) -> dict:
  """Collect, calibrate, allocate every held-out minibatch under every arm, measure; write the report."""
  from hilore_jax.trainer import Trainer

  if cfg.grpo.num_iterations < 2:
    raise ConfigError("bench_exposure needs grpo.num_iterations >= 2 (off-policy passes, where ratios clip)")
  os.makedirs(out_dir, exist_ok=True)
  t_start = time.perf_counter()
  trainer = Trainer(dataclasses.replace(cfg, out_dir=os.path.join(out_dir, "collect"),
                                        memory=dataclasses.replace(cfg.memory, policy="none")))
  records = collect(trainer, be.rollout_steps, progress)
  cal, held = split(records, be.calib_minibatches)
  progress(f"{len(records)} minibatches: {len(cal)} calibrate, {len(held)} held out")
  spec = dataclasses.replace(trainer.spec, use_old_logp=True)
  hooks = step_hooks.memory_hooks(trainer.stepper, spec)
  units = calibration.lowp_units(trainer.model_cfg.num_hidden_layers)
  mc, tol = cfg.memory, cfg.memory.grad_err_tolerance

  managers = arm_managers(cfg, be, hooks)
  on = managers["hilore_exposure_on"]
  on.setup(cal[0].params, [r.batch for r in cal], 0)
  for m in managers.values():
    if m is not on:
      m.setup(cal[0].params, [r.batch for r in cal], 0, calibration_state=on.state.calibration)
  cal_state = on.state.calibration
  progress(f"calibrated on {len(cal)} minibatches: delta {cal_state.delta:.3g}, coherence {cal_state.coherence:.2f}")

  # the regime, fixed before any arm is compared: memory binds (No-GC's peak over the budget) and risk binds
  # (every unit L measures over the tolerance)
  L = trainer.model_cfg.num_hidden_layers
  gc_peak = hooks.compile_peak(model.uniform(L, model.FULL_REMAT), cal[0].batch)
  none_peak = hooks.compile_peak(model.uniform(L, model.NO_REMAT), cal[0].batch)
  every = [list(range(len(units)))]
  all_l = []
  for r in cal:  # on the calibration minibatches that have a gradient
    ex = calibration.exact_gradient(hooks, r.params, r.batch)
    if float(calibration.norm(ex)) > 0:
      all_l.append(float(calibration.set_errors(hooks, r.params, r.batch, units, every, mc.group_size,
                                                mc.lowp_format, ex)[0]))
  all_l = float(np.median(all_l)) if all_l else float("nan")
  regime = {"gc_peak_bytes": gc_peak, "none_peak_bytes": none_peak, "none_over_gc": none_peak / gc_peak,
            "budget_bytes": on.state.budget_bytes, "memory_binds": none_peak > on.state.budget_bytes,
            "all_L_error": all_l, "tolerance": tol, "risk_binds": all_l > tol}
  progress(f"regime: No-GC/GC peak {regime['none_over_gc']:.2f}x, budget {be.budget_ratio}x; every unit L "
           f"{all_l:.2e} vs tolerance {tol:.0e}")

  # per held-out minibatch: exact gradient, each unit's error alone, every arm's plan and its realised error
  names = ARMS if be.arms else ()  # arms off: the risk-prediction half alone (no plans, no compiles)
  err_MU, per_arm = [], {a: [] for a in names}
  grads_cache: dict = {}
  skipped = 0
  for i, r in enumerate(list(held)):
    exact = calibration.exact_gradient(hooks, r.params, r.batch)
    if float(calibration.norm(exact)) == 0:  # no gradient (every advantage zero, no KL yet): no relative error
      held.remove(r)
      skipped += 1
      continue
    err_U = calibration.measure_unit_errors(hooks, r.params, r.batch, units, mc.group_size, mc.lowp_format, exact)
    err_MU.append(err_U)
    managers["oracle"].measured = err_U
    grads_cache.clear()
    for name in names:
      a = managers[name].allocate([r.batch], [r.logp])[0]
      key = a.policies
      if key not in grads_cache:  # the arm's own compiled gradient program (its budget fit compiled it)
        step = trainer.stepper.get(dataclasses.replace(spec, policies=key), r.batch, count=False)
        grads_cache[key] = calibration.relative_error(step.grad(r.params, r.batch)[0], exact)
      per_arm[name].append({"policies": a.policies, "plan_risk": float(a.plan.risk), "err": grads_cache[key],
                            "predicted_s": float(a.plan.time_s), "step": r.step, "pass": r.pass_,
                            "bucket": a.bucket, "active": a.active_constraint,
                            **{k: a.metrics[f"alloc/{k}"] for k in ("frac_H", "frac_L", "frac_R")}})
    if (i + 1) % 5 == 0:
      progress(f"measured {i + 1}/{len(held)} held-out minibatches")
  err_MU = np.array(err_MU)

  arms, pairs, closed = {}, {}, {}
  if names:
    # step time of every distinct plan (and GC), interleaved rounds; each arm's time is its plans' sum over the
    # held-out minibatches, paired with GC's within a round
    gc_pols = model.uniform(L, model.FULL_REMAT)
    distinct = list(dict.fromkeys([gc_pols] + [e["policies"] for a in ARMS for e in per_arm[a]]))
    steps = {p: trainer.stepper.get(dataclasses.replace(spec, policies=p), held[0].batch, count=False)
             for p in distinct}
    params = held[0].params
    for p in distinct:
      _time_grad(steps[p], params, held[0].batch, 1)  # warm
    rounds = []
    order_rng = np.random.default_rng(cfg.seed)
    for _ in range(be.reps):
      t = {}
      for k in order_rng.permutation(len(distinct)):
        t[distinct[k]] = _time_grad(steps[distinct[k]], params, held[0].batch)
      rounds.append(t)
    progress(f"timed {len(distinct)} distinct plans x {be.reps} rounds")

    # the deterministic side of speed: matmul FLOPs of each plan's gradient program from its jaxpr (recompute
    # included, dead code removed; CPU step times here vary more than the plans differ) and the cost model's
    # rerun + codec seconds (what the solver minimises), both against GC and No-GC
    none_pols = model.uniform(L, model.NO_REMAT)
    fl = {p: flops.program_flops(lambda q, b, p=p: hooks.gradient(q, b, p), params, held[0].batch)
          for p in distinct + [none_pols]}
    gc_s = on.gc_plan().time_s
    tokens = float(sum(r.batch.rows * (r.batch.prompt_len + r.batch.completion_len) for r in held))
    arms = {}
    for a in ARMS:
      es = per_arm[a]
      times = np.array([sum(t[e["policies"]] for e in es) for t in rounds])
      gc_times = np.array([t[gc_pols] * len(es) for t in rounds])
      gain = stats.summary(stats.paired_gain_pct(times, gc_times))
      f_arm = float(np.mean([fl[e["policies"]] for e in es]))
      pred_s = float(np.mean([e["predicted_s"] for e in es]))
      errs = np.array([e["err"] for e in es])
      viol = (errs > tol).astype(float)
      arms[a] = {"tokens_per_s": tokens / float(np.median(times)), "gain_vs_gc_pct": gain["mean"],
                 "gain_ci_low": gain["ci_low"], "gain_ci_high": gain["ci_high"],
                 "round_times_s": times.tolist(), "gflops_per_minibatch": f_arm / 1e9,
                 "recompute_removed_pct": 100 * (fl[gc_pols] - f_arm) / max(fl[gc_pols] - fl[none_pols], 1.0),
                 "predicted_rerun_s": pred_s, "predicted_removed_pct": 100 * (gc_s - pred_s) / max(gc_s, 1e-12),
                 "peak_bytes": int(max(steps[e["policies"]].peak_bytes for e in es)),
                 "err_mean": float(errs.mean()), "err_max": float(errs.max()),
                 "violation_rate": float(viol.mean()), "violation_ci": list(stats.bootstrap_ci(viol)),
                 "frac_L": float(np.mean([e["frac_L"] for e in es])),
                 "frac_R": float(np.mean([e["frac_R"] for e in es])),
                 "distinct_plans": len({e["policies"] for e in es}), "buckets": len({e["bucket"] for e in es}),
                 "active": sorted({e["active"] for e in es}),
                 "per_minibatch": [{**{k: v for k, v in e.items() if k != "policies"},
                                    "plan": [dataclasses.asdict(q) for q in e["policies"]]} for e in es]}
    pairs, closed = compare_arms(arms)

  progress("risk prediction on the held-out minibatches")
  scores = risk_scores(on, hooks, held, units)
  risk = {name: spearman_summary(s, err_MU, be.bootstrap) for name, s in scores.items()}
  by_kind = {}
  rho_U = within_unit_spearman(scores["run-time score"], err_MU)
  for kind in sorted({k for _, k in units}):
    idx = [i for i, (_, k) in enumerate(units) if k == kind]
    by_kind[kind] = float(np.nanmedian(rho_U[idx])) if np.isfinite(rho_U[idx]).any() else float("nan")

  varies = where_it_varies([r.describe for r in held], [r.pass_ for r in held], err_MU)

  counts = {"calibration": len(cal), "held_out": len(held), "held_out_zero_gradient_skipped": skipped,
            "calib_steps": sorted({r.step for r in cal}), "held_out_steps": sorted({r.step for r in held})}
  result = {"config": {**cfg.to_dict(), "bench_exposure": dataclasses.asdict(be)}, "regime": regime,
            "minibatches": counts,
            "calibration": {"delta": cal_state.delta, "coherence": cal_state.coherence,
                            "calibration_error": cal_state.calibration_error},
            "arms": arms, "pairs": pairs, "oracle_gap_closed": closed, "risk": risk, "risk_by_kind": by_kind,
            "varies": varies, "units": [f"{l}:{k}" for l, k in units], "seconds": time.perf_counter() - t_start,
            "backend": jax.default_backend(), "jax": jax.__version__}
  with open(os.path.join(out_dir, "exposure.json"), "w") as f:
    json.dump(result, f, indent=1, default=float)
  with open(os.path.join(out_dir, "exposure.md"), "w") as f:
    f.write(report(result))
  plot(result, os.path.join(out_dir, "exposure.png"))
  return result
