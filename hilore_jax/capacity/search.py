"""The longest completion whose compiled step fits a byte budget, by search on a peak that grows with T, and the
JSON cache of every compiled point, so a rerun (or a larger budget of the same series) compiles nothing it has seen.

peak(T) is close to affine (blockwise attention) or quadratic (attention that holds T x S) in T, so the search fits
the points nearest the budget (a line through two, a parabola through three), probes where the fit crosses it, and
keeps a bracket [largest T that fits, smallest that does not]: a probe that does not halve the bracket twice running
gives way to bisection, and without a failing point yet it doubles. No JAX here: `peak_of` is any callable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Search:
  """The longest fitting T (0: not even one grid step fits), whether the cap ended the search, and its points."""

  longest: int
  capped: bool
  points: dict[int, int]  # T -> peak bytes of every point the search read (cached or compiled)
  compiled: int  # points peak_of was called for (not in `known`)


def bracket(points: dict[int, int], budget: int) -> tuple[int, int | None]:
  """(largest fitting T below the smallest failing one, the smallest failing T or None); 0 when none fits."""
  fails = [t for t, b in points.items() if b > budget]
  hi = min(fails) if fails else None
  lo = max([t for t, b in points.items() if b <= budget and (hi is None or t < hi)], default=0)
  return lo, hi


def predict(points: dict[int, int], budget: int) -> float | None:
  """Where a fit to the (up to) three points nearest the budget crosses it, on its rising side; None if it does not."""
  near = sorted(points, key=lambda t: abs(points[t] - budget))[:3]
  if len(near) < 2:
    return None
  t = np.asarray(near, float)
  coef = np.polyfit(t, np.asarray([points[x] for x in near], float), min(2, len(near) - 1))
  poly = np.poly1d(coef)
  roots = [r.real for r in (poly - budget).roots if abs(r.imag) < 1e-9 and r.real > 0 and poly.deriv()(r.real) > 0]
  return min(roots) if roots else None


def longest(peak_of: Callable[[int], int], budget: int, grid: int, cap: int, start: int,
            known: dict[int, int] | None = None) -> Search:
  """The largest multiple of `grid` up to `cap` whose peak_of(T) <= budget (peak_of: increasing in T), searched
  from `start`; points in `known` are not recomputed."""
  if grid <= 0 or start <= 0 or start % grid or cap < grid:
    raise ValueError(f"search needs grid > 0, start a positive multiple of it and cap >= grid; got grid {grid}, "
                     f"start {start}, cap {cap}")
  cap = cap - cap % grid
  points, compiled, stalls = dict(known or {}), 0, 0
  snap = lambda x: int(x) - int(x) % grid

  def probe(t: int):
    nonlocal compiled
    if t not in points:
      points[t] = int(peak_of(t))
      compiled += 1

  while True:
    lo, hi = bracket(points, budget)
    if hi is not None and hi - lo <= grid:
      return Search(lo, False, points, compiled)
    if hi is None and lo >= cap:
      return Search(cap, True, points, compiled)
    if not points:
      probe(min(start, cap))
      continue
    pred = predict(points, budget)
    if hi is None:
      t = snap(pred) if pred is not None and pred > lo else 2 * lo  # just past lo: its next grid step
      probe(min(max(t, lo + grid), cap))
      continue
    width = hi - lo
    if pred is None or stalls >= 2:
      t, stalls = snap((lo + hi) // 2), 0
    else:
      t = snap(pred)
    probe(min(max(t, lo + grid), hi - grid))
    new_lo, new_hi = bracket(points, budget)
    stalls = stalls + 1 if (new_hi - new_lo) * 2 > width else 0


class PointCache:
  """Compiled points on disk, one JSON object: "settings" (what the programs depend on beyond the key) and "points"
  {key: record}; written atomically after every new point. A file of other settings is moved aside before the first
  write, not overwritten (PATH less .json, then .<its settings' digest>.json); `upgrade` fills in settings fields
  added since a file was written."""

  def __init__(self, path: str, settings: dict, upgrade: Callable[[dict], dict] = lambda s: s):
    self.path, self.settings, self.points, self._other = path, settings, {}, None
    if os.path.exists(path):
      with open(path) as f:
        data = json.load(f)
      if upgrade(data.get("settings") or {}) == settings:
        self.points = data.get("points", {})
      else:
        self._other = hashlib.sha256(json.dumps(data.get("settings"), sort_keys=True).encode()).hexdigest()[:12]

  def get(self, key: str) -> dict | None:
    return self.points.get(key)

  def put(self, key: str, record: dict):
    if self._other and os.path.exists(self.path):
      os.replace(self.path, f"{self.path[:-5] if self.path.endswith('.json') else self.path}.{self._other}.json")
    self._other = None
    self.points[key] = record
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"settings": self.settings, "points": self.points}, f, indent=1, sort_keys=True)
    os.replace(tmp, self.path)

  def series(self, prefix: str, field: str) -> dict[int, int]:
    """{T: record[field]} of every cached point whose key is prefix + '|T=<T>'."""
    out = {}
    for key, rec in self.points.items():
      head, _, t = key.rpartition("|T=")
      if head == prefix:
        out[int(t)] = int(rec[field])
    return out
