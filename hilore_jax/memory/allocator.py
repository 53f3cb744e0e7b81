"""H/L/R/O allocation: per group (a layer, or a single unit) pick one option so total time is minimal under a
memory budget and a risk budget (a multiple-choice knapsack with two constraints), and, where groups are the layers
in order, of a run shape: consecutive layers with the same choice form a run, and each run compiles once, as one
layer scan (model.run_layers), so a plan of at most `runs` runs compiles in the same time at any depth; no run is one
layer long (a loop of one, which XLA inlines: on XLA:CPU it kept more than the same layer in a loop)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from hilore_jax.memory import solvers

log = logging.getLogger(__name__)

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
  proven: bool = True  # exact only: False where the solver's time limit ended it before the gap was proven


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


def run_spans(groups: Sequence[Sequence[Option]], picks: Sequence[int]) -> list[tuple[int, int]]:
  """(start, end) of each run of consecutive groups whose picked options make the same choice."""
  choices = [g[i].choice for g, i in zip(groups, picks)]
  bounds = [k for k in range(len(choices) + 1) if k in (0, len(choices)) or choices[k] != choices[k - 1]]
  return list(zip(bounds[:-1], bounds[1:]))


def num_runs(groups: Sequence[Sequence[Option]], picks: Sequence[int]) -> int:
  return len(run_spans(groups, picks))


def shaped(groups: Sequence[Sequence[Option]], picks: Sequence[int], runs: int) -> bool:
  """Whether picks are a plan of the run shape: at most `runs` runs, none one group long (with two or more)."""
  spans = run_spans(groups, picks)
  return len(spans) <= runs and (len(groups) < 2 or all(e - s > 1 for s, e in spans))


def _merge_runs(groups, picks: list[int], runs: int, budget_bytes: int, risk_budget: float) -> list[int]:
  """The run shape (`shaped`) by merging runs into a neighbour's choice: each time the feasible merge (both budgets)
  that adds the fewest seconds, of a one-group run while there is one; if none is feasible, every group takes its
  fewest-bytes option (one run)."""
  while not shaped(groups, picks, runs):
    choices = [g[i].choice for g, i in zip(groups, picks)]
    spans = run_spans(groups, picks)
    singles = [r for r, (s, e) in enumerate(spans) if e - s == 1]
    best = None
    for r, (s, e) in enumerate(spans):
      if singles and r not in singles:
        continue
      for nb in (r - 1, r + 1):
        if not 0 <= nb < len(spans):
          continue
        target = choices[spans[nb][0]]
        idx = [next((j for j, o in enumerate(groups[k]) if o.choice == target), None) for k in range(s, e)]
        if None in idx:
          continue
        trial = picks[:s] + idx + picks[e:]
        summary = _summary(groups, trial)
        if summary.bytes <= budget_bytes and summary.risk <= risk_budget + 1e-12:
          if best is None or summary.time_s < best[0]:
            best = (summary.time_s, trial)
    if best is None:
      return _start(groups, budget_bytes)
    picks = best[1]
  return picks


def greedy(groups: Sequence[Sequence[Option]], budget_bytes: int, risk_budget: float, runs: int = 0) -> Allocation:
  """Start from the fewest bytes; repeatedly take the option change with the most seconds saved per extra byte
  that fits both budgets (moves that save time without extra bytes or risk come first). runs > 0: then merge runs
  into their neighbours until the plan has the run shape (_merge_runs; a heuristic, as the rest of greedy)."""
  picks = _greedy_picks(groups, budget_bytes, risk_budget)
  if runs > 0:
    picks = _merge_runs(groups, picks, runs, budget_bytes, risk_budget)
  return _summary(groups, picks)


def _greedy_picks(groups, budget_bytes: int, risk_budget: float) -> list[int]:
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
      return picks
    gi, j = best
    b, t, r = arrays[gi]
    used += b[j] - b[picks[gi]]
    risk += r[j] - r[picks[gi]]
    picks[gi] = j


def exact(groups: Sequence[Sequence[Option]], budget_bytes: int, risk_budget: float,
          mip_gap: float = 1e-4, runs: int = 0, time_limit_s: float = 0.0) -> Allocation:
  """Optimal allocation (within a proven relative gap, HiGHS' default 1e-4) by a mixed-integer program
  (scipy.optimize.milp): one binary per group and option. runs > 0: the run shape, at most `runs` runs of
  consecutive groups with one choice, each at least two long (a change variable c_k >= x[k, o] - x[k-1, o] for
  every choice o, sum of c <= runs - 1, c_k + c_{k+1} <= 1, no change at either end). time_limit_s > 0: where
  HiGHS has not proven the gap by then, the faster of its best plan so far and greedy's (proven=False). Groups that
  are all the same (`solvers.identical`) are solved by how many take each option (solvers.counts), the same
  optimum; other groups under at most two runs by trying every plan of that shape (solvers.two_runs: no gap)."""
  from scipy import sparse
  from scipy.optimize import LinearConstraint

  _start(groups, budget_bytes)  # raises on an infeasible budget
  if solvers.identical(groups):
    picks, proven = solvers.counts(groups, budget_bytes, risk_budget, mip_gap, runs, time_limit_s)
    found = None if picks is None else _summary(groups, picks)
    return found if proven else _unproven(groups, budget_bytes, risk_budget, runs, found, time_limit_s)
  if 1 <= runs <= 2 and len(groups) > 1:
    return _summary(groups, solvers.two_runs(groups, budget_bytes, risk_budget, runs))
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
  changes = len(groups) - 1 if runs > 0 and len(groups) > 1 else 0
  pad = lambda a: sparse.hstack([sparse.csr_array(a), sparse.csr_array((a.shape[0], changes))]).tocsr()
  constraints = [LinearConstraint(pad(mem[None] / mscale), -np.inf, budget_bytes / mscale),
                 LinearConstraint(pad(risk[None] / rscale), -np.inf, (risk_budget + 1e-12) / rscale),
                 LinearConstraint(pad(one), 1, 1)]
  if changes:
    constraints += _run_constraints(groups, start, runs)
  res = solvers.milp(np.concatenate([cost / max(cost.max(), 1e-30), np.zeros(changes)]),
                     np.concatenate([np.ones(n), np.zeros(changes)]), np.ones(n + changes), constraints, mip_gap,
                     time_limit_s)
  found = None
  if res.x is not None:
    x = np.round(res.x[:n]).astype(int)
    found = _summary(groups, [int(np.argmax(x[s:s + k])) for s, k in zip(start, sizes)])
  if res.success:
    return found
  return _unproven(groups, budget_bytes, risk_budget, runs, found, time_limit_s)


def _unproven(groups, budget_bytes: int, risk_budget: float, runs: int, found: Allocation | None,
              time_limit_s: float) -> Allocation:
  """At the MILP's time limit: the faster of its incumbent (if any, and feasible) and greedy's plan, marked
  unproven; both are feasible plans of the run shape, neither proven optimal."""
  fast = greedy(groups, budget_bytes, risk_budget, runs)
  ok = found is not None and found.bytes <= budget_bytes and found.risk <= risk_budget + 1e-12 and (
      runs <= 0 or shaped(groups, found.picks, runs))
  best = found if ok and found.time_s <= fast.time_s else fast
  log.warning("the exact allocator stopped at its time limit (%.3g s, memory.mip_time_limit_s) before proving its "
              "gap: using %s plan (%.4g s against greedy's %.4g s)", time_limit_s,
              "the solver's best" if best is found else "greedy's", best.time_s, fast.time_s)
  return dataclasses.replace(best, proven=False)


def _run_constraints(groups, start, runs: int) -> list:
  """c_k >= x[k, o] - x[k-1, o] for every group k > 0 and choice o of group k (c_k: column n + k - 1), and
  sum(c) <= runs - 1: a new run starts wherever a group's choice differs from its predecessor's; and every run at
  least two groups long. Sparse: three entries a row, whatever the number of options (dense, 30 layers of a few
  hundred options took gigabytes)."""
  from scipy import sparse
  from scipy.optimize import LinearConstraint

  n, G = sum(len(g) for g in groups), len(groups)
  index = [{o.choice: int(start[k]) + i for i, o in enumerate(g)} for k, g in enumerate(groups)]
  rows, cols, vals, r = [], [], [], -1
  for k in range(1, G):
    for choice, col in index[k].items():
      r += 1
      rows += [r, r]
      cols += [n + k - 1, col]
      vals += [1.0, -1.0]
      if choice in index[k - 1]:
        rows.append(r)
        cols.append(index[k - 1][choice])
        vals.append(1.0)
  a = sparse.csr_array((vals, (rows, cols)), shape=(r + 1, n + G - 1))
  total = sparse.csr_array((np.ones(G - 1), (np.zeros(G - 1, int), np.arange(n, n + G - 1))), shape=(1, n + G - 1))
  # no run of one layer: no change at the first or last boundary (c_1, c_{G-1}), none at two boundaries in a row
  pairs = [(k, k + 1) for k in range(1, G - 1)]
  rows = [r for r, pair in enumerate(pairs) for _ in pair]
  cols = [n + k - 1 for pair in pairs for k in pair]
  short = sparse.csr_array((np.ones(len(cols)), (rows, cols)), shape=(len(pairs), n + G - 1))
  ends = sparse.csr_array((np.ones(2), ([0, 1], [n, n + G - 2])), shape=(2, n + G - 1))
  out = [LinearConstraint(a, 0.0, np.inf), LinearConstraint(total, -np.inf, runs - 1),
         LinearConstraint(ends, 0.0, 0.0)]
  return out + ([LinearConstraint(short, -np.inf, 1.0)] if pairs else [])
