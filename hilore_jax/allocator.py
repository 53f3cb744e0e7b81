"""H/L/R allocation: minimise recompute + decode time under a memory budget and a risk budget."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

H, L, R = "H", "L", "R"


@dataclasses.dataclass(frozen=True)
class UnitCost:
  """One recovery unit's measured costs (bytes_l None: the unit cannot be low-precision)."""

  name: str
  bytes_h: int
  bytes_l: int | None
  recompute_s: float
  codec_s: float = 0.0
  risk: float = 0.0  # predicted gradient-error contribution when L


@dataclasses.dataclass(frozen=True)
class Allocation:
  choice: tuple[str, ...]  # H/L/R per unit, in input order
  bytes: int  # activation bytes on top of the fixed base
  time_s: float  # recompute (R) + encode/decode (L) time
  risk: float


class InfeasibleBudget(ValueError):
  """The memory budget is below what recomputing every unit needs."""


def _summary(units: Sequence[UnitCost], choice: Sequence[str]) -> Allocation:
  b = t = r = 0.0
  for u, c in zip(units, choice):
    if c == H:
      b += u.bytes_h
    elif c == L:
      b, t, r = b + u.bytes_l, t + u.codec_s, r + u.risk
    else:
      t += u.recompute_s
  return Allocation(tuple(choice), int(b), t, r)


def greedy(units: Sequence[UnitCost], budget_bytes: int, risk_budget: float) -> Allocation:
  """Start all-R; repeatedly take the move (R->H, R->L, L->H) with the best time saved per extra byte that fits."""
  if budget_bytes < 0:
    raise InfeasibleBudget(f"memory budget is {-budget_bytes} bytes below what full recomputation needs")
  choice = [R] * len(units)
  used, risk = 0, 0.0
  while True:
    best, best_gain = None, 0.0
    for i, u in enumerate(units):
      moves = []
      if choice[i] == R:
        moves.append((H, u.recompute_s, u.bytes_h, 0.0))
        if u.bytes_l is not None and u.recompute_s > u.codec_s:
          moves.append((L, u.recompute_s - u.codec_s, u.bytes_l, u.risk))
      elif choice[i] == L:
        moves.append((H, u.codec_s, u.bytes_h - u.bytes_l, -u.risk))
      for to, saved_s, extra_b, extra_risk in moves:
        if saved_s <= 0 or used + extra_b > budget_bytes or risk + extra_risk > risk_budget + 1e-12:
          continue
        gain = saved_s / max(extra_b, 1)
        if gain > best_gain:
          best, best_gain = (i, to, extra_b, extra_risk), gain
    if best is None:
      return _summary(units, choice)
    i, to, extra_b, extra_risk = best
    choice[i] = to
    used += extra_b
    risk += extra_risk


def exact(units: Sequence[UnitCost], budget_bytes: int, risk_budget: float) -> Allocation:
  """Optimal allocation by a mixed-integer program (scipy.optimize.milp): one binary per unit and choice."""
  from scipy.optimize import Bounds, LinearConstraint, milp

  if budget_bytes < 0:
    raise InfeasibleBudget(f"memory budget is {-budget_bytes} bytes below what full recomputation needs")
  n = len(units)
  # variables [h_0..h_n-1, l_0..l_n-1]; r_i = 1 - h_i - l_i
  cost = np.array([-u.recompute_s for u in units] + [u.codec_s - u.recompute_s for u in units])
  mem = np.array([u.bytes_h for u in units] + [u.bytes_l or 0 for u in units], float)
  risk = np.array([0.0] * n + [u.risk for u in units])
  one = np.hstack([np.eye(n), np.eye(n)])
  upper_l = np.array([1.0 if u.bytes_l is not None else 0.0 for u in units])
  res = milp(cost, integrality=np.ones(2 * n),
             bounds=Bounds(np.zeros(2 * n), np.concatenate([np.ones(n), upper_l])),
             constraints=[LinearConstraint(mem[None], -np.inf, budget_bytes),
                          LinearConstraint(risk[None], -np.inf, risk_budget + 1e-12),
                          LinearConstraint(one, 0, 1)])
  if not res.success:
    raise RuntimeError(f"MILP failed: {res.message}")
  x = np.round(res.x).astype(int)
  choice = [H if x[i] else L if x[n + i] else R for i in range(n)]
  return _summary(units, choice)


def optimality_gap(units: Sequence[UnitCost], budget_bytes: int, risk_budget: float) -> float:
  """(greedy time - optimal time) / optimal time; 0 when the greedy is optimal."""
  g, e = greedy(units, budget_bytes, risk_budget), exact(units, budget_bytes, risk_budget)
  return (g.time_s - e.time_s) / max(e.time_s, 1e-12)
