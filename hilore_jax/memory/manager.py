"""The memory manager: a thin driver over the planner's pure functions. It holds the planner's state (planner.py:
the saved state, with budget, op profile, calibration, buckets and fits, and the memos beside it) and replaces it
with what each call returns. Set-up: the budget from the GC step, the op profile and (calibrated methods) risk
calibration on K batches; allocate: a step's minibatches scored in one jitted call, each one's bucket and plan
(allocation.py), a new bucket fitted to the budget on the compiled step (fitting.py). It reaches the trainer only
through `StepHooks`. Its life across steps (set-up's phases, drift, recalibration) is lifecycle.py's, the warm-up
and the measured guard warmup.py's, the disk cache store.py's; a study's options arrive as a probe.StudyProbe."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from hilore_jax import model
from hilore_jax.memory import allocation, calibrate, calibration, drift, fitting, gate, methods, planner, predictors
from hilore_jax.memory import buckets as bucketing
from hilore_jax.memory import profile, warmup
from hilore_jax.memory import store as stores
from hilore_jax.memory.allocation import Allocation
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.memory.lifecycle import Lifecycle
from hilore_jax.memory.probe import StudyProbe
from hilore_jax.memory.state import Calibration, ManagerState

log = logging.getLogger(__name__)


class MemoryManager(Lifecycle):
  """Chooses every minibatch's per-layer policies under the configured method and budget."""

  def __init__(self, mc: MemoryConfig, hooks: StepHooks, store: stores.JsonStore | None = None,
               probe: StudyProbe | None = None):
    self.mc, self.hooks, self.method = mc, hooks, mc.policy
    self.planner = planner.Planner(mc, hooks)
    self.record = self.planner.record  # what the method needs: the manager never names one
    self.planner_state = planner.init()  # replaced by what each planning call returns
    self.store = store  # memory.cache: loaded before the first step, written once set up and after every change
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
    if mc.offload:
      methods.require_offload("memory.offload=true")
    self.probe = probe or StudyProbe()
    self.scorer = predictors.Scorer(hooks)
    self.normalisation = predictors.Normalisation(mc.risk_metric, hooks.max_grad_norm)
    # memory.warmup=gc: calibration minibatches gathered over the first rollouts; drift sentinels after set-up
    self.collector = warmup.Collector(mc.calib_batches, mc.calib_rollouts, mc.risk_metric == "update")
    self.sentinels = drift.Sentinels(mc, hooks)
    self.step_metrics: dict = {}  # memory/drift/*, memory/gate/*, counts: added to every allocation of a step

  @property
  def state(self) -> ManagerState | None:
    return self.planner_state.saved  # None before set-up

  @property
  def pending_setup(self) -> bool:
    return self.phase is not None

  @property
  def lowp_ids(self) -> list[tuple[int, str]]:
    """(layer, kind) of every unit that may be L: the calibration's kinds (memory/lgain.py), else memory.lowp_kinds."""
    return planner.lowp_ids(self.planner, self.state)

  @property
  def exposure_on(self) -> bool:
    return planner.exposure_on(self.planner, self.state)

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
    """A new saved state (fitting.begin; a refresh keeps the guard's measurements)."""
    self.load_state(fitting.begin(self.planner, self.state, self.guard, batch, step), f"set up at step {step}")

  def _worth_l(self, batch) -> bool:
    """Whether calibrating L can change the plan (fitting.worth_l)."""
    self.planner_state, calibrate_l = fitting.worth_l(self.planner, self.planner_state, batch)
    if not calibrate_l:  # bucket 0 was fitted
      self.persist()
    return calibrate_l

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
    self.probe.measured = m if self.probe.keep_measurements else None
    self.state.calibrations += 1
    return dataclasses.replace(self.fit_calibration(m), kinds=list(kinds))

  def fit_calibration(self, m: calibrate.Measured, sw=None) -> Calibration:
    """A calibration of predictor sw (default memory.exposure) on measurements m: its scores of m's minibatches at
    the normalisation it runs with, the susceptibility fitted to them, coherence and delta."""
    sw = sw or self.mc.exposure
    units = m.units if m.units is not None else self.lowp_ids
    logp = [c.logp for c in m.contexts]
    gamma = predictors.fit_grad_scale([r.grad_norm for r in m.refs], self.scorer.l1(m.batches, sw, logp))
    inputs = predictors.ScoreInputs(m.prompt_profile, m.profile, np.ones(len(units)), gamma)
    token_err = m.token_err if self.probe.forward_errors else None
    raw = self.scorer(m.batches, inputs, sw, self.normalisation, logp, token_err)
    return calibrate.fit(self.hooks, dataclasses.replace(self.mc, exposure=sw), units, m, raw, gamma)

  def load_state(self, state: ManagerState | dict, reason: str = "restored from checkpoint"):
    saved = state if isinstance(state, ManagerState) else ManagerState.from_json(state)
    self.planner_state = planner.reset(self.planner_state, saved, reason)
    last = saved.drift_ref.get("last", {})  # a restored run's next rows carry what the run's did
    self.step_metrics = self._metrics(last, bool(last.get("recalibrated")))

  # ------------------------------------------------------------------ per step

  def unit_scores(self, minibatches: list, logp=None, token_err=None,
                  inputs: predictors.ScoreInputs | None = None) -> np.ndarray:
    """[M, U] run-time predicted error of every unit in every minibatch, in one jitted call and one host read (no
    forward pass): from advantages, masks, old / reference log-probs and, where given, the current log-probs
    (`logp`, one [B, N] per minibatch or None: a previous pass's, or replayed rows'), whose ratio decides which
    tokens clip; a minibatch without them is on its old policy. token_err: per minibatch a forward pass's per-token
    reconstruction errors [U, B, P-1+N] (the cotangent_forward predictor); inputs: other than the calibration's. An
    oracle probe's run-time scores are the errors it was given."""
    if inputs is None and self.probe.oracle:
      return np.atleast_2d(self.probe.errors_U)
    cal = self.state.calibration if self.state else None
    if inputs is None:
      inputs = predictors.ScoreInputs(np.asarray(cal.prompt_profile or np.zeros((len(self.lowp_ids), 0))),
                                      np.asarray(cal.profile), np.asarray(cal.susceptibility), cal.grad_scale)
    return self.scorer(minibatches, inputs, self.mc.exposure, self.normalisation, logp, token_err)

  def unit_list(self, batch) -> list[profile.Unit]:
    """The units of this batch's shape (the shape planned for from now on)."""
    self.planner_state = planner.at_shape(self.planner, self.planner_state, batch)
    return planner.unit_list(self.planner_state)

  def bucket_levels(self, scores_MU: np.ndarray) -> list[tuple[int, ...]]:
    """Each minibatch's bucket key: its units' exposure levels (memory.buckets <= 1: exposure off, one bucket)."""
    return planner.bucket_levels(self.planner, self.state, scores_MU)

  def bucket_for(self, levels: tuple[int, ...]) -> int:
    """The bucket of a minibatch with these unit levels (buckets.bucket_for: its own, or a fitted one covering it)."""
    self.planner_state, bucket = planner.bucket_for(self.planner, self.planner_state, levels)
    return bucket

  def bucket_risk(self, bucket: int) -> np.ndarray:
    """[U] predicted error per unit (coherence included) the bucket's allocation must tolerate (buckets.py)."""
    return bucketing.bucket_risk(self.state.calibration, self.state.buckets[bucket])

  def bucket_plan(self, bucket: int) -> methods.Plan:
    self.planner_state, plan = planner.bucket_plan(self.planner, self.planner_state, bucket)
    return plan

  def plan_at(self, bucket: int, delta: float, allowance: int | None = None):
    """(plan, policies) of a known bucket at another risk budget delta, within a byte allowance (default: the
    bucket's fitted one). No compile: a delta sweep."""
    if allowance is None:
      if bucket in self.state.fallback_gc:
        return self.gc_plan(), self.policies(self.gc_plan())
      allowance = planner.allowance_of(self.planner_state, bucket)
    self.planner_state, plan = planner.solve(self.planner, self.planner_state, bucket, max(allowance, 0), delta=delta)
    return plan, self.policies(plan)

  def gc_plan(self) -> methods.Plan:
    """Full checkpointing under the last allocated shape's cost model: what every plan's rerun time is against."""
    return planner.gc_plan(self.planner, self.planner_state)

  def policies(self, plan: methods.Plan) -> tuple[model.LayerPolicy, ...]:
    return planner.policies(self.planner, self.planner_state, plan)

  def _fit(self, bucket: int, batch):  # the bucket's plan fitted to the budget on the compiled step, persisted
    self.planner_state = fitting.fit(self.planner, self.planner_state, bucket, batch)
    self.persist()

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
    """Each minibatch's bucket and plan (allocation.plan_rows); a bucket not fitted yet is fitted now, or (defer,
    the trainer's way) after the step."""
    # the first fit cannot wait: there is no plan yet to have deferred for
    defer = (self.defer_fits and bool(self.state.verified)) if defer is None else defer
    rows = allocation.plan_rows(self.planner, self.planner_state, minibatches,
                                lambda: self.unit_scores(minibatches, logp=logp, token_err=token_err), logp, defer,
                                self.step_metrics)
    self.planner_state = rows.ps
    for bucket, batch in rows.deferred.items():
      self.pending_fits.setdefault(bucket, batch)
    if rows.fitted:
      self.persist()
    return rows.allocations

  def gc_allocations(self, n: int, guard: bool = False) -> list[Allocation]:
    return allocation.gc_rows(self.num_layers, n, self.step_metrics, guard)
