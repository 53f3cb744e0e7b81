"""The memory manager's life across a run's steps, apart from its planning (manager.py): what a trainer calls each
step (`step` before it, `observe` and `finish_step` after it) and what runs off the step's clock. A state cached by an
earlier run of the same recipe is taken first (memory.cache, store.py); without one, memory.warmup=gc runs full
checkpointing while set-up runs after the step in phases (the plan phase: budget, op profile, fits and whether L can
change the plan, memory/lgain.py; then, where it can, calibration on minibatches gathered over
memory.calib_rollouts rollouts); once set up, the drift sentinels (drift.py) after each step, only while the running
plans hold L, and an incremental recalibration of those units where they fire (recalibrate.py); and the buckets a
step deferred. `MemoryManager` derives from `Lifecycle`; both replace its planner state (planner.py) with what each
planning call returns."""

from __future__ import annotations

import logging
import time
from typing import Any

from hilore_jax.memory import calibrate, calibration, drift, planner, recalibrate

log = logging.getLogger(__name__)


class Lifecycle:
  """The manager's step, observe and finish_step (MemoryManager supplies setup, allocate, the fits and the plans)."""

  def step(self, params, minibatches: list, step: int, logp=None, opt_state=None) -> list:
    """Allocate this step's minibatches (opt_state: the optimizer's, for memory.risk_metric=update). A state cached
    by an earlier run of the same recipe is taken first; without one and with memory.warmup=gc the step runs full
    checkpointing and set-up follows it (finish_step); with memory.warmup=none it sets up now, as it does where a
    restored calibration does not fit this run's settings."""
    if self.state is None and self.store is not None:
      cached = self.store.load()
      if cached is not None:
        self.load_state(cached, f"cached in {self.store.path}")
        drift.restart(self.state, step)  # the sentinels' references follow this run, not the cached one
        log.info("memory (%s): set-up reused from %s (no profile, calibration or probe compiles)", self.method,
                 self.store.path)
    reason = calibrate.unusable(self.state.calibration if self.state else None, self.mc, self.record.exposure,
                                self.num_layers)
    if reason:  # the restored plans held L: measured again now, on this run's settings
      log.warning("memory: %s: recalibrating", reason)
      self.setup(params, minibatches, step, logp=logp, opt_state=opt_state)
    if self.state is None and not self.pending_setup:
      self.phase = "plan"
      if self.mc.warmup == "gc":
        log.info("memory (%s): step %d runs full checkpointing while the set-up waits for its end", self.method,
                 step + 1)
    if self.pending_setup and self.mc.warmup == "none":
      self.setup(params, minibatches, step, logp=logp, opt_state=opt_state, calibrate="auto")
    allocations = self.allocate(minibatches, logp)
    if self.ready_at is None and self.guard.last == "plan":
      self.ready_at = step
    return allocations

  def finish_step(self, params, minibatches: list, step: int, logp=None, opt_state=None,
                  last: bool = False) -> dict[str, float]:
    """After a step, off its clock: set-up's next phase and the fit of the step's buckets once set up; the drift
    sentinels and any recalibration (not after the run's last step: nothing is left for them to protect); the
    buckets the step deferred (also after the last: the set-up cache keeps them for the next run). Returns the
    seconds each took, as the next row's time/memory_setup_s and time/recalibrate_s."""
    out, t0 = {}, time.perf_counter()
    if self.pending_setup and minibatches:
      if self._advance_setup(params, minibatches, step, logp, opt_state):
        self._plan_allocations(minibatches, logp, defer=False)
        if (self.state.lgain or {}).get("gc_only"):
          log.info("memory (%s): set up in %.1fs after step %d; no plan fitted: GC's program", self.method,
                   time.perf_counter() - t0, step + 1)
        else:
          log.info("memory (%s): set up in %.1fs after step %d; its plans take over from step %d", self.method,
                   time.perf_counter() - t0, step + 1, step + 2 + self.guard.sample_due(self.state))
      out["time/memory_setup_s"] = time.perf_counter() - t0
    elif not last and minibatches and self.state is not None and self.state.calibration is not None:
      if self._after_step(params, minibatches, step, logp, opt_state):
        out["time/recalibrate_s"] = time.perf_counter() - t0
    pending, self.pending_fits, t1 = self.pending_fits, {}, time.perf_counter()
    for bucket, batch in pending.items():
      self._fit(bucket, batch)
      self.bucket_plan(bucket)
    if pending:
      log.info("memory (%s): fitted bucket(s) %s after step %d (their minibatches ran GC's program)", self.method,
               sorted(pending), step + 1)
      out["time/memory_setup_s"] = out.get("time/memory_setup_s", 0.0) + time.perf_counter() - t1
    return out

  def _advance_setup(self, params, minibatches: list, step: int, logp=None, opt_state=None) -> bool:
    """Set-up's phases after a warm-up step: the plan phase on its minibatches' shapes (budget, op profile, fits,
    and whether L can change the plan), then, where it can, calibration on minibatches gathered over
    memory.calib_rollouts rollouts, each at the params (and optimizer state) its step left. True once set up."""
    if self.phase == "plan":
      self._begin(minibatches[0], step + 1)
      self.phase = "calibrate" if self.record.calibrated and self._worth_l(minibatches[0]) else None
    if self.phase == "calibrate":
      # the rollout that completes the set calibrates now, before the next step donates its params: no copy
      self.collector.add(params, minibatches, logp, opt_state, copy=not self.collector.ready_with(len(minibatches)))
      if not self.collector.ready():
        log.info("memory (%s): calibration minibatches from %d of %d rollouts; step %d runs full checkpointing too",
                 self.method, len(self.collector.by_rollout), self.collector.rollouts, step + 2)
        return False
      self._measure(*self.collector.take())
      self.state.calibrated_at = self.state.drift_checked_at = step + 1
    self._finish_setup(step + 1)
    return True

  def _after_step(self, params, minibatches: list, step: int, logp=None, opt_state=None) -> bool:
    """The drift sentinels after a step (memory/drift.py), and a recalibration where they fire or memory.refresh_every
    is due: only while the running plans hold L units, and of those units alone (memory/recalibrate.py; a refresh
    measures every calibrated kind). True if more than the free sentinel ran."""
    st, mc, batch = self.state, self.mc, minibatches[0]
    lset = self._running_lset(batch)
    values = self.sentinels.values(st, params, batch, step + 1, self.lowp_ids, lset, opt_state,
                                   None if logp is None else logp[0])
    fired = drift.decide(values, mc) if lset else []
    due = bool(lset and mc.refresh_every and step + 1 - st.calibrated_at >= mc.refresh_every)
    if fired:
      log.warning("memory (%s): drift after step %d (%s): recalibrating its %d L units", self.method, step + 1,
                  ", ".join(f"{k} {values[k]:.3g}" for k in fired), len(lset))
    if fired or due:
      self._recalibrate(params, minibatches, step + 1, None if due else lset, logp, opt_state)
    self.state.drift_ref["last"] = {**values, "recalibrated": float(bool(fired or due))}  # a resumed run's next row's
    self.step_metrics = self._metrics(values, bool(fired or due))
    return bool(fired or due or "recon_ratio" in values or "exact_err" in values)

  def _running_lset(self, batch) -> tuple[int, ...]:
    """Indices into lowp_ids of the units the running plans hold in L: every fitted bucket's (none where the guard
    runs GC), from the state alone, so a resumed run checks the same set."""
    st = self.state
    if st.guard == "gc" or st.calibration is None:
      return ()
    units = self.unit_list(batch)  # first: a restored state has no unit list yet
    plans = [self.bucket_plan(b) for b in st.verified if b not in st.fallback_gc]
    return recalibrate.held_in_l(units, plans, self.lowp_ids)

  def _recalibrate(self, params, minibatches: list, step: int, lset, logp=None, opt_state=None):
    """The calibration measured again at params on this step's minibatches (lset: those L units alone, on its
    first; None: every calibrated kind), and every fitted bucket whose plan changes fitted again."""
    st, batch = self.state, minibatches[0]
    old = {b: self.bucket_plan(b).choice for b in st.verified if b not in st.fallback_gc}
    logp = [None] * len(minibatches) if logp is None else logp
    contexts = [calibration.UpdateContext(params, opt_state, lp) for lp in logp]
    if lset is None:
      cal = self._calibrate(minibatches[:self.mc.calib_batches], contexts, st.calibration.kinds)
    else:
      cal = recalibrate.remeasure(self.hooks, self.mc, self.lowp_ids, lset, st.calibration, contexts[0], batch)
      st.calibrations += 1
    st.recalibrations += 1
    st.calibration, st.calibrated_at = cal, step
    self.planner_state = planner.forget(self.planner_state, "recalibrated", plans=True)
    for b, choice in old.items():
      if self.bucket_plan(b).choice != choice:
        self._fit(b, batch)
    self.persist()

  def _metrics(self, values: dict, recalibrated: bool) -> dict:
    cal = self.state.calibration if self.state is not None else None
    st = self.state
    return {} if st is None else drift.step_metrics(st.calibrations, st.recalibrations, cal, values, recalibrated)

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
    if self.store is not None and self.state is not None and not self.pending_setup:
      self.store.save(self.state.to_json())

  def state_json(self) -> Any:
    return None if self.state is None else self.state.to_json()
