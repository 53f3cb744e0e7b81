"""Exposure buckets: each unit's run-time exposure quantised to a few levels; a minibatch's bucket is its vector of
unit levels, with one cached allocation each, so the train step recompiles only when the plan changes."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


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


def bucket_for(st, levels: Sequence[int], time_of: Callable[[int], float]) -> int:
  """The bucket (an index into st.buckets) of a minibatch with these unit levels: its own if known; else the fastest
  (time_of) fitted bucket whose levels are at least these in every unit (its plan's L set stays within the risk
  budget here too, so no new plan and no compile); else len(st.buckets), a new one for the caller to append. Fewer
  plans than exact levels, at the price of some minibatches running a more cautious plan than their own."""
  key = list(levels)
  if key in st.buckets:
    return st.buckets.index(key)
  # a minibatch with no exposure at all (no updated token) gets its own bucket: every unit may be L there
  unexposed = all(k == ZERO for k in key)
  cover = [b for b in st.verified if b < len(st.buckets) and len(st.buckets[b]) == len(key) and key
           and not unexposed and all(x >= y for x, y in zip(st.buckets[b], key))]
  if cover:
    return min(cover, key=lambda b: (time_of(b), b))
  return len(st.buckets)


def bucket_risk(cal, levels: Sequence[int]) -> np.ndarray:
  """[U] predicted error per unit (coherence included) a bucket's allocation must tolerate: its levels' upper edges;
  the exposure-off bucket (no levels) takes each unit's calibrated error (its calib_quantile over calibration
  minibatches; an older calibration: its largest calibration score)."""
  risk = level_risk(levels, cal.predicted_error) if levels else np.asarray(
      cal.static_risk or cal.score_max or cal.predicted_error)  # a given calibration may carry neither
  return cal.coherence * risk
