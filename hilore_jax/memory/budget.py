"""The memory budget: its size against full checkpointing's compiled peak, and the fit of a plan to it.

The cost model's bytes add up unit by unit; XLA's compiled peak does not, so a plan is fitted on the compiled
step: `fit_allowance` shrinks the byte allowance the planner may spend by any excess and grows it into any slack,
bisecting over a few probe compiles, and returns the fastest plan whose compiled peak is within the budget. It is a
pure function of two callables (plan for an allowance, compiled peak of a plan), tested on its own.

A method whose options include another's (hilore's and hilore_static's H/L/R include the risk-free H/R of
optimal_hr) can still fit worse: its L plans may compile over budget, and the probes that shrink the allowance then
end on a plan slower than the subset's own fit. `no_slower_than` keeps the subset's fit wherever it is faster.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Generic, TypeVar

from hilore_jax.errors import InfeasibleBudget

log = logging.getLogger(__name__)
PlanT = TypeVar("PlanT")


def budget_bytes(gc_bytes: int, ratio: float, absolute: int | None = None) -> int:
  """The budget: `absolute` if given, else ratio x full checkpointing's peak; below that peak is an error."""
  budget = absolute if absolute is not None else int(ratio * gc_bytes)
  if budget < gc_bytes:
    raise InfeasibleBudget(f"memory budget {budget} bytes is below full checkpointing's {gc_bytes} bytes, the minimum")
  return budget


@dataclasses.dataclass(frozen=True)
class Probe:
  """One probe compile: the allowance tried, the cost model's bytes of its plan, XLA's compiled peak."""

  allowance: int
  predicted_bytes: int
  compiled_bytes: int
  budget: int

  @property
  def fits(self) -> bool:
    return self.compiled_bytes <= self.budget


@dataclasses.dataclass(frozen=True)
class Fit(Generic[PlanT]):
  """The fitted allowance and plan (None: nothing fitted, fall back to full checkpointing) and every probe."""

  allowance: int
  plan: PlanT | None
  probes: tuple[Probe, ...]
  floor: bool = False  # the plan is the floor's (the risk-free subset's own fit), not the method's


def fit_allowance(budget: int, gc_bytes: int, plan_for: Callable[[int], PlanT], peak_of: Callable[[PlanT], int],
                  max_probes: int, time_of: Callable[[PlanT], float], bytes_of: Callable[[PlanT], int]) -> Fit[PlanT]:
  """Search the byte allowance (activation bytes on top of GC) whose plan compiles within `budget`.

  Starts at budget - gc_bytes; while nothing is over budget it grows by the slack (at least 5% of the budget),
  after an excess it shrinks by it (doubling the step on each further excess before anything fits), then bisects;
  stops early when the plan stops growing with the allowance or the bracket is under 0.5% of the budget.
  The fastest fitting plan wins.
  """
  allowance, lo, hi = budget - gc_bytes, None, None  # lo fits, hi does not
  best: tuple[int, PlanT] | None = None
  probes, overs = [], 0
  for _ in range(max_probes):
    plan = plan_for(allowance)
    compiled = peak_of(plan)
    probe = Probe(allowance, gc_bytes + bytes_of(plan), compiled, budget)
    probes.append(probe)
    log.info("allowance %d B -> predicted %d B, compiled %d B (%s budget %d B)", allowance, probe.predicted_bytes,
             compiled, "within" if probe.fits else "OVER", budget)
    if probe.fits:
      if best is None or time_of(plan) < time_of(best[1]):
        best = (allowance, plan)
      lo = allowance
      if allowance > 0 and bytes_of(plan) < allowance // 2:
        break  # the plan no longer grows with the allowance (everything useful is kept)
    else:
      hi, overs = allowance, overs + 1
    if hi is None:
      allowance = allowance + max(budget - compiled, budget // 20)
    elif lo is None:
      # XLA's peak is not linear in the plan's bytes: a shrink by the excess alone can stay over for several probes
      allowance = max(allowance - (compiled - budget) * 2 ** (overs - 1), 0)
    else:
      allowance = (lo + hi) // 2
    if hi is not None and lo is not None and hi - lo < budget // 200:
      break
  if best is None:
    return Fit(0, None, tuple(probes))
  return Fit(best[0], best[1], tuple(probes))


def fit_plan(budget: int, gc_bytes: int, plan_for: Callable[[int], PlanT], peak_of: Callable[[PlanT], int],
             max_probes: int, time_of: Callable[[PlanT], float], bytes_of: Callable[[PlanT], int],
             reuse: int | None = None, floor: Callable[[], Fit[PlanT]] | None = None) -> Fit[PlanT]:
  """A plan fitted to the budget: the plan at `reuse` (an allowance fitted before: one compile, of a step that will
  run anyway) when it compiles within budget, else fit_allowance's search; then, given `floor` (the risk-free
  subset's own fit, evaluated only here), whichever of the two is faster (no_slower_than)."""
  fit = None
  if reuse is not None:
    plan = plan_for(reuse)
    probe = Probe(reuse, gc_bytes + bytes_of(plan), peak_of(plan), budget)
    if probe.fits:
      log.info("allowance %d B reused (compiled %d B within budget %d B)", reuse, probe.compiled_bytes, budget)
      fit = Fit(reuse, plan, (probe,))
  if fit is None:
    fit = fit_allowance(budget, gc_bytes, plan_for, peak_of, max_probes, time_of, bytes_of)
  return fit if floor is None else no_slower_than(fit, floor(), time_of)


def no_slower_than(fit: Fit[PlanT], floor: Fit[PlanT], time_of: Callable[[PlanT], float]) -> Fit[PlanT]:
  """fit, or floor where floor fitted a faster plan; floor is the fit of a subset of the method's options (its
  risk-free H/R plans) to the same budget, so the method never returns a slower plan than the subset would."""
  if floor.plan is None or (fit.plan is not None and time_of(fit.plan) <= time_of(floor.plan)):
    return fit
  log.info("the risk-free fit (allowance %d B) is faster than the method's (allowance %d B): keeping it",
           floor.allowance, fit.allowance)
  return dataclasses.replace(floor, probes=fit.probes + floor.probes, floor=True)
