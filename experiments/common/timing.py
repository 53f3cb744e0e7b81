"""Interleaved timing rounds, repeated until every configuration's gain over the base is known to a set precision
(or a time cap), with the measures that may lower the noise recorded beside the times."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Callable, Sequence

import numpy as np

from hilore_jax import stats

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL")


@dataclasses.dataclass(frozen=True)
class Rounds:
  """How many interleaved rounds to run: at least min_rounds, then until every gain's CI half-width is at most
  halfwidth_pct points or time_cap_s have passed (timed rounds only); warm-up rounds first, untimed."""

  min_rounds: int
  halfwidth_pct: float
  time_cap_s: float
  warmup_rounds: int = 1
  pause_python_gc: bool = False


def halfwidths(times: Sequence[Sequence[float]], base: int, seed: int = 0, n: int = 2000) -> list[float]:
  """Half-width (points) of each configuration's paired gain CI over the base (the base itself: 0)."""
  out = []
  for i, t in enumerate(times):
    if i == base:
      out.append(0.0)
      continue
    lo, hi = stats.bootstrap_ci(stats.paired_gain_pct(t, times[base]), n=n, seed=seed)
    out.append(float("inf") if np.isnan(lo) else (hi - lo) / 2)
  return out


def measures(r: Rounds) -> dict:
  """What this run did (or inherited) that may change the noise: to compare floors between runs."""
  affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
  return {"warmup_rounds": r.warmup_rounds, "pause_python_gc": r.pause_python_gc, "cpu_affinity": affinity,
          "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ}}


def interleave(steps: Sequence[Callable], state, r: Rounds, base: int | None, seed: int = 0,
               clock: Callable[[], float] = time.perf_counter, progress=print):
  """(times [config][round] in seconds, the state, a summary): each round runs every step once, in a fresh random
  order, each step(state) -> state timed on its own (it must block until its results are ready); base: the index
  whose paired gains decide when to stop (None: min_rounds only)."""
  order = np.random.default_rng(seed)
  for _ in range(r.warmup_rounds):
    for i in order.permutation(len(steps)):
      state = steps[i](state)
  times: list[list[float]] = [[] for _ in steps]
  start, widest, stopped = clock(), float("inf"), "min_rounds"
  while True:
    if r.pause_python_gc:
      gc.collect()
      gc.disable()
    try:
      for i in order.permutation(len(steps)):
        t0 = clock()
        state = steps[i](state)
        times[i].append(clock() - t0)
    finally:
      if r.pause_python_gc:
        gc.enable()
    n = len(times[0])
    if base is not None and n >= 2:
      widest = max(halfwidths(times, base, seed))
    if n >= r.min_rounds:
      if base is None:
        break
      if widest <= r.halfwidth_pct:
        stopped = "ci" if n > r.min_rounds else "min_rounds"
        break
      if clock() - start >= r.time_cap_s:
        stopped = "time_cap"
        break
      if n % 10 == 0:
        progress(f"bench: round {n}: widest gain CI +/-{widest:.2f} points (target {r.halfwidth_pct:g})")
  summary = {"rounds": len(times[0]), "min_rounds": r.min_rounds, "ci_halfwidth_target_pct": r.halfwidth_pct,
             "max_halfwidth_pct": None if base is None else widest, "time_cap_s": r.time_cap_s,
             "elapsed_s": clock() - start, "stopped_by": stopped, "measures": measures(r)}
  return times, state, summary
