"""Exposure buckets: each unit's run-time exposure quantised to a few levels; a minibatch's bucket is its vector of
unit levels, with one cached allocation each, so the train step recompiles only when the plan changes."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)


ZERO = -(10**6)  # the level of a unit with no exposure at all (no updated token): risk exactly 0


def unit_levels(scores_U, ref_U, max_levels: int) -> tuple[int, ...]:
  """Each unit's exposure level on a grid a factor sqrt(2) apart around its calibration score: level k covers
  scores in (ref * 2^((k-1)/2), ref * 2^(k/2)]. Levels below -max_levels are raised to it (a coarser grid, never
  an understated risk); a zero score (or a unit that carries no risk) is ZERO."""
  scores, ref = np.asarray(scores_U, float), np.asarray(ref_U, float)
  pos = (scores > 0) & (ref > 0)
  ratio = np.where(pos, scores / np.where(ref > 0, ref, 1.0), 1.0)
  k = np.maximum(np.ceil(2 * np.log2(ratio) - 1e-9), -max_levels)
  return tuple(int(x) if p else ZERO for x, p in zip(k, pos))


def level_risk(levels: Sequence[int], ref_U) -> np.ndarray:
  """[U] the risk a bucket's allocation must tolerate: each unit's level's upper edge."""
  lv = np.asarray(levels, float)
  return np.where(lv == ZERO, 0.0, np.asarray(ref_U, float) * 2.0 ** (lv / 2))


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

  def invalidate(self, reason: str, bucket: int | None = None):
    """Drop one bucket's cached allocation (its allowance was fitted), or all (a calibration refresh, a restore)."""
    log.info("allocation cache cleared%s: %s", "" if bucket is None else f" for bucket {bucket}", reason)
    if bucket is None:
      self._cache.clear()
    else:
      self._cache.pop(bucket, None)
