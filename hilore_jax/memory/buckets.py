"""Exposure buckets: a few quantised exposure levels, one cached allocation each, so the train step recompiles
only when the bucket (and with it the allocation) changes."""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Bucketer:
  """Bucket b covers exposure levels in (edges[b-1], edges[b]]; the last bucket is open-ended."""

  edges: tuple[float, ...]

  @classmethod
  def around(cls, level: float, num_buckets: int) -> "Bucketer":
    """Geometric edges a factor sqrt(2) apart, centred on the calibration level (one bucket if level is 0)."""
    if level <= 0:
      return cls(())
    return cls(tuple(level * 2.0 ** ((k - num_buckets // 2) / 2) for k in range(1, num_buckets)))

  @property
  def num_buckets(self) -> int:
    return len(self.edges) + 1

  def bucket(self, level: float) -> int:
    return bisect.bisect_left(self.edges, level)

  def upper(self, bucket: int, observed_max: float) -> float:
    """The level an allocation for this bucket must tolerate (its upper edge; the run's max for the last)."""
    return self.edges[bucket] if bucket < len(self.edges) else max(observed_max, self.edges[-1] if self.edges else 0)


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

  def invalidate(self, reason: str):
    """Drop cached allocations (after a calibration refresh or a restore)."""
    log.info("allocation cache cleared: %s", reason)
    self._cache.clear()
