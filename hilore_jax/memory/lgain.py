"""Whether calibrating L can change the plan: decided before any risk is measured.

Two plans bound what a calibration can do. The risk-free (H/R) plan needs none. The plan the cost model picks were
every L unit free of risk, and its layers free of the run shape (memory.plan_runs), is the most any calibrated plan
can gain, since measured risks and the run shape only constrain it further. L's predicted gain is the second's
predicted seconds saved against the first's, as a share of the update step full checkpointing predicts (update_s:
what the measured guard later compares): first at its best over the allowances a budget fit can reach (the cost
model alone, no compile), then between the two plans fitted to the budget on the compiled step (the risk-free fit is
the run's plan anyway, and its allowance is the L fit's first
try). Calibration runs only where the gain is above the measured noise (NOISE_SIGMAS standard errors of that
difference, from the op profile's repetitions) and at least memory.min_l_gain, and it measures only the unit kinds
the fitted L plan holds in L. Otherwise the run keeps the risk-free fit: no calibration, no L, nothing to
recalibrate."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from hilore_jax.memory import costmodel
from hilore_jax.memory.allocator import L
from hilore_jax.memory.budget import Fit
from hilore_jax.memory.methods import Plan, layers_of
from hilore_jax.model import units as U

NOISE_SIGMAS = 2.0
# allowances, as multiples of the nominal one (budget - GC), at which the best predicted gain is looked for before
# any compile: a budget fit shrinks the allowance by a compiled excess or grows it into slack
ALLOWANCE_GRID = (0.25, 0.5, 1.0, 1.5)


def op_counts(plan: Plan, unit_list) -> dict[tuple[str, str], int]:
  """How many layers rerun each producer op ("op", name) and encode + decode each kind ("codec", kind) under the
  plan: its predicted seconds are these counts times the profile's times."""
  out: dict[tuple[str, str], int] = {}
  for idx in layers_of(unit_list):
    choice = {unit_list[i].kind: plan.choice[i] for i in idx}
    for op in costmodel.rerun_ops(choice):
      out[("op", op)] = out.get(("op", op), 0) + 1
    for i in idx:
      if plan.choice[i] == L:
        out[("codec", unit_list[i].kind)] = out.get(("codec", unit_list[i].kind), 0) + 1
  return out


def noise_s(a: Plan, b: Plan, unit_list, profile: dict, fmt: str = "int8") -> float:
  """One standard error of the predicted difference a.time_s - b.time_s. An op's (or a codec's) time is one median
  that every layer shares, so its error counts once per layer more that one plan runs it than the other; a profile
  without errors (given op times, an older cache) has none."""
  ca, cb = op_counts(a, unit_list), op_counts(b, unit_list)
  var = 0.0
  for key in set(ca) | set(cb):
    what, name = key
    if what == "op":
      t, e = profile["ops"].get(name, 0.0), profile.get("ops_err", {}).get(name, 0.0)
    else:
      t = profile.get("codec", {}).get(name, {}).get(fmt, 0.0)
      e = profile.get("codec_err", {}).get(name, {}).get(fmt, 0.0)
    var += ((ca.get(key, 0) - cb.get(key, 0)) * t * e) ** 2
  return math.sqrt(var)


def update_s(gc: Plan, op_s: dict, num_layers: int) -> float:
  """The update step's predicted seconds under full checkpointing: the layers' forward, its recompute (gc's time),
  and a backward of twice the forward (a matmul's two gradient matmuls to its one)."""
  return 3 * num_layers * sum(op_s.get(op, 0.0) for op in U.PRODUCERS) + gc.time_s


def lowp_kinds(plan: Plan | None, unit_list) -> list[str]:
  """The kinds the plan holds in L anywhere, in units.LOWP_UNITS order."""
  kinds = set() if plan is None else {u.kind for u, c in zip(unit_list, plan.choice) if c == L}
  return [k for k in U.LOWP_UNITS if k in kinds]


def gain(risk_free: Plan, lowp: Plan | None, step_s: float) -> float:
  """L's predicted seconds saved against the risk-free plan, as a share of the update step's step_s (-inf where no
  L plan fitted)."""
  return -math.inf if lowp is None else (risk_free.time_s - lowp.time_s) / max(step_s, 1e-12)


def decide(stage: str, risk_free: Plan, lowp: Plan | None, step_s: float, noise: float, min_gain: float,
           unit_list: Sequence) -> dict:
  """The decision's record (ManagerState.lgain): at `stage` ("cost model": the best over ALLOWANCE_GRID; "fitted":
  the two budget fits) L's gain and the noise (shares of the update step's predicted step_s), whether to
  calibrate, the kinds to calibrate, and why in words."""
  g = gain(risk_free, lowp, step_s)
  noise_share = NOISE_SIGMAS * noise / max(step_s, 1e-12)
  kinds = lowp_kinds(lowp, unit_list)
  calibrate = bool(kinds) and g > noise_share and g >= min_gain
  where = "at its best over the allowances a fit can reach" if stage == "cost model" else "fitted to the budget"
  if lowp is None or not kinds:
    reason = f"no plan with L units fits the budget ({stage})"
  elif calibrate:
    reason = (f"L's predicted gain over the risk-free plan, {where}, is {100 * g:.1f}% of the update step (noise "
              f"{100 * noise_share:.1f}%, memory.min_l_gain {100 * min_gain:.1f}%): calibrating {', '.join(kinds)}")
  else:
    why = (f"inside the measured noise ({100 * noise_share:.1f}%)" if g <= noise_share else
           f"below memory.min_l_gain ({100 * min_gain:.1f}%)")
    reason = f"L's predicted gain over the risk-free plan, {where}, is {100 * g:.1f}% of the update step, {why}"
  return {"stage": stage, "gain": float(g) if math.isfinite(g) else None, "noise": float(noise_share),
          "min_l_gain": float(min_gain), "update_s": float(step_s), "risk_free_s": float(risk_free.time_s),
          "lowp_s": None if lowp is None else float(lowp.time_s), "kinds": kinds if calibrate else [],
          "calibrate": calibrate, "reason": reason}


def assess(gc: Plan, step_s: float, pair_at: Callable[[float], tuple[Plan, Plan]], fit_floor: Callable[[], Fit],
           fit_lowp: Callable[[int | None], Fit], noise: Callable[[Plan, Plan], float], min_gain: float,
           unit_list, min_plan_gain: float = 0.0) -> tuple[dict, Fit]:
  """(the decision's record, the risk-free fit): the cost model's best gain over ALLOWANCE_GRID (pair_at(f): the
  risk-free and the risk-free-L plans at f x the nominal allowance); where it calibrates, both fitted to the budget
  (fit_lowp(reuse): the L plan's fit, first at the risk-free fit's allowance; gc: the run's plan where no risk-free
  plan fits) and decided again on the fitted plans. step_s: the update step's predicted seconds (update_s). Where
  nothing is calibrated and even the risk-free plan's best predicted gain over GC is under min_plan_gain, no plan is
  fitted (no probe compile): the record says `gc_only`, and the fit returned is empty."""
  pairs = [pair_at(f) for f in ALLOWANCE_GRID]
  rf, lp = max(pairs, key=lambda p: gain(*p, step_s))
  rec = decide("cost model", rf, lp, step_s, noise(rf, lp), min_gain, unit_list)
  rec["plan_gain"] = float(max(gain(gc, p[0], step_s) for p in pairs))  # the risk-free plans' against GC's
  if not rec["calibrate"] and rec["plan_gain"] < min_plan_gain:
    rec["reason"] += (f"; the risk-free plan's predicted gain over full checkpointing, at its best, is "
                      f"{100 * rec['plan_gain']:.1f}% of the update step, below memory.min_plan_gain "
                      f"({100 * min_plan_gain:.1f}%): full checkpointing, no plan fitted")
    return {**rec, "gc_only": True, "risk_free_allowance": None}, Fit(0, None, ())
  floor = fit_floor()
  if rec["calibrate"]:
    fit = fit_lowp(floor.allowance if floor.plan is not None else None)
    rf = floor.plan or gc
    rec = {**decide("fitted", rf, fit.plan, step_s, noise(rf, fit.plan) if fit.plan else 0.0, min_gain, unit_list),
           "lowp_allowance": fit.allowance}
  return {**rec, "risk_free_allowance": floor.allowance if floor.plan is not None else None}, floor
