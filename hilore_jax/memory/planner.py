"""The memory manager's planning as pure functions over an explicit state, as optax's init/update: a `Planner` holds
what never changes in a run (the settings, the method's record, the trainer's hooks); a `PlannerState` holds the
saved `ManagerState` (budget, op profile, calibration, buckets and their fits) and what is memoised beside it (the
units of the shape last planned for, solved plans, each bucket's plan). Every function takes a state and returns
the new one, never changing the one it was given. The budget fit is fitting.py's, the allocation rows
allocation.py's; manager.py drives them across a run."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from hilore_jax import model
from hilore_jax.memory import budget as budgets
from hilore_jax.memory import buckets as bucketing
from hilore_jax.memory import calibration, methods, profile
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.memory.state import Calibration, ManagerState

log = logging.getLogger(__name__)

Shape = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Planner:
  """What planning reads and never changes: the settings, the method's record and the trainer's hooks."""

  mc: MemoryConfig
  hooks: StepHooks

  @property
  def method(self) -> str:
    return self.mc.policy

  @property
  def record(self) -> methods.Method:
    return methods.REGISTRY[self.mc.policy]  # what the method needs: the planner never names one

  @property
  def num_layers(self) -> int:
    return self.hooks.model_cfg.num_hidden_layers


@dataclasses.dataclass(frozen=True)
class PlannerState:
  """The saved state and the memos planning keeps beside it (its dicts are never changed in place: replaced)."""

  saved: ManagerState | None = None  # budget, op profile, calibration, buckets and fits; None before set-up
  shape: Shape | None = None  # (rows, length) of the minibatches last planned for
  # shape -> its units (their times from saved's profile, their L kinds from its calibration)
  units: dict[Shape, list[profile.Unit]] = dataclasses.field(default_factory=dict)
  # (shape, method, risks, allowance, delta, solver, max_runs) -> the solved plan
  plans: dict[tuple, methods.Plan] = dataclasses.field(default_factory=dict)
  buckets: dict[int, methods.Plan] = dataclasses.field(default_factory=dict)  # bucket -> its plan, solved on first use
  # bucket -> which budget binds its plan, and greedy's gap to the exact solution: the rows read them, so a new
  # saved state keeps them (a deferred bucket's row reports its last)
  active: dict[int, str] = dataclasses.field(default_factory=dict)
  gaps: dict[int, float] = dataclasses.field(default_factory=dict)
  floor: budgets.Fit | None = None  # the risk-free subset's own fit to the budget, once per saved state


def init(saved: ManagerState | None = None) -> PlannerState:
  return PlannerState(saved)


def reset(ps: PlannerState, saved: ManagerState, reason: str) -> PlannerState:
  """A new saved state: units (their times come from its profile, L kinds from its calibration), solved plans,
  bucket plans and the floor fit are dropped."""
  log.info("allocation cache cleared: %s", reason)
  return dataclasses.replace(ps, saved=saved, units={}, plans={}, buckets={}, floor=None)


def forget(ps: PlannerState, reason: str, bucket: int | None = None, plans: bool = False) -> PlannerState:
  """Drop one bucket's plan (its allowance was fitted), or every bucket's (plans: and every solve, a recalibration)."""
  log.info("allocation cache cleared%s: %s", "" if bucket is None else f" for bucket {bucket}", reason)
  kept = {} if bucket is None else {b: p for b, p in ps.buckets.items() if b != bucket}
  return dataclasses.replace(ps, buckets=kept, plans={} if plans else ps.plans)


def kinds(mc: MemoryConfig, cal: Calibration | None) -> list[str]:
  """The unit kinds that may be L: the calibration's (memory/lgain.py), else memory.lowp_kinds."""
  return cal.kinds if cal is not None and cal.kinds else mc.lowp_kinds


def lowp_ids(pl: Planner, saved: ManagerState | None) -> list[tuple[int, str]]:
  """(layer, kind) of every unit that may be L."""
  return calibration.lowp_units(pl.num_layers, kinds(pl.mc, saved.calibration if saved is not None else None))


def at_shape(pl: Planner, ps: PlannerState, batch) -> PlannerState:
  """The state planning for this batch's shape: its units enumerated once per shape."""
  shape, units = pl.hooks.batch_shape(batch), ps.units
  if shape not in units:
    units = {**units, shape: profile.enumerate_units(pl.hooks.model_cfg, *shape, pl.mc.group_size, ps.saved.profile,
                                                     pl.mc.lowp_format, kinds(pl.mc, ps.saved.calibration))}
  return dataclasses.replace(ps, shape=shape, units=units)


def unit_list(ps: PlannerState) -> list[profile.Unit]:
  return ps.units[ps.shape]


def exposure_on(pl: Planner, saved: ManagerState | None) -> bool:
  """hilore runs exposure buckets: more than one configured and the calibration's gate on, or memory.gate.mode always
  (a calibration without a gate record, an older one: on)."""
  cal = saved.calibration if saved is not None else None
  if not pl.record.exposure or pl.mc.buckets <= 1 or cal is None:  # no calibration: no L, nothing to score
    return False
  if pl.mc.gate.mode != "auto":  # forced, whatever a given calibration's gate measured
    return pl.mc.gate.mode == "always"
  return bool(cal.gate["on"]) if cal.gate else True


def bucket_levels(pl: Planner, saved: ManagerState, scores_MU: np.ndarray) -> list[tuple[int, ...]]:
  """Each minibatch's bucket key: its units' exposure levels (exposure off: one bucket)."""
  if not exposure_on(pl, saved):
    return [()] * len(scores_MU)
  return [bucketing.unit_levels(s, saved.calibration.predicted_error, pl.mc.buckets) for s in scores_MU]


def risks(pl: Planner, ps: PlannerState, bucket: int) -> tuple[dict, dict]:
  """(risk_of, sensitivity) per (layer, kind): hilore's at this bucket's exposure, static for the baselines."""
  st = ps.saved
  keys = [tuple(u) for u in lowp_ids(pl, st)]
  if pl.record.exposure:
    return dict(zip(keys, bucketing.bucket_risk(st.calibration, st.buckets[bucket]).tolist())), {}
  if pl.record.calibrated:
    static, kappa = st.calibration.static_error, st.calibration.coherence
    return {k: kappa * e for k, e in zip(keys, static)}, dict(zip(keys, static))
  return {}, {}


def solve(pl: Planner, ps: PlannerState, bucket: int, allowance: int, solver: str | None = None,
          delta: float | None = None, method: str | None = None, zero_risk: bool = False, relaxed: bool = False
          ) -> tuple[PlannerState, methods.Plan]:
  """The method's (or, method, its risk-free subset's) plan for a bucket and byte allowance at the state's shape;
  memoised: the budget fit, the greedy gap and the active-constraint check ask for the same solves, and buckets with
  equal risks share them. zero_risk: the method's plan with every L unit free of risk (memory/lgain.py); relaxed:
  any number of layer runs (lgain's screen)."""
  method, cal, mc = method or pl.method, ps.saved.calibration, pl.mc
  # a subset plans risk-free
  risk_of, sens = risks(pl, ps, bucket) if method == pl.method and not zero_risk else ({}, {})
  kw = dict(risk_of=risk_of, delta=(cal.delta if cal else 0.0) if delta is None else delta, fmt=mc.lowp_format,
            allow_o=mc.offload, sensitivity=sens, group_size=mc.group_size, solver=solver or mc.solver,
            mip_gap=mc.mip_gap, max_runs=0 if relaxed else mc.plan_runs, mip_time_limit_s=mc.mip_time_limit_s)
  key = (ps.shape, method, tuple(sorted(risk_of.items())), max(allowance, 0), kw["delta"], kw["solver"],
         kw["max_runs"])
  if key in ps.plans:
    return ps, ps.plans[key]
  plan = methods.plan(method, unit_list(ps), ps.saved.profile["ops"], max(allowance, 0), **kw)
  return dataclasses.replace(ps, plans={**ps.plans, key: plan}), plan


class Session:
  """Solves against one state whose memo grows, for the callbacks a search calls (budget.fit_plan's,
  methods.active_constraint's, lgain.assess's): `ps` is the state they leave, for the caller to return."""

  def __init__(self, pl: Planner, ps: PlannerState):
    self.pl, self.ps = pl, ps

  def plan(self, bucket: int, allowance: int, **kw) -> methods.Plan:
    self.ps, plan = solve(self.pl, self.ps, bucket, allowance, **kw)
    return plan


def gc_plan(pl: Planner, ps: PlannerState) -> methods.Plan:
  """Full checkpointing under the state's shape's cost model: what every plan's rerun time is against."""
  return methods.plan("gc", unit_list(ps), ps.saved.profile["ops"], 0)


def policies(pl: Planner, ps: PlannerState, plan: methods.Plan) -> tuple[model.LayerPolicy, ...]:
  return methods.policies(plan, unit_list(ps), pl.num_layers, pl.mc.group_size, pl.method)


def allowance_of(ps: PlannerState, bucket: int) -> int:
  """The bucket's fitted byte allowance (default: the budget's nominal one, budget - GC)."""
  st = ps.saved
  return st.allowance.get(str(bucket), st.budget_bytes - st.gc_bytes)


def _solve_bucket(pl: Planner, ps: PlannerState, bucket: int) -> PlannerState:
  """The bucket's plan at its allowance, which budget binds it, and (solved methods) greedy's gap to the exact one."""
  st, mc, s = ps.saved, pl.mc, Session(pl, ps)
  if bucket in st.fallback_gc:
    plan, active, gap = gc_plan(pl, ps), "none", None
  elif bucket in st.risk_free:  # the method's own fit compiled slower than its risk-free subset's (budget.py)
    subset, allowance = pl.record.risk_free_subset, max(allowance_of(ps, bucket), 0)
    plan, gap = s.plan(bucket, allowance, method=subset), None
    active = methods.active_constraint(subset, unit_list(ps), allowance, plan,
                                       lambda a, d=None: s.plan(bucket, a, method=subset))
  else:
    allowance, gap = max(allowance_of(ps, bucket), 0), None
    plan = s.plan(bucket, allowance)
    if pl.record.solved:  # the greedy fast path against the exact MILP, once per bucket: logged
      other = s.plan(bucket, allowance, solver="greedy" if mc.solver == "exact" else "exact")
      exact, greedy = (plan, other) if mc.solver == "exact" else (other, plan)
      gap = (greedy.time_s - exact.time_s) / max(exact.time_s, 1e-12)
      log.info("%s bucket %d: greedy is %.2f%% slower than the exact solution", pl.method, bucket, 100 * gap)
    rtol = max(1e-6, mc.mip_gap if mc.solver == "exact" else 0.0)  # a gap-sized win is solver noise
    active = methods.active_constraint(pl.method, unit_list(ps), allowance, plan,
                                       lambda a, d=None: s.plan(bucket, a, delta=d), rtol=rtol)
  reason = "first use of bucket" if s.ps.buckets else "first allocation"
  log.info("allocation for exposure bucket %d solved (%s)", bucket, reason)
  gaps = s.ps.gaps if gap is None else {**s.ps.gaps, bucket: gap}
  return dataclasses.replace(s.ps, buckets={**s.ps.buckets, bucket: plan}, active={**s.ps.active, bucket: active},
                             gaps=gaps)


def bucket_plan(pl: Planner, ps: PlannerState, bucket: int) -> tuple[PlannerState, methods.Plan]:
  """The bucket's plan, solved on its first use."""
  if bucket not in ps.buckets:
    ps = _solve_bucket(pl, ps, bucket)
  return ps, ps.buckets[bucket]


def bucket_for(pl: Planner, ps: PlannerState, levels: tuple[int, ...]) -> tuple[PlannerState, int]:
  """The bucket of a minibatch with these unit levels (buckets.bucket_for: its own, a fitted one covering it, or a
  new one, appended to the saved buckets)."""
  s = Session(pl, ps)

  def time_of(b: int) -> float:
    s.ps, plan = bucket_plan(pl, s.ps, b)
    return plan.time_s

  bucket = bucketing.bucket_for(ps.saved, levels, time_of)
  if bucket == len(s.ps.saved.buckets):
    s.ps = dataclasses.replace(s.ps, saved=dataclasses.replace(s.ps.saved, buckets=[*s.ps.saved.buckets,
                                                                                    list(levels)]))
  return s.ps, bucket
