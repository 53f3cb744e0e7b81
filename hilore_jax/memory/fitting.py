"""The budget fit over the planner's state (planner.py): a new saved state's budget and op profile, each bucket's
plan fitted to the budget on the compiled step (probe compiles through the trainer's hooks), the risk-free subset's
own fit, and, before any risk is measured, whether calibrating L can change the plan (memory/lgain.py). Each
function takes a state and returns the new one; the fitted allowances are in its saved state, so a resumed run
repeats them."""

from __future__ import annotations

import dataclasses
import logging

from hilore_jax import model
from hilore_jax.memory import budget as budgets
from hilore_jax.memory import lgain, planner, profile, warmup
from hilore_jax.memory.planner import Planner, PlannerState, Session
from hilore_jax.memory.state import ManagerState

log = logging.getLogger(__name__)


def begin(pl: Planner, prev: ManagerState | None, guard: warmup.Guard, batch, step: int) -> ManagerState:
  """A new saved state: full checkpointing's compiled peak, the budget and the op profile; a refresh of prev keeps
  what was measured and counts on, a first one takes what the guard measured before it."""
  mc, cfg, hooks = pl.mc, pl.hooks.model_cfg, pl.hooks
  gc_bytes = hooks.compile_peak(model.uniform(pl.num_layers, model.FULL_REMAT), batch)
  budget = budgets.budget_bytes(gc_bytes, mc.budget_ratio, mc.budget_bytes)
  rows, seq = hooks.batch_shape(batch)
  ops = (hooks.op_profile(cfg, rows, seq, mc.group_size) if hooks.op_profile else
         profile.profile_ops(cfg, rows, seq, mc.group_size, formats=(mc.lowp_format,)))
  st = ManagerState(gc_bytes, budget, ops, calibrated_at=step, drift_checked_at=step)
  if prev is not None:
    st.timings, st.guard, st.warmup_steps = prev.timings, prev.guard, prev.warmup_steps
    st.calibrations, st.recalibrations = prev.calibrations, prev.recalibrations
  else:
    st.timings, st.warmup_steps = guard.handover()
  return st


def fit_to_budget(s: Session, plan_for, batch, reuse=None, floor=None) -> budgets.Fit:
  """budget.fit_plan of plan_for(allowance) on the compiled step, the session's shape's policies."""
  st = s.ps.saved
  peak_of = lambda plan: s.pl.hooks.compile_peak(planner.policies(s.pl, s.ps, plan), batch)
  return budgets.fit_plan(st.budget_bytes, st.gc_bytes, plan_for, peak_of, s.pl.mc.budget_probes,
                          lambda p: p.time_s, lambda p: p.bytes, reuse, floor)


def floor(pl: Planner, ps: PlannerState, batch) -> tuple[PlannerState, budgets.Fit]:
  """The risk-free subset's own fit (the search its own manager runs, so its plan), once per saved state: it ignores
  risks (fitted before calibration, memory/lgain.py: its allowance is in the state, its plan solved again)."""
  subset, a = pl.record.risk_free_subset, ps.saved.lgain.get("risk_free_allowance")
  fit = ps.floor
  if fit is None and a is not None:
    s = Session(pl, planner.at_shape(pl, ps, batch))
    fit, ps = budgets.Fit(a, s.plan(0, a, method=subset), ()), s.ps
  if fit is None:
    s = Session(pl, ps)
    fit, ps = fit_to_budget(s, lambda a: s.plan(0, a, method=subset), batch), s.ps
  return dataclasses.replace(ps, floor=fit), fit


def record(pl: Planner, ps: PlannerState, bucket: int, fit: budgets.Fit) -> PlannerState:
  """The state with the bucket's fit: its allowance, verified, and whether it runs full checkpointing (nothing fitted)
  or the risk-free subset's plan; its plan is solved again on its next use."""
  st = ps.saved
  log.info("%s bucket %d: %d probe compiles, allowance %d B%s", pl.method, bucket, len(fit.probes),
           fit.allowance, " (the risk-free subset's plan: faster than the method's own fit)" if fit.floor else "")
  fallback_gc = st.fallback_gc
  if fit.plan is None:  # nothing fitted: full checkpointing, which the budget always admits
    log.warning("%s: bucket %d: no plan fitted the budget; using full checkpointing", pl.method, bucket)
    fallback_gc = sorted(set(st.fallback_gc) | {bucket})
  saved = dataclasses.replace(st, fallback_gc=fallback_gc, allowance={**st.allowance, str(bucket): fit.allowance},
                              risk_free=sorted(set(st.risk_free) - {bucket} | ({bucket} if fit.floor else set())),
                              verified=sorted(set(st.verified) | {bucket}))
  return planner.forget(dataclasses.replace(ps, saved=saved), "allowance fitted", bucket)


def fit(pl: Planner, ps: PlannerState, bucket: int, batch) -> PlannerState:
  """The bucket's plan fitted to the budget (probe compiles, logged). A later bucket first tries the largest
  allowance fitted so far (the first, the L fit's of memory/lgain.py); a method with a risk-free subset keeps the
  subset's own fit where that is faster (budget.fit_plan), and its only fit where nothing was calibrated (no L)."""
  st = ps.saved
  if pl.record.calibrated and st.calibration is None:
    ps, f = floor(pl, ps, batch)
    return record(pl, ps, bucket, dataclasses.replace(f, floor=True))
  s = Session(pl, ps)

  def floor_fit() -> budgets.Fit:
    s.ps, f = floor(pl, s.ps, batch)
    return f

  fitted = [a for b, a in st.allowance.items() if int(b) not in st.fallback_gc]
  reuse = max(fitted) if fitted else st.lgain.get("lowp_allowance")
  f = fit_to_budget(s, lambda a: s.plan(bucket, a), batch, reuse, floor_fit if pl.record.risk_free_subset else None)
  return record(pl, s.ps, bucket, f)


def worth_l(pl: Planner, ps: PlannerState, batch) -> tuple[PlannerState, bool]:
  """Whether calibrating L can change the plan (memory/lgain.py), its record in the saved state. Where it cannot,
  bucket 0 is the risk-free fit and nothing is calibrated."""
  if not pl.record.risk_free_subset:  # no risk-free plan to keep instead (greedy_bits): always calibrated
    return ps, True
  mc, subset, s = pl.mc, pl.record.risk_free_subset, Session(pl, planner.at_shape(pl, ps, batch))
  st, units = s.ps.saved, planner.unit_list(s.ps)
  nominal = st.budget_bytes - st.gc_bytes
  # the L plan without the run shape: a relaxation, so its gain bounds a calibrated plan's from above, solved in a
  # second where the run-shaped MILP with every L option took tens of seconds (most of a cold set-up)
  pair_at = lambda f: (s.plan(0, int(f * nominal), method=subset),
                       s.plan(0, int(f * nominal), zero_risk=True, relaxed=True))
  fit_lowp = lambda reuse: fit_to_budget(s, lambda a: s.plan(0, a, zero_risk=True), batch, reuse)

  def fit_floor() -> budgets.Fit:
    s.ps, f = floor(pl, s.ps, batch)
    return f

  gc = planner.gc_plan(pl, s.ps)
  rec, fl = lgain.assess(gc, lgain.update_s(gc, st.profile["ops"], pl.num_layers), pair_at, fit_floor, fit_lowp,
                         lambda a, b: lgain.noise_s(a, b, units, st.profile, mc.lowp_format), mc.min_l_gain, units,
                         mc.min_plan_gain)
  log.info("memory (%s): %s", pl.method, rec["reason"])
  ps = dataclasses.replace(s.ps, saved=dataclasses.replace(s.ps.saved, lgain=rec))
  if rec.get("gc_only"):  # no plan worth its probe compiles: GC's program, as a guard's verdict would run it
    saved = dataclasses.replace(ps.saved, buckets=[[]], guard="gc", fallback_gc=[0],
                                allowance={**ps.saved.allowance, "0": 0}, verified=[0])
    return planner.forget(dataclasses.replace(ps, saved=saved), "no plan fitted", 0), False
  if not rec["calibrate"]:  # the run keeps the risk-free fit: one bucket, no exposure to score
    ps = dataclasses.replace(ps, saved=dataclasses.replace(ps.saved, buckets=[[]]))
    ps = record(pl, ps, 0, dataclasses.replace(fl, floor=True))
  return ps, rec["calibrate"]
