"""The exposure benchmark's equal-violation comparison: each arm's plans swept over the risk budget delta (its
fitted byte allowances fixed, so no compile), each point's recompute removed (matmul FLOPs, deterministic), the cost
model's predicted removal and the violation rate of the realised error, and each arm read at one violation rate.
Nothing here is timed."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from hilore_jax import model
from hilore_jax.capacity import flops


def lowp_set(policies: Sequence[model.LayerPolicy], units) -> tuple[int, ...]:
  """Indices into units of a plan's L units (what its realised error depends on: R and H are exact)."""
  index = {tuple(u): i for i, u in enumerate(units)}
  return tuple(sorted(index[(layer, kind)] for layer, pol in enumerate(policies) for kind in pol.lowp))


class PlanFlops:
  """Matmul FLOPs of a plan's gradient program, per layer: a layer's recompute depends on its own policy alone (each
  runs under its own checkpoint), so a plan's count is No-GC's plus each layer's extra, each distinct layer policy
  traced once (as a whole model under it) rather than every plan."""

  def __init__(self, gradient: Callable, num_layers: int, params, batch):
    self._count = lambda pols: flops.program_flops(lambda q, b: gradient(q, b, pols), params, batch)
    self.L = num_layers
    self.none = self._count(model.uniform(num_layers, model.NO_REMAT))
    self._extra: dict = {}

  def extra(self, pol: model.LayerPolicy) -> float:
    if pol not in self._extra:
      self._extra[pol] = (self._count(model.uniform(self.L, pol)) - self.none) / self.L
    return self._extra[pol]

  def __call__(self, policies: Sequence[model.LayerPolicy]) -> float:
    return self.none + sum(self.extra(p) for p in policies)


def removed_pct(plan_flops: float, gc_flops: float, none_flops: float) -> float:
  """Share (%) of GC's extra matmul FLOPs over No-GC that a plan removes."""
  return 100 * (gc_flops - plan_flops) / max(gc_flops - none_flops, 1.0)


def sweep_arm(plan_at: Callable, buckets: Sequence[int], factors: Sequence[float], delta0: float,
              realised: Callable, plan_flops: PlanFlops, gc_flops: float, gc_s: float, tol: float, units) -> list:
  """One arm over delta = factor * delta0: per point the violation rate (realised error over tol), recompute
  removed (mean FLOPs over minibatches) and predicted removal (mean cost-model seconds against GC's). plan_at(bucket,
  delta) -> (plan, policies); realised(i, L set) -> minibatch i's error with that set L."""
  points = []
  for f in factors:
    errs, fl, secs = [], [], []
    for i, b in enumerate(buckets):
      plan, pols = plan_at(b, f * delta0)
      errs.append(realised(i, lowp_set(pols, units)))
      fl.append(plan_flops(pols))
      secs.append(float(plan.time_s))
    errs = np.asarray(errs)
    points.append({"factor": float(f), "delta": float(f * delta0), "violation_rate": float(np.mean(errs > tol)),
                   "err_mean": float(errs.mean()), "err_max": float(errs.max()),
                   "recompute_removed_pct": removed_pct(float(np.mean(fl)), gc_flops, plan_flops.none),
                   "predicted_removed_pct": 100 * (gc_s - float(np.mean(secs))) / max(gc_s, 1e-12),
                   # per minibatch, for a bootstrap over minibatches (experiments/exposure/e1.py)
                   "per_minibatch": {"err": errs.tolist(),
                                     "removed_pct": [removed_pct(x, gc_flops, plan_flops.none) for x in fl]}})
  return points


def at_violation(points: Sequence[dict], target: float = 0.05) -> dict:
  """An arm read at a violation rate: along increasing delta, linear interpolation between the last point at or
  under the target and the first over it (the first crossing). An arm whose sweep never crosses is undefined there
  (its figures nan, interpolated False), never read at its last point: that point is where memory stopped adding L,
  not where the risk budget did, and every arm's last point is the same plan (issue 47)."""
  pts = sorted(points, key=lambda p: p["delta"])
  keys = ("delta", "recompute_removed_pct", "predicted_removed_pct")
  for a, b in zip(pts, pts[1:]):
    if a["violation_rate"] <= target < b["violation_rate"]:
      t = (target - a["violation_rate"]) / (b["violation_rate"] - a["violation_rate"])
      return {"violation_target": target, **{k: a[k] + t * (b[k] - a[k]) for k in keys}, "violation_rate": target,
              "interpolated": True}
  return {"violation_target": target, **{k: float("nan") for k in keys}, "violation_rate": float("nan"),
          "interpolated": False}
