"""The memory manager: budget from the GC step, unit profile, risk calibration on K batches, per-unit run-time
exposure of all of a step's minibatches in one jitted call, and per bucket (a vector of unit exposure levels) one
plan fitted to the budget on the compiled step. It reaches the trainer only through `StepHooks` (compile a step, take
a gradient, read loss coefficients); its state is a typed, JSON-serialisable dataclass saved with every checkpoint.

Over 320 lines on purpose: set-up, buckets, the budget fit and allocation all read and write one state and share its
memoised plans; the warm-up and the measured guard live in warmup.py, the state's disk cache in store.py."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from hilore_jax import model
from hilore_jax.memory import buckets as bucketing
from hilore_jax.memory import budget as budgets
from hilore_jax.memory import calibrate, calibration, drift, gate, methods, predictors, profile
from hilore_jax.memory import store as stores
from hilore_jax.memory import warmup
from hilore_jax.memory.buckets import AllocationCache
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.memory.state import Calibration, ManagerState

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Allocation:
  """A minibatch's decision: its bucket, plan and per-layer policies, and the alloc/memory metrics."""

  bucket: int
  plan: methods.Plan
  policies: tuple[model.LayerPolicy, ...]
  metrics: dict
  active_constraint: str = "none"  # which budget binds the plan: memory | risk | both | none


class MemoryManager:
  """Chooses every minibatch's per-layer policies under the configured method and budget."""

  def __init__(self, mc: MemoryConfig, hooks: StepHooks, store: stores.JsonStore | None = None):
    self.mc, self.hooks, self.method = mc, hooks, mc.policy
    self.record = methods.REGISTRY[mc.policy]  # what the method needs: the manager never names one
    # the state on disk between runs (memory.cache): loaded before the first step, written after every change
    self.store = store
    # memory.warmup=gc: set-up waits for the end of the first step, which runs full checkpointing meanwhile
    self.pending_setup = False
    self.ready_at: int | None = None  # the step whose allocation first came from the method's own plans
    # a bucket first met in a step is fitted after it (defer_fits: the trainer's way; a direct caller fits at once)
    self.defer_fits = False
    self.pending_fits: dict[int, Any] = {}
    self.guard = warmup.Guard(mc.verify_steps, mc.policy)
    self.num_layers = hooks.model_cfg.num_hidden_layers
    self.state: ManagerState | None = None
    self._cache = AllocationCache(self._solve_bucket)
    self._gaps: dict[int, float] = {}
    self._active: dict[int, str] = {}
    self._units: dict[tuple[int, int], list[profile.Unit]] = {}
    self._plans: dict[tuple, methods.Plan] = {}  # solved plans by (method, risks, allowance, delta, solver)
    self._floor_fit: budgets.Fit | None = None  # the risk-free subset's own fit to the budget (RISK_FREE_SUBSET)
    self._shape: tuple[int, int] | None = None
    self.lowp_ids = calibration.lowp_units(self.num_layers, mc.lowp_kinds)
    if mc.offload:
      methods.require_offload("memory.offload=true")
    self._scorer = predictors.Scorer(hooks)
    self._normalisation = predictors.Normalisation(mc.risk_metric, hooks.max_grad_norm)
    # the last calibration's measurements, kept only when asked (they hold exact gradients): to refit a predictor;
    # forward_errors: allocate is given a forward's per-token errors (cotangent_forward; the trainer does not yet pass
    # them), so calibration fits the predictor to the score it will run, forward errors or the profile. Both are set
    # from outside only through memory/probe.py (the lab's interface)
    self._keep_measured, self._measured, self._forward_errors = False, None, False
    # memory.warmup=gc: calibration minibatches gathered over the first rollouts; drift sentinels after set-up
    self.collector = warmup.Collector(mc.calib_batches, mc.calib_rollouts, mc.risk_metric == "update")
    self.sentinels = drift.Sentinels(mc, hooks, self.lowp_ids)
    self.step_metrics: dict = {}  # memory/drift/*, memory/gate/*: added to every allocation of a step
    self._drift_values: dict = {}

  # ------------------------------------------------------------------ set-up

  def setup(self, params, batches: list, step: int, calibration_state: Calibration | None = None, logp=None,
            opt_state=None, contexts: list | None = None):
    """Budget from the GC step, unit profile, and (for calibrated methods) risk calibration on K batches (or a
    given calibration, another manager's, to compare methods on one calibration). Each calibration batch is
    measured at its own calibration.UpdateContext (contexts; default: params and opt_state for all, with logp[i]
    the current log-probs as run-time scoring reads them)."""
    mc, cfg, batch = self.mc, self.hooks.model_cfg, batches[0]
    gc_bytes = self.hooks.compile_peak(model.uniform(self.num_layers, model.FULL_REMAT), batch)
    budget = budgets.budget_bytes(gc_bytes, mc.budget_ratio, mc.budget_bytes)
    rows, seq = self.hooks.batch_shape(batch)
    ops = (self.hooks.op_profile or profile.profile_ops)(cfg, rows, seq, mc.group_size)
    st = ManagerState(gc_bytes, budget, ops, calibrated_at=step, drift_checked_at=step)
    if self.state is not None:  # a refresh keeps what was measured
      st.timings, st.guard, st.warmup_steps = self.state.timings, self.state.guard, self.state.warmup_steps
    else:
      st.timings, st.warmup_steps = self.guard.handover()
    if self.record.calibrated:
      K = mc.calib_batches
      logp = [None] * len(batches) if logp is None else logp
      contexts = contexts or [calibration.UpdateContext(params, opt_state, lp) for lp in logp]
      if calibration_state is not None and len(calibration_state.predicted_error) != len(self.lowp_ids):
        raise ValueError(f"a calibration of {len(calibration_state.predicted_error)} units given to a manager of "
                         f"{len(self.lowp_ids)} L units (memory.lowp_kinds differ)")
      st.calibration = calibration_state or self._calibrate(batches[:K], contexts[:K])
    self.load_state(st, f"set up at step {step}")
    self.persist()
    cal = st.calibration
    log.info("memory (%s): GC %d B, budget %d B%s", self.method, gc_bytes, budget, "" if cal is None else
             f", calibration on {cal.calib_batches} minibatches: delta {cal.delta:.3g} (measured "
             f"{cal.calibration_error:.3g}), coherence {cal.coherence:.2f}, fit {cal.fit}")
    if cal is not None and cal.gate and self.record.exposure:
      g = cal.gate
      log.info("memory (hilore): exposure buckets %s (gate %s: within-unit p90/p10 %.2fx vs %.2fx, ||g|| < c on "
               "%.0f%% vs %.0f%%, leave-one-out rho %.2f vs %.2f)", "on" if g["on"] else "off", g["mode"],
               g["spread"], g["spread_min"], 100 * g["unclipped_share"], 100 * g["unclipped_min"], g["loo_rho"],
               g["rho_min"])

  def _calibrate(self, batches: list, contexts: list) -> Calibration:
    if not self.hooks.calibrates:
      raise ValueError(f"memory.policy={self.method} calibrates risk: StepHooks needs gradient, token_weights and "
                       "unit_tensors")
    m = calibrate.measure(self.hooks, self.mc, self.lowp_ids, batches, contexts, log)
    self._measured = m if self._keep_measured else None
    return self.fit_calibration(m)

  def fit_calibration(self, m: calibrate.Measured, sw=None) -> Calibration:
    """A calibration of predictor sw (default memory.exposure) on measurements m: its scores of m's minibatches at
    the normalisation it runs with, the susceptibility fitted to them, coherence and delta."""
    sw = sw or self.mc.exposure
    logp = [c.logp for c in m.contexts]
    gamma = predictors.fit_grad_scale([r.grad_norm for r in m.refs], self._scorer.l1(m.batches, sw, logp))
    inputs = predictors.ScoreInputs(m.prompt_profile, m.profile, np.ones(len(self.lowp_ids)), gamma)
    token_err = m.token_err if self._forward_errors else None
    raw = self._scorer(m.batches, inputs, sw, self._normalisation, logp, token_err)
    return calibrate.fit(self.hooks, dataclasses.replace(self.mc, exposure=sw), self.lowp_ids, m, raw, gamma)

  def load_state(self, state: ManagerState | dict, reason: str = "restored from checkpoint"):
    self.state = state if isinstance(state, ManagerState) else ManagerState.from_json(state)
    self._units.clear()  # their measured times come from this profile
    self._plans.clear()
    self._floor_fit = None
    self._cache.invalidate(reason)

  @property
  def exposure_on(self) -> bool:
    """hilore runs exposure buckets: more than one configured and the calibration's gate on, or memory.gate.mode always
    (a calibration without a gate record, an older one: on)."""
    if not self.record.exposure or self.mc.buckets <= 1 or self.state is None:
      return False
    if self.mc.gate.mode != "auto":  # forced, whatever a given calibration's gate measured
      return self.mc.gate.mode == "always"
    cal = self.state.calibration
    return bool(cal.gate["on"]) if cal is not None and cal.gate else True

  # ------------------------------------------------------------------ per step

  def unit_scores(self, minibatches: list, logp=None, token_err=None,
                  inputs: predictors.ScoreInputs | None = None) -> np.ndarray:
    """[M, U] run-time predicted error of every unit in every minibatch, in one jitted call and one host read (no
    forward pass): from advantages, masks, old / reference log-probs and, where given, the current log-probs
    (`logp`, one [B, N] per minibatch or None: a previous pass's, or replayed rows'), whose ratio decides which
    tokens clip; a minibatch without them is on its old policy. token_err: per minibatch a forward pass's per-token
    reconstruction errors [U, B, P-1+N] (the cotangent_forward predictor); inputs: other than the calibration's."""
    cal = self.state.calibration if self.state else None
    if inputs is None:
      inputs = predictors.ScoreInputs(np.asarray(cal.prompt_profile or np.zeros((len(self.lowp_ids), 0))),
                                      np.asarray(cal.profile), np.asarray(cal.susceptibility), cal.grad_scale)
    return self._scorer(minibatches, inputs, self.mc.exposure, self._normalisation, logp, token_err)

  def _unit_list(self, batch: dict) -> list[profile.Unit]:
    shape = self.hooks.batch_shape(batch)
    if shape not in self._units:
      self._units[shape] = profile.enumerate_units(self.hooks.model_cfg, *shape, self.mc.group_size,
                                                   self.state.profile, self.mc.lowp_format, self.mc.lowp_kinds)
    self._shape = shape
    return self._units[shape]

  def bucket_levels(self, scores_MU: np.ndarray) -> list[tuple[int, ...]]:
    """Each minibatch's bucket key: its units' exposure levels (memory.buckets <= 1: exposure off, one bucket)."""
    if not self.exposure_on:
      return [()] * len(scores_MU)
    ref = self.state.calibration.predicted_error
    return [bucketing.unit_levels(s, ref, self.mc.buckets) for s in scores_MU]

  def bucket_for(self, levels: tuple[int, ...]) -> int:
    """The bucket of a minibatch with these unit levels: its own if known; else the fastest fitted bucket whose
    levels are at least these in every unit (its plan's L set stays within the risk budget here too, so no new
    plan and no compile); else a new one. Fewer plans than exact levels, at the price of some minibatches running
    a more cautious plan than their own."""
    st, key = self.state, list(levels)
    if key in st.buckets:
      return st.buckets.index(key)
    # a minibatch with no exposure at all (no updated token) gets its own bucket: every unit may be L there
    unexposed = all(k == bucketing.ZERO for k in key)
    cover = [b for b in st.verified if b < len(st.buckets) and len(st.buckets[b]) == len(key) and key
             and not unexposed and all(x >= y for x, y in zip(st.buckets[b], key))]
    if cover:
      return min(cover, key=lambda b: (self._cache.get(b).time_s, b))
    st.buckets.append(key)
    return len(st.buckets) - 1

  def bucket_risk(self, bucket: int) -> np.ndarray:
    """[U] predicted error per unit (coherence included) the bucket's allocation must tolerate; the exposure-off
    bucket takes each unit's calibrated error (its calib_quantile over calibration minibatches; an older
    calibration: its largest calibration score)."""
    cal = self.state.calibration
    levels = self.state.buckets[bucket]
    risk = bucketing.level_risk(levels, cal.predicted_error) if levels else np.asarray(
        cal.static_risk or cal.score_max or cal.predicted_error)  # a given calibration may carry neither
    return cal.coherence * risk

  def _risks(self, bucket: int) -> tuple[dict, dict]:
    """(risk_of, sensitivity) per (layer, kind): hilore's at this bucket's exposure, static for the baselines."""
    st = self.state
    keys = [tuple(u) for u in self.lowp_ids]
    if self.record.exposure:
      return dict(zip(keys, self.bucket_risk(bucket).tolist())), {}
    if self.record.calibrated:
      static, kappa = st.calibration.static_error, st.calibration.coherence
      return {k: kappa * e for k, e in zip(keys, static)}, dict(zip(keys, static))
    return {}, {}

  def _plan_kw(self, bucket: int, solver: str | None = None, method: str | None = None) -> dict:
    risk_of, sens = self._risks(bucket) if method in (None, self.method) else ({}, {})  # a subset plans risk-free
    cal = self.state.calibration
    return dict(risk_of=risk_of, delta=cal.delta if cal else 0.0, fmt=self.mc.lowp_format, allow_o=self.mc.offload,
                sensitivity=sens, group_size=self.mc.group_size, solver=solver or self.mc.solver,
                mip_gap=self.mc.mip_gap, max_runs=self.mc.plan_runs)

  def _plan(self, bucket: int, allowance: int, solver: str | None = None, delta: float | None = None,
            method: str | None = None) -> methods.Plan:
    """The method's (or its risk-free subset's) plan for a bucket and byte allowance; memoised: the budget fit, the
    greedy gap and the active-constraint check ask for the same solves, and buckets with equal risks share them."""
    method = method or self.method
    kw = self._plan_kw(bucket, solver, method)
    if delta is not None:
      kw["delta"] = delta
    key = (self._shape, method, tuple(sorted(kw["risk_of"].items())), max(allowance, 0), kw["delta"], kw["solver"])
    if key not in self._plans:
      self._plans[key] = methods.plan(method, self._units[self._shape], self.state.profile["ops"],
                                      max(allowance, 0), **kw)
    return self._plans[key]

  def _solve_bucket(self, bucket: int) -> methods.Plan:
    st = self.state
    if bucket in st.fallback_gc:
      self._active[bucket] = "none"
      return self.gc_plan()
    allowance = max(st.allowance.get(str(bucket), st.budget_bytes - st.gc_bytes), 0)
    if bucket in st.risk_free:  # the method's own fit compiled slower than its risk-free subset's (budget.py)
      subset = self.record.risk_free_subset
      plan = self._plan(bucket, allowance, method=subset)
      self._active[bucket] = methods.active_constraint(subset, self._units[self._shape], allowance, plan,
                                                       lambda a, d=None: self._plan(bucket, a, method=subset))
      return plan
    plan = self._plan(bucket, allowance)
    if self.record.solved:  # the greedy fast path against the exact MILP, once per bucket: logged
      other = self._plan(bucket, allowance, solver="greedy" if self.mc.solver == "exact" else "exact")
      exact, greedy = (plan, other) if self.mc.solver == "exact" else (other, plan)
      self._gaps[bucket] = (greedy.time_s - exact.time_s) / max(exact.time_s, 1e-12)
      log.info("%s bucket %d: greedy is %.2f%% slower than the exact solution", self.method, bucket,
               100 * self._gaps[bucket])
    gap = self.mc.mip_gap if self.mc.solver == "exact" else 0.0
    self._active[bucket] = methods.active_constraint(self.method, self._units[self._shape], allowance, plan,
                                                     lambda a, d=None: self._plan(bucket, a, delta=d),
                                                     rtol=max(1e-6, gap))  # a gap-sized win is solver noise
    return plan

  def plan_at(self, bucket: int, delta: float, allowance: int | None = None):
    """(plan, policies) of a known bucket at another risk budget delta, within a byte allowance (default: the
    bucket's fitted one). No compile: a delta sweep."""
    st = self.state
    if allowance is None:
      if bucket in st.fallback_gc:
        return self.gc_plan(), self.policies(self.gc_plan())
      allowance = st.allowance.get(str(bucket), st.budget_bytes - st.gc_bytes)
    plan = self._plan(bucket, max(allowance, 0), delta=delta)
    return plan, self.policies(plan)

  def gc_plan(self) -> methods.Plan:
    """Full checkpointing under the last allocated shape's cost model: what every plan's rerun time is against."""
    return methods.plan("gc", self._units[self._shape], self.state.profile["ops"], 0)

  def policies(self, plan: methods.Plan) -> tuple[model.LayerPolicy, ...]:
    return methods.policies(plan, self._units[self._shape], self.num_layers, self.mc.group_size, self.method)

  def _fit(self, bucket: int, batch: dict):
    """Fit the bucket's plan to the budget on the compiled step (probe compiles, logged); remembered in the state,
    so a resumed run repeats it. A later bucket first tries the largest allowance fitted so far; a method with a
    risk-free subset keeps the subset's own fit where that is faster (budget.fit_plan)."""
    st = self.state
    fitted = [a for b, a in st.allowance.items() if int(b) not in st.fallback_gc]
    floor = (lambda: self._floor(batch)) if self.record.risk_free_subset else None
    fit = self._fit_to_budget(lambda a: self._plan(bucket, a), batch, max(fitted) if fitted else None, floor)
    log.info("%s bucket %d: %d probe compiles, allowance %d B%s", self.method, bucket, len(fit.probes),
             fit.allowance, " (the risk-free subset's plan: faster than the method's own fit)" if fit.floor else "")
    if fit.plan is None:  # nothing fitted: full checkpointing, which the budget always admits
      log.warning("%s: bucket %d: no plan fitted the budget; using full checkpointing", self.method, bucket)
      st.fallback_gc = sorted(set(st.fallback_gc) | {bucket})
    st.risk_free = sorted(set(st.risk_free) - {bucket} | ({bucket} if fit.floor else set()))
    st.allowance[str(bucket)] = fit.allowance
    st.verified = sorted(set(st.verified) | {bucket})
    self._cache.invalidate("allowance fitted", bucket)
    self.persist()

  def _fit_to_budget(self, plan_for, batch, reuse=None, floor=None) -> budgets.Fit:
    st, peak_of = self.state, lambda plan: self.hooks.compile_peak(self.policies(plan), batch)
    return budgets.fit_plan(st.budget_bytes, st.gc_bytes, plan_for, peak_of, self.mc.budget_probes,
                            lambda p: p.time_s, lambda p: p.bytes, reuse, floor)

  def _floor(self, batch) -> budgets.Fit:
    """The risk-free subset's own fit (the search its own manager runs, so its plan), once: it ignores risks."""
    subset = self.record.risk_free_subset
    self._floor_fit = self._floor_fit or self._fit_to_budget(lambda a: self._plan(0, a, method=subset), batch)
    return self._floor_fit

  def allocate(self, minibatches: list, logp=None, token_err=None) -> list[Allocation]:
    """Every minibatch's bucket, plan and policies, in order; a new bucket is fitted first (its probe compiles
    are not counted as scheduling time). Exposure levels come from one jitted call; logp: the minibatches'
    current log-probs where known, token_err their forward's per-token errors where known (unit_scores)."""
    if self.state is None or self.guard.sample_due(self.state):  # warm-up: nothing measured, or not GC's time
      self.guard.last = "gc"
      return self.gc_allocations(len(minibatches))
    if self.state.guard == "gc":  # the plans ran no faster than GC: GC's program
      self.guard.last = "guard"
      return self.gc_allocations(len(minibatches), guard=True)
    self.guard.last = "plan"
    return self._plan_allocations(minibatches, logp, token_err)

  def _plan_allocations(self, minibatches: list, logp=None, token_err=None, defer: bool | None = None
                        ) -> list[Allocation]:
    """Each minibatch's bucket and plan; a bucket not fitted yet is fitted now, or (defer, the trainer's way) after
    the step: its minibatch runs GC's program meanwhile (compiled already, within every budget)."""
    # the first fit cannot wait: there is no plan yet to have deferred for
    defer = (self.defer_fits and bool(self.state.verified)) if defer is None else defer
    t0 = time.perf_counter()
    self._unit_list(minibatches[0])
    keys, wait_s = [()] * len(minibatches), 0.0
    if self.exposure_on:  # exposure off (one bucket, or the gate off): nothing to score
      # the scores read log-probs the device may still be computing (the old-log-prob forwards, the previous
      # pass): that wait is the device at work, not scheduling, so it is timed apart
      jax.block_until_ready((minibatches, logp))
      wait_s = time.perf_counter() - t0
      keys = self.bucket_levels(self.unit_scores(minibatches, logp=logp, token_err=token_err))
    fit_s, chosen = 0.0, []
    for batch, key in zip(minibatches, keys):
      bucket = 0
      if self.record.exposure:
        bucket = self.bucket_for(key)
      if bucket not in self.state.verified and self.record.fixed is not model.NO_REMAT:
        if defer:
          self.pending_fits.setdefault(bucket, batch)
          chosen.append((bucket, None))
          continue
        t1 = time.perf_counter()
        self._fit(bucket, batch)
        fit_s += time.perf_counter() - t1
      chosen.append((bucket, self._cache.get(bucket)))
    n = len(minibatches)
    schedule_s = (time.perf_counter() - t0 - fit_s - wait_s) / n
    out = []
    for bucket, plan in chosen:
      deferred = plan is None
      plan = self.gc_plan() if deferred else plan
      fr = plan.fractions()
      metrics = {"alloc/frac_H": fr["frac_H"], "alloc/frac_L": fr["frac_L"], "alloc/frac_R": fr["frac_R"],
                 "alloc/frac_O": fr["frac_O"], "alloc/bucket": bucket, "alloc/greedy_gap": self._gaps.get(bucket, 0.0),
                 "alloc/predicted_err": float(plan.risk), "memory/budget_bytes": self.state.budget_bytes,
                 "memory/predicted_bytes": self.state.gc_bytes + plan.bytes, "alloc/warmup": 0.0,
                 "alloc/guard_gc": 0.0, "alloc/deferred": float(deferred),
                 "time/schedule_s": schedule_s, "time/alloc_wait_s": wait_s / n, "time/plan_fit_s": fit_s / n}
      policies = model.uniform(self.num_layers, model.FULL_REMAT) if deferred else self.policies(plan)
      out.append(Allocation(bucket, plan, policies, {**metrics, **self.step_metrics},
                            "none" if deferred else self._active.get(bucket, "none")))
    return out

  def step(self, params, minibatches: list, step: int, logp=None, opt_state=None) -> list[Allocation]:
    """Set up (or refresh) when due, then allocate this step's minibatches (opt_state: the optimizer's, for
    memory.risk_metric=update). A state cached by an earlier run of the same recipe is taken first; without one and
    with memory.warmup=gc, the step runs full checkpointing and set-up follows it (finish_step)."""
    mc = self.mc
    if self.state is None and self.store is not None:
      cached = self.store.load()
      if cached is not None:
        self.load_state(cached, f"cached in {self.store.path}")
        log.info("memory (%s): set-up reused from %s (no profile, calibration or probe compiles)", self.method,
                 self.store.path)
    cal = self.state.calibration if self.state else None
    stale = cal is not None and self.record.exposure and mc.buckets > 1 and not cal.profile
    if stale:
      log.warning("memory: the checkpoint's hilore calibration predates per-unit exposure: recalibrating")
    other = cal is not None and (cal.risk_metric, cal.predictor) != (mc.risk_metric, mc.exposure.predictor)
    if other:
      log.warning("memory: the checkpoint's calibration is of %s / %s, this run's of %s / %s: recalibrating",
                  cal.risk_metric, cal.predictor, mc.risk_metric, mc.exposure.predictor)
    if cal is not None and not other and len(cal.predicted_error) != len(self.lowp_ids):
      # another memory.lowp_kinds: its per-unit risks would land on other units
      log.warning("memory: the checkpoint's calibration covers %d units, this run's L units are %d "
                  "(memory.lowp_kinds): recalibrating", len(cal.predicted_error), len(self.lowp_ids))
      other = True
    due = mc.refresh_every and self.state is not None and step - self.state.calibrated_at >= mc.refresh_every
    self._drift_values, drifted = {}, []
    if cal is not None and self.record.calibrated and not (stale or other or due):
      drifted = self._drift(params, minibatches, step, logp, opt_state)
    if self.state is None and mc.warmup == "gc":
      if not self.pending_setup:
        log.info("memory (%s): step %d runs full checkpointing while the set-up waits for its end", self.method,
                 step + 1)
      self.pending_setup = True
      return self.allocate(minibatches, logp)
    if self.state is None or stale or other or due or drifted:
      self.setup(params, minibatches, step, logp=logp, opt_state=opt_state)
    if self.state.calibration is not None:
      self.step_metrics = {**drift.metrics(self._drift_values, bool(due or drifted)),
                           **gate.gate_metrics(self.state.calibration.gate)}
    allocations = self.allocate(minibatches, logp)
    if self.ready_at is None and self.guard.last == "plan":
      self.ready_at = step
    return allocations

  def _drift(self, params, minibatches, step: int, logp=None, opt_state=None) -> list[str]:
    """The sentinels past their thresholds at this step (memory/drift.py; values kept for the step's metrics)."""
    batch = minibatches[0]
    self._drift_values = self.sentinels.values(self.state, params, batch, step, lambda: self._check_lset(batch),
                                               opt_state, None if logp is None else logp[0])
    fired = drift.decide(self._drift_values, self.mc)
    if fired:
      log.warning("memory (%s): drift at step %d (%s): recalibrating", self.method, step + 1,
                  ", ".join(f"{k} {self._drift_values[k]:.3g}" for k in fired))
    return fired

  def _check_lset(self, batch) -> tuple[int, ...]:
    """The exact drift check's L set (indices into lowp_ids): bucket 0's plan (hilore's static bucket where exposure
    is off), from the state alone, so a resumed run checks the same set."""
    st = self.state
    if 0 not in st.verified or 0 in st.fallback_gc:
      return ()
    self._unit_list(batch)
    index = {tuple(u): i for i, u in enumerate(self.lowp_ids)}
    policies = self.policies(self._cache.get(0))
    return tuple(sorted(index[(layer, k)] for layer, pol in enumerate(policies) for k in pol.lowp
                        if (layer, k) in index))

  def finish_step(self, params, minibatches: list, step: int, logp=None, opt_state=None) -> float:
    """After a step, off its clock: set up (after the warm-up steps: a calibrated method gathers its calibration
    minibatches over the first memory.calib_rollouts rollouts, each at the params and optimizer state its step left)
    and fit the set-up step's buckets; fit the buckets the step deferred. Returns the seconds taken."""
    t0, setup, now = time.perf_counter(), self.pending_setup, minibatches
    contexts = None
    if setup and self.record.calibrated:
      self.collector.add(params, minibatches, logp, opt_state)
      if not self.collector.ready():
        log.info("memory (%s): calibration minibatches from %d of %d rollouts; step %d runs full checkpointing too",
                 self.method, len(self.collector.by_rollout), self.collector.rollouts, step + 2)
        setup = False
      else:
        minibatches, contexts = self.collector.take()
    if setup:
      self.setup(params, minibatches, step + 1, logp=logp, opt_state=opt_state, contexts=contexts)
      minibatches = now
      self.pending_setup = False
      self._plan_allocations(minibatches, logp, defer=False)
      log.info("memory (%s): set up in %.1fs after step %d; its plans take over from step %d", self.method,
               time.perf_counter() - t0, step + 1, step + 2 + self.guard.sample_due(self.state))
    pending, self.pending_fits = self.pending_fits, {}
    for bucket, batch in pending.items():
      self._fit(bucket, batch)
      self._cache.get(bucket)
    if pending:
      log.info("memory (%s): fitted bucket(s) %s after step %d (their minibatches ran GC's program)", self.method,
               sorted(pending), step + 1)
    return time.perf_counter() - t0 if (setup or pending) else 0.0

  def gc_allocations(self, n: int, guard: bool = False) -> list[Allocation]:
    """Full checkpointing for n minibatches: before set-up, while GC's own time is measured, or (guard) where the
    plans were measured no faster than GC (memory/warmup.py)."""
    policies = model.uniform(self.num_layers, model.FULL_REMAT)
    return [Allocation(-1, methods.Plan((), (), 0, 0.0, 0.0), policies, warmup.gc_metrics(guard)) for _ in range(n)]

  def observe(self, update_s_per_minibatch: float, clean: bool, grad_norms=None):
    """The trainer's measured update seconds per minibatch of the step just run (clean: no compile and no plan fit
    in it), for the measured guard; grad_norms: its updates' ||g|| (the step metrics), the drift sentinel's."""
    if grad_norms is not None and self.state is not None:
      # an update without a gradient (every advantage zero, no KL) says nothing about drift
      self.state.drift_grad_norms = [float(g) for g in grad_norms if g > 0]
    if self.guard.observe(self.state, update_s_per_minibatch, clean):
      self.persist()

  def persist(self):
    """Write the state to the store (memory.cache), so the next run of this recipe starts where this one is."""
    if self.store is not None and self.state is not None:
      self.store.save(self.state.to_json())

  def state_json(self) -> Any:
    return None if self.state is None else self.state.to_json()
