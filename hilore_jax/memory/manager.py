"""The memory manager: budget from the GC step, unit profile, risk calibration on K batches, per-unit run-time
exposure of all of a step's minibatches in one jitted call, and per bucket (a vector of unit exposure levels) one
plan fitted to the budget on the compiled step. It reaches the trainer only through `StepHooks` (compile a step, take
a gradient, read loss coefficients); its state is a typed, JSON-serialisable dataclass saved with every checkpoint.

Over 320 lines on purpose: set-up, buckets, the budget fit and allocation all read and write one state and share its
memoised plans; its life across a run's steps (set-up's phases after warm-up steps, drift and recalibration) lives
in lifecycle.py, whether calibrating L can change the plan in lgain.py, the warm-up and the measured guard in
warmup.py, the state's disk cache in store.py."""

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
from hilore_jax.memory import calibrate, calibration, drift, gate, lgain, methods, predictors, profile
from hilore_jax.memory import store as stores
from hilore_jax.memory import warmup
from hilore_jax.memory.buckets import AllocationCache
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.memory.lifecycle import Lifecycle
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


class MemoryManager(Lifecycle):
  """Chooses every minibatch's per-layer policies under the configured method and budget."""

  def __init__(self, mc: MemoryConfig, hooks: StepHooks, store: stores.JsonStore | None = None):
    self.mc, self.hooks, self.method = mc, hooks, mc.policy
    self.record = methods.REGISTRY[mc.policy]  # what the method needs: the manager never names one
    # the state on disk between runs (memory.cache): loaded before the first step, written once set up and after
    # every change
    self.store = store
    # memory.warmup=gc: set-up runs after warm-up steps on full checkpointing, in phases: "plan" (nothing measured
    # yet: budget, op profile and fits, and whether L is worth calibrating), "calibrate" (waiting for calibration
    # minibatches); None once set up
    self.phase: str | None = None
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
    self.sentinels = drift.Sentinels(mc, hooks)
    self.step_metrics: dict = {}  # memory/drift/*, memory/gate/*, counts: added to every allocation of a step

  @property
  def pending_setup(self) -> bool:
    return self.phase is not None

  @property
  def lowp_ids(self) -> list[tuple[int, str]]:
    """(layer, kind) of every unit that may be L: the calibration's kinds (memory/lgain.py), else memory.lowp_kinds."""
    cal = self.state.calibration if self.state is not None else None
    return calibration.lowp_units(self.num_layers, cal.kinds if cal is not None and cal.kinds else self.mc.lowp_kinds)

  # ------------------------------------------------------------------ set-up

  def setup(self, params, batches: list, step: int, calibration_state: Calibration | None = None, logp=None,
            opt_state=None, contexts: list | None = None, calibrate: str = "always"):
    """Budget from the GC step, unit profile, and (for calibrated methods) risk calibration on K batches (or a
    given calibration, another manager's, to compare methods on one calibration). Each calibration batch is
    measured at its own calibration.UpdateContext (contexts; default: params and opt_state for all, with logp[i]
    the current log-probs as run-time scoring reads them). calibrate "always" measures whatever the plans;
    "auto" (the trainer's way) only where L can change the plan (memory/lgain.py)."""
    self._begin(batches[0], step)
    if self.record.calibrated and (calibrate == "always" or calibration_state is not None or self._worth_l(batches[0])):
      logp = [None] * len(batches) if logp is None else logp
      contexts = contexts or [calibration.UpdateContext(params, opt_state, lp) for lp in logp]
      self._measure(batches, contexts, calibration_state)
    self._finish_setup(step)

  def _begin(self, batch, step: int):
    """A new state: full checkpointing's compiled peak, the budget and the op profile (a refresh keeps the guard's
    measurements)."""
    mc, cfg = self.mc, self.hooks.model_cfg
    gc_bytes = self.hooks.compile_peak(model.uniform(self.num_layers, model.FULL_REMAT), batch)
    budget = budgets.budget_bytes(gc_bytes, mc.budget_ratio, mc.budget_bytes)
    rows, seq = self.hooks.batch_shape(batch)
    ops = (self.hooks.op_profile(cfg, rows, seq, mc.group_size) if self.hooks.op_profile else
           profile.profile_ops(cfg, rows, seq, mc.group_size, formats=(mc.lowp_format,)))
    st = ManagerState(gc_bytes, budget, ops, calibrated_at=step, drift_checked_at=step)
    if self.state is not None:  # a refresh keeps what was measured, and counts on
      st.timings, st.guard, st.warmup_steps = self.state.timings, self.state.guard, self.state.warmup_steps
      st.calibrations, st.recalibrations = self.state.calibrations, self.state.recalibrations
    else:
      st.timings, st.warmup_steps = self.guard.handover()
    self.load_state(st, f"set up at step {step}")

  def _worth_l(self, batch) -> bool:
    """Whether calibrating L can change the plan (memory/lgain.py). Where it cannot, bucket 0 is the risk-free fit and
    nothing is calibrated."""
    if not self.record.risk_free_subset:  # no risk-free plan to keep instead (greedy_bits): always calibrated
      return True
    st, mc, units, subset = self.state, self.mc, self._unit_list(batch), self.record.risk_free_subset
    nominal = st.budget_bytes - st.gc_bytes
    # the L plan without the run shape: a relaxation, so its gain bounds a calibrated plan's from above, solved in
    # a second where the run-shaped MILP with every L option took tens of seconds (most of a cold set-up)
    pair_at = lambda f: (self._plan(0, int(f * nominal), method=subset),
                         self._plan(0, int(f * nominal), zero_risk=True, relaxed=True))
    fit_lowp = lambda reuse: self._fit_to_budget(lambda a: self._plan(0, a, zero_risk=True), batch, reuse)
    gc = self.gc_plan()
    st.lgain, floor = lgain.assess(gc, lgain.update_s(gc, st.profile["ops"], self.num_layers), pair_at,
                                   lambda: self._floor(batch), fit_lowp,
                                   lambda a, b: lgain.noise_s(a, b, units, st.profile, mc.lowp_format),
                                   mc.min_l_gain, units, mc.min_plan_gain)
    log.info("memory (%s): %s", self.method, st.lgain["reason"])
    if st.lgain.get("gc_only"):  # no plan worth its probe compiles: GC's program, as a guard's verdict would run it
      st.buckets, st.guard, st.fallback_gc, st.allowance["0"], st.verified = [[]], "gc", [0], 0, [0]
      self._cache.invalidate("no plan fitted", 0)
      self.persist()
      return False
    if not st.lgain["calibrate"]:  # the run keeps the risk-free fit: one bucket, no exposure to score
      st.buckets = [[]]
      self._record_fit(0, dataclasses.replace(floor, floor=True))
    return st.lgain["calibrate"]

  def _measure(self, batches: list, contexts: list, calibration_state: Calibration | None = None):
    """The state's calibration: measured on the first memory.calib_batches of batches (only the kinds lgain chose),
    or the one given."""
    kinds = self.state.lgain.get("kinds") or list(self.mc.lowp_kinds)
    if calibration_state is not None:
      ids = calibration.lowp_units(self.num_layers, calibration_state.kinds or self.mc.lowp_kinds)
      if len(calibration_state.predicted_error) != len(ids):
        raise ValueError(f"a calibration of {len(calibration_state.predicted_error)} units given to a manager of "
                         f"{len(ids)} L units (memory.lowp_kinds differ)")
    K = self.mc.calib_batches
    self.state.calibration = calibration_state or self._calibrate(batches[:K], contexts[:K], kinds)
    self.load_state(self.state, "calibrated")  # the units' L kinds are the calibration's now

  def _finish_setup(self, step: int):
    self.phase = None
    self.persist()
    self.step_metrics = self._metrics({}, False)
    st, cal = self.state, self.state.calibration
    log.info("memory (%s): GC %d B, budget %d B%s", self.method, st.gc_bytes, st.budget_bytes, "" if cal is None else
             f", calibration on {cal.calib_batches} minibatches: delta {cal.delta:.3g} (measured "
             f"{cal.calibration_error:.3g}), coherence {cal.coherence:.2f}, fit {cal.fit}")
    if cal is not None and cal.gate and self.record.exposure:
      log.info("memory (hilore): exposure buckets %s (%s)", "on" if cal.gate["on"] else "off", gate.describe(cal.gate))

  def _calibrate(self, batches: list, contexts: list, kinds=()) -> Calibration:
    if not self.hooks.calibrates:
      raise ValueError(f"memory.policy={self.method} calibrates risk: StepHooks needs gradient, token_weights and "
                       "unit_tensors")
    units = calibration.lowp_units(self.num_layers, kinds)
    m = calibrate.measure(self.hooks, self.mc, units, batches, contexts, log)
    self._measured = m if self._keep_measured else None
    self.state.calibrations += 1
    return dataclasses.replace(self.fit_calibration(m), kinds=list(kinds))

  def fit_calibration(self, m: calibrate.Measured, sw=None) -> Calibration:
    """A calibration of predictor sw (default memory.exposure) on measurements m: its scores of m's minibatches at
    the normalisation it runs with, the susceptibility fitted to them, coherence and delta."""
    sw = sw or self.mc.exposure
    units = m.units if m.units is not None else self.lowp_ids
    logp = [c.logp for c in m.contexts]
    gamma = predictors.fit_grad_scale([r.grad_norm for r in m.refs], self._scorer.l1(m.batches, sw, logp))
    inputs = predictors.ScoreInputs(m.prompt_profile, m.profile, np.ones(len(units)), gamma)
    token_err = m.token_err if self._forward_errors else None
    raw = self._scorer(m.batches, inputs, sw, self._normalisation, logp, token_err)
    return calibrate.fit(self.hooks, dataclasses.replace(self.mc, exposure=sw), units, m, raw, gamma)

  def load_state(self, state: ManagerState | dict, reason: str = "restored from checkpoint"):
    self.state = state if isinstance(state, ManagerState) else ManagerState.from_json(state)
    self._units.clear()  # their measured times come from this profile, their L kinds from its calibration
    self._plans.clear()
    self._floor_fit = None
    self._cache.invalidate(reason)
    last = self.state.drift_ref.get("last", {})  # a restored run's next rows carry what the run's did
    self.step_metrics = self._metrics(last, bool(last.get("recalibrated")))

  @property
  def exposure_on(self) -> bool:
    """hilore runs exposure buckets: more than one configured and the calibration's gate on, or memory.gate.mode always
    (a calibration without a gate record, an older one: on)."""
    cal = self.state.calibration if self.state is not None else None
    if not self.record.exposure or self.mc.buckets <= 1 or cal is None:  # no calibration: no L, nothing to score
      return False
    if self.mc.gate.mode != "auto":  # forced, whatever a given calibration's gate measured
      return self.mc.gate.mode == "always"
    return bool(cal.gate["on"]) if cal.gate else True

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
      cal = self.state.calibration
      kinds = cal.kinds if cal is not None and cal.kinds else self.mc.lowp_kinds  # no other kind is L in its plans
      self._units[shape] = profile.enumerate_units(self.hooks.model_cfg, *shape, self.mc.group_size,
                                                   self.state.profile, self.mc.lowp_format, kinds)
    self._shape = shape
    return self._units[shape]

  def bucket_levels(self, scores_MU: np.ndarray) -> list[tuple[int, ...]]:
    """Each minibatch's bucket key: its units' exposure levels (memory.buckets <= 1: exposure off, one bucket)."""
    if not self.exposure_on:
      return [()] * len(scores_MU)
    ref = self.state.calibration.predicted_error
    return [bucketing.unit_levels(s, ref, self.mc.buckets) for s in scores_MU]

  def bucket_for(self, levels: tuple[int, ...]) -> int:
    """The bucket of a minibatch with these unit levels (buckets.bucket_for: its own, or a fitted one covering it)."""
    return bucketing.bucket_for(self.state, levels, lambda b: self._cache.get(b).time_s)

  def bucket_risk(self, bucket: int) -> np.ndarray:
    """[U] predicted error per unit (coherence included) the bucket's allocation must tolerate (buckets.py)."""
    return bucketing.bucket_risk(self.state.calibration, self.state.buckets[bucket])

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

  def _plan_kw(self, bucket: int, solver: str | None = None, method: str | None = None,
               zero_risk: bool = False) -> dict:
    # a subset plans risk-free; zero_risk: the method's plan with every L unit free of risk (memory/lgain.py)
    risk_of, sens = self._risks(bucket) if method in (None, self.method) and not zero_risk else ({}, {})
    cal = self.state.calibration
    return dict(risk_of=risk_of, delta=cal.delta if cal else 0.0, fmt=self.mc.lowp_format, allow_o=self.mc.offload,
                sensitivity=sens, group_size=self.mc.group_size, solver=solver or self.mc.solver,
                mip_gap=self.mc.mip_gap, max_runs=self.mc.plan_runs)

  def _plan(self, bucket: int, allowance: int, solver: str | None = None, delta: float | None = None,
            method: str | None = None, zero_risk: bool = False, relaxed: bool = False) -> methods.Plan:
    """The method's (or its risk-free subset's) plan for a bucket and byte allowance; memoised: the budget fit, the
    greedy gap and the active-constraint check ask for the same solves, and buckets with equal risks share them."""
    method = method or self.method
    kw = self._plan_kw(bucket, solver, method, zero_risk)
    if delta is not None:
      kw["delta"] = delta
    if relaxed:  # any number of runs (lgain's screen)
      kw["max_runs"] = 0
    key = (self._shape, method, tuple(sorted(kw["risk_of"].items())), max(allowance, 0), kw["delta"], kw["solver"],
           kw["max_runs"])
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
    so a resumed run repeats it. A later bucket first tries the largest allowance fitted so far (the first, the L
    fit's of memory/lgain.py); a method with a risk-free subset keeps the subset's own fit where that is faster
    (budget.fit_plan), and its only fit where nothing was calibrated (no L)."""
    st = self.state
    if self.record.calibrated and st.calibration is None:
      fit = dataclasses.replace(self._floor(batch), floor=True)
    else:
      fitted = [a for b, a in st.allowance.items() if int(b) not in st.fallback_gc]
      floor = (lambda: self._floor(batch)) if self.record.risk_free_subset else None
      reuse = max(fitted) if fitted else st.lgain.get("lowp_allowance")
      fit = self._fit_to_budget(lambda a: self._plan(bucket, a), batch, reuse, floor)
    self._record_fit(bucket, fit)

  def _record_fit(self, bucket: int, fit: budgets.Fit):
    st = self.state
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
    """The risk-free subset's own fit (the search its own manager runs, so its plan), once per state: it ignores
    risks (fitted before calibration, memory/lgain.py: its allowance is in the state, its plan solved again)."""
    subset, a = self.record.risk_free_subset, self.state.lgain.get("risk_free_allowance")
    if self._floor_fit is None and a is not None:
      self._unit_list(batch)
      self._floor_fit = budgets.Fit(a, self._plan(0, a, method=subset), ())
    self._floor_fit = self._floor_fit or self._fit_to_budget(lambda a: self._plan(0, a, method=subset), batch)
    return self._floor_fit

  def allocate(self, minibatches: list, logp=None, token_err=None) -> list[Allocation]:
    """Every minibatch's bucket, plan and policies, in order; a new bucket is fitted first (its probe compiles
    are not counted as scheduling time). Exposure levels come from one jitted call; logp: the minibatches'
    current log-probs where known, token_err their forward's per-token errors where known (unit_scores)."""
    if self.state is None or self.pending_setup or self.guard.sample_due(self.state):  # warm-up
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
      metrics = warmup.plan_metrics(plan, bucket, self.state, self._gaps.get(bucket, 0.0), deferred,
                                    {"time/schedule_s": schedule_s, "time/alloc_wait_s": wait_s / n,
                                     "time/plan_fit_s": fit_s / n})
      policies = model.uniform(self.num_layers, model.FULL_REMAT) if deferred else self.policies(plan)
      out.append(Allocation(bucket, plan, policies, {**metrics, **self.step_metrics},
                            "none" if deferred else self._active.get(bucket, "none")))
    return out

  def gc_allocations(self, n: int, guard: bool = False) -> list[Allocation]:
    """Full checkpointing for n minibatches: before set-up, while GC's own time is measured, or (guard) where the
    plans were measured no faster than GC (memory/warmup.py)."""
    policies, metrics = model.uniform(self.num_layers, model.FULL_REMAT), warmup.gc_metrics(guard)
    return [Allocation(-1, methods.Plan((), (), 0, 0.0, 0.0), policies, {**metrics, **self.step_metrics})
            for _ in range(n)]
