"""Exposure buckets: a few quantised exposure levels, one cached allocation each, so the train step
recompiles only when the bucket (and with it the allocation) changes."""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Bucketer:
  """Bucket b covers exposure levels in (edges[b-1], edges[b]]; the last bucket is open-ended."""

  edges: tuple[float, ...]

  @property
  def num_buckets(self) -> int:
    return len(self.edges) + 1

  def bucket(self, level: float) -> int:
    return bisect.bisect_left(self.edges, level)

  def upper(self, bucket: int, observed_max: float) -> float:
    """The level an allocation for this bucket must tolerate (its upper edge; the run's max for the last)."""
    return self.edges[bucket] if bucket < len(self.edges) else max(observed_max, self.edges[-1] if self.edges else 0)


def make_bucketer(levels: Sequence[float], num_buckets: int) -> Bucketer:
  """Edges at quantiles of exposure levels seen on calibration batches."""
  if num_buckets < 1:
    raise ValueError(f"memory.buckets must be >= 1, got {num_buckets}")
  levels = np.asarray(levels, float)
  qs = np.quantile(levels, np.linspace(0, 1, num_buckets + 1)[1:-1]) if len(levels) else []
  return Bucketer(tuple(sorted(set(float(q) for q in qs))))


class AllocationCache:
  """One allocation per bucket, solved on first use; every solve is counted and logged with its reason."""

  def __init__(self, solve: Callable[[int], object]):
    self._solve = solve
    self._cache: dict[int, object] = {}
    self.solves: list[tuple[int, str]] = []

  def get(self, bucket: int):
    if bucket not in self._cache:
      reason = "first use of bucket" if self._cache else "first allocation"
      self._cache[bucket] = self._solve(bucket)
      self.solves.append((bucket, reason))
      log.info("allocation for exposure bucket %d solved (%s)", bucket, reason)
    return self._cache[bucket]

  def put(self, bucket: int, allocation):
    """Replace a bucket's allocation (e.g. a verified fallback)."""
    self._cache[bucket] = allocation

  def invalidate(self, reason: str):
    """Drop cached allocations (after a calibration refresh)."""
    log.info("allocation cache cleared: %s", reason)
    self._cache.clear()

  def state(self) -> dict:
    return {str(b): a for b, a in self._cache.items()}


def enable_persistent_compilation_cache(directory: str):
  """JAX's on-disk compilation cache, so a restarted run reuses compiled steps."""
  import jax

  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
