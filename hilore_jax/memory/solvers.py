"""The allocator's solvers: one MILP call (HiGHS, scipy.optimize.milp) and the instances solved by their structure
instead of by positions, identical layers by counts and plans of at most two runs by trying each. Groups are
sequences of allocator.Option (choice, bytes, time_s, risk); each solver returns picks, an option index per group."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hilore_jax import runtime


def milp(cost, integrality, upper, constraints, mip_gap: float, time_limit_s: float):
  """HiGHS (scipy.optimize.milp) over variables in [0, upper], to a proven relative gap within an optional time
  limit: its result, an error unless it proved the gap or stopped at the limit (status 1, its incumbent, if any, in
  res.x)."""
  from scipy import optimize

  options = {"mip_rel_gap": mip_gap, **({"time_limit": float(time_limit_s)} if time_limit_s > 0 else {})}
  res = optimize.milp(cost, integrality=integrality, bounds=optimize.Bounds(np.zeros(len(cost)), upper),
                      constraints=constraints, options=options)
  # HiGHS's working set, freed, stays in malloc's arenas and adds up over solves: 30 layers x 32,850 options took a
  # process from 0.56 to 12.9 GiB resident, 0.3 GiB after the trim (docs/capacity.md)
  runtime.release_host_memory()
  if not res.success and not (res.status == 1 and time_limit_s > 0):
    raise RuntimeError(f"MILP failed: {res.message}")
  return res


def identical(groups: Sequence[Sequence]) -> bool:
  """Whether every group has the same options (equal choices, bytes, seconds and risks): layers of one shape whose
  L units carry equal risks, as every risk-free plan's and an uncalibrated one's."""
  return len(groups) > 1 and all(tuple(g) == tuple(groups[0]) for g in groups[1:])


def counts(groups, budget_bytes: int, risk_budget: float, mip_gap: float, runs: int,
           time_limit_s: float) -> tuple[list[int] | None, bool]:
  """(picks, proven) where every group is the same: which groups take an option does not change bytes, seconds or
  risk, only how many do, so the MILP picks counts n_o (integers, sum G) and, with runs > 0, which options are used
  (y_o, at most `runs`, each by at least two groups). Positional binaries made HiGHS search every permutation of the
  layers: 30 layers x 1,095 options ran 216 s and 12.9 GiB resident (docs/capacity.md). The plan: one run per option
  used, the fewest bytes first (most bytes first, the binding bench's plans compiled over budget and kept a third as
  much). picks None: stopped at the time limit with no incumbent."""
  from scipy import sparse
  from scipy.optimize import LinearConstraint

  opts, G = list(groups[0]), len(groups)
  k = len(opts)
  cost = np.array([o.time_s for o in opts])
  mem = np.array([o.bytes for o in opts], float)
  risk = np.array([o.risk for o in opts])
  mscale, rscale = max(np.abs(mem).max(), 1.0), max(risk.max(), 1e-30)
  used = k if runs > 0 else 0  # y_o: option o is some run's
  pad = lambda row: np.concatenate([row, np.zeros(used)])[None]
  constraints = [LinearConstraint(pad(mem / mscale), -np.inf, budget_bytes / mscale),
                 LinearConstraint(pad(risk / rscale), -np.inf, (risk_budget + 1e-12) / rscale),
                 LinearConstraint(pad(np.ones(k)), G, G)]
  if used:
    eye = sparse.identity(k, format="csr")
    constraints += [LinearConstraint(sparse.hstack([eye, -2 * eye]).tocsr(), 0.0, np.inf),  # no run one group long
                    LinearConstraint(sparse.hstack([eye, -G * eye]).tocsr(), -np.inf, 0.0),
                    LinearConstraint(np.concatenate([np.zeros(k), np.ones(k)])[None], -np.inf, runs)]
  res = milp(np.concatenate([cost / max(cost.max(), 1e-30), np.zeros(used)]), np.ones(k + used),
             np.concatenate([np.full(k, G), np.ones(used)]), constraints, mip_gap, time_limit_s)
  if res.x is None:
    return None, False
  n = np.round(res.x[:k]).astype(int)
  if n.sum() != G:
    raise RuntimeError(f"MILP failed: its counts cover {n.sum()} of {G} groups")
  order = sorted(np.flatnonzero(n), key=lambda i: (opts[i].bytes, opts[i].time_s, i))
  return [int(i) for i in order for _ in range(n[i])], bool(res.success)


def two_runs(groups, budget_bytes: int, risk_budget: float, runs: int, block: int = 256) -> list[int]:
  """The optimal picks under at most two runs, by trying every such plan: one choice for all groups, or choice a on
  groups [0, m) and b on [m, G) for every split m with both runs at least two long; vectorised over (a, b) pairs in
  blocks of a, from per-choice prefix sums of bytes, seconds and risk (a choice missing from a group's options,
  pruned there, cannot cover it). O(G K^2) for K choices, exact, and no solver: per-layer risks (a calibrated plan)
  made the MILP take 15-60 s a solve at 30 layers x ~230 options (docs/hilore.md)."""
  G = len(groups)
  choices = list(dict.fromkeys(o.choice for g in groups for o in g))
  col = {c: j for j, c in enumerate(choices)}
  K = len(choices)
  # bytes, seconds, risk of each group under each choice, and a 4th row: 1 where the choice is not among its options
  per = np.zeros((4, G, K))
  per[3] = 1.0
  for gi, g in enumerate(groups):
    for o in g:
      per[:, gi, col[o.choice]] = (o.bytes, o.time_s, o.risk, 0.0)
  pre = np.concatenate([np.zeros((4, 1, K)), np.cumsum(per, axis=1)], axis=1)  # [4, G + 1, K]: groups [0, m)
  # groups [m, G) summed on their own: total - pre loses a small tail's risk beside a large head's
  suf = np.concatenate([np.cumsum(per[:, ::-1], axis=1)[:, ::-1], np.zeros((4, 1, K))], axis=1)
  total = pre[:, G]
  budget_r = risk_budget + 1e-12
  fits = lambda v: (v[0] <= budget_bytes) & (v[2] <= budget_r) & (v[3] < 0.5)  # noqa: E731
  best, best_key = None, (np.inf, np.inf, np.inf)

  def consider(v, where):
    """v [4, ...] over candidate plans, where(flat index) -> the plan: keep the fastest, at equal seconds (free codecs
    tie H with L) the fewest bytes, then the least risk."""
    nonlocal best, best_key
    t = np.where(fits(v), v[1], np.inf).ravel()
    if not np.isfinite(t.min()):
      return
    ties = np.flatnonzero(t <= t.min() + 1e-12 * max(1.0, abs(t.min())))
    j = ties[np.lexsort((v[2].ravel()[ties], v[0].ravel()[ties]))[0]]
    key = (t[j], v[0].ravel()[j], v[2].ravel()[j])
    if key[0] < best_key[0] - 1e-12 * max(1.0, abs(key[0])) or (
        abs(key[0] - best_key[0]) <= 1e-12 * max(1.0, abs(key[0])) and key[1:] < best_key[1:]):
      best, best_key = where(int(j)), key

  consider(total, lambda j: (0, j))  # one run: every group the same choice
  for m in range(2, G - 1) if runs >= 2 else ():
    head, tail = pre[:, m], suf[:, m]  # [4, K] each: choice a on [0, m), choice b on [m, G)
    for lo in range(0, K, block):
      pair = head[:, lo:lo + block, None] + tail[:, None, :]  # [4, block, K]
      consider(pair, lambda j, m=m, lo=lo: (m, lo + j // K, j % K))
  if best is None:
    raise RuntimeError("MILP failed: no plan of at most two runs fits both budgets")
  if best[0] == 0:
    pick = [best[1]] * G
  else:
    m, a, b = best
    pick = [a] * m + [b] * (G - m)
  index = [{o.choice: i for i, o in enumerate(g)} for g in groups]
  return [index[gi][choices[c]] for gi, c in enumerate(pick)]
