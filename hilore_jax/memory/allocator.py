"""H/L/R/O allocation: per group (a layer, or a single unit) pick one option so total time is minimal under a
memory budget and a risk budget (a multiple-choice knapsack with two constraints)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

H, L, R, O = "H", "L", "R", "O"


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
class Option:
  """One way to keep a group's units: per-unit choices and their bytes, seconds and risk."""

  choice: tuple[str, ...]
  bytes: int
  time_s: float
  risk: float = 0.0


@dataclasses.dataclass(frozen=True)
class Allocation:
  choice: tuple[str, ...]  # per unit, groups concatenated in input order
  bytes: int  # activation bytes on top of the fixed base
  time_s: float  # recompute + encode/decode (+ transfer) time
  risk: float
  picks: tuple[int, ...] = ()  # the option index chosen in each group


def per_unit(units: Sequence[UnitCost]) -> list[list[Option]]:
  """Independent units as groups of one: options R, H and (where possible) L."""
  groups = []
  for u in units:
    opts = [Option((R,), 0, u.recompute_s), Option((H,), u.bytes_h, 0.0)]
    if u.bytes_l is not None:
      opts.append(Option((L,), u.bytes_l, u.codec_s, u.risk))
    groups.append(opts)
  return groups


def _summary(groups: Sequence[Sequence[Option]], picks: Sequence[int]) -> Allocation:
  chosen = [g[i] for g, i in zip(groups, picks)]
  return Allocation(tuple(c for o in chosen for c in o.choice), int(sum(o.bytes for o in chosen)),
                    float(sum(o.time_s for o in chosen)), float(sum(o.risk for o in chosen)), tuple(picks))


def _start(groups, budget_bytes) -> list[int]:
  """Each group's fewest-bytes (then fastest, then safest) option; an error if even those do not fit."""
  picks = [min(range(len(g)), key=lambda i: (g[i].bytes, g[i].time_s, g[i].risk)) for g in groups]
  floor = sum(g[i].bytes for g, i in zip(groups, picks))
  if budget_bytes < floor:
    raise ValueError(f"memory budget is {floor - budget_bytes} bytes below what full recomputation needs "
                           f"(the minimum is {floor} bytes on top of the fixed base)")
  return picks


def greedy(groups: Sequence[Sequence[Option]], budget_bytes: int, risk_budget: float) -> Allocation:
  """Start from the fewest bytes; repeatedly take the option change with the most seconds saved per extra byte
  that fits both budgets (moves that save time without extra bytes or risk come first)."""
  picks = _start(groups, budget_bytes)
  arrays = [(np.array([o.bytes for o in g], float), np.array([o.time_s for o in g]), np.array([o.risk for o in g]))
            for g in groups]
  used = sum(g[i].bytes for g, i in zip(groups, picks))
  risk = sum(g[i].risk for g, i in zip(groups, picks))
  while True:
    best, best_gain = None, 0.0
    for gi, (b, t, r) in enumerate(arrays):
      i = picks[gi]
      saved, extra_b, extra_r = t[i] - t, b - b[i], r - r[i]
      ok = (saved > 1e-15) & (used + extra_b <= budget_bytes) & (risk + extra_r <= risk_budget + 1e-12)
      if not ok.any():
        continue
      gain = np.where(ok, saved / np.maximum(extra_b, 1.0), -np.inf)
      j = int(np.argmax(gain))
      if gain[j] > best_gain:
        best, best_gain = (gi, j), gain[j]
    if best is None:
      return _summary(groups, picks)
    gi, j = best
    b, t, r = arrays[gi]
    used += b[j] - b[picks[gi]]
    risk += r[j] - r[picks[gi]]
    picks[gi] = j


def exact(groups: Sequence[Sequence[Option]], budget_bytes: int, risk_budget: float,
          mip_gap: float = 1e-4) -> Allocation:
  """Optimal allocation (within a proven relative gap, HiGHS' default 1e-4) by a mixed-integer program
  (scipy.optimize.milp): one binary per group and option."""
  from scipy.optimize import Bounds, LinearConstraint, milp

  _start(groups, budget_bytes)  # raises on an infeasible budget
  sizes = [len(g) for g in groups]
  n = sum(sizes)
  opts = [o for g in groups for o in g]
  cost = np.array([o.time_s for o in opts])
  mem = np.array([o.bytes for o in opts], float)
  risk = np.array([o.risk for o in opts])
  one = np.zeros((len(groups), n))
  start = np.cumsum([0] + sizes[:-1])
  for gi, (s, k) in enumerate(zip(start, sizes)):
    one[gi, s:s + k] = 1.0
  # scale rows so HiGHS' tolerances mean the same for bytes (1e9) and seconds (1e-3)
  mscale, rscale = max(mem.max(), 1.0), max(risk.max(), 1e-30)
  res = milp(cost / max(cost.max(), 1e-30), integrality=np.ones(n), bounds=Bounds(np.zeros(n), np.ones(n)),
             constraints=[LinearConstraint(mem[None] / mscale, -np.inf, budget_bytes / mscale),
                          LinearConstraint(risk[None] / rscale, -np.inf, (risk_budget + 1e-12) / rscale),
                          LinearConstraint(one, 1, 1)], options={"mip_rel_gap": mip_gap})
  if not res.success:
    raise RuntimeError(f"MILP failed: {res.message}")
  x = np.round(res.x).astype(int)
  picks = [int(np.argmax(x[s:s + k])) for s, k in zip(start, sizes)]
  return _summary(groups, picks)
