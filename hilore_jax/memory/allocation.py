"""Allocation rows: each minibatch's bucket, plan and per-layer policies with its alloc/* and memory/* metrics, from
the planner's state (planner.py), fitting a new bucket first (fitting.py) or deferring its fit past the step; and
full checkpointing's rows for the steps that run no plan."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax

from hilore_jax import model
from hilore_jax.memory import fitting, methods, planner, warmup
from hilore_jax.memory.planner import Planner, PlannerState


@dataclasses.dataclass(frozen=True)
class Allocation:
  """A minibatch's decision: its bucket, plan and per-layer policies, and the alloc/memory metrics."""

  bucket: int
  plan: methods.Plan
  policies: tuple[model.LayerPolicy, ...]
  metrics: dict
  active_constraint: str = "none"  # which budget binds the plan: memory | risk | both | none


def gc_rows(num_layers: int, n: int, step_metrics: dict, guard: bool = False) -> list[Allocation]:
  """Full checkpointing for n minibatches: before set-up, while GC's own time is measured, or (guard) where the
  plans were measured no faster than GC (memory/warmup.py)."""
  policies, metrics = model.uniform(num_layers, model.FULL_REMAT), warmup.gc_metrics(guard)
  return [Allocation(-1, methods.Plan((), (), 0, 0.0, 0.0), policies, {**metrics, **step_metrics}) for _ in range(n)]


@dataclasses.dataclass(frozen=True)
class Rows:
  """What plan_rows returns: the new state, the rows, the buckets it deferred (bucket -> a minibatch to fit it on),
  and whether it fitted any (the state to persist)."""

  ps: PlannerState
  allocations: list[Allocation]
  deferred: dict
  fitted: bool


def plan_rows(pl: Planner, ps: PlannerState, minibatches: list, scores: Callable[[], object], logp, defer: bool,
              step_metrics: dict) -> Rows:
  """Each minibatch's bucket and plan (scores(): the minibatches' [M, U] unit scores, asked only where exposure is
  on); a bucket not fitted yet is fitted now, or (defer) after the step: its minibatch runs GC's program meanwhile
  (compiled already, within every budget)."""
  t0 = time.perf_counter()
  ps = planner.at_shape(pl, ps, minibatches[0])
  keys, wait_s = [()] * len(minibatches), 0.0
  if planner.exposure_on(pl, ps.saved):  # exposure off (one bucket, or the gate off): nothing to score
    # the scores read log-probs the device may still be computing (the old-log-prob forwards, the previous
    # pass): that wait is the device at work, not scheduling, so it is timed apart
    jax.block_until_ready((minibatches, logp))
    wait_s = time.perf_counter() - t0
    keys = planner.bucket_levels(pl, ps.saved, scores())
  fit_s, chosen, deferred, fitted = 0.0, [], {}, False
  for batch, key in zip(minibatches, keys):
    bucket = 0
    if pl.record.exposure:
      ps, bucket = planner.bucket_for(pl, ps, key)
    if bucket not in ps.saved.verified and pl.record.fixed is not model.NO_REMAT:
      if defer:
        deferred.setdefault(bucket, batch)
        chosen.append((bucket, None))
        continue
      t1 = time.perf_counter()
      ps, fitted = fitting.fit(pl, ps, bucket, batch), True
      fit_s += time.perf_counter() - t1
    ps, plan = planner.bucket_plan(pl, ps, bucket)
    chosen.append((bucket, plan))
  n = len(minibatches)
  times = {"time/schedule_s": (time.perf_counter() - t0 - fit_s - wait_s) / n, "time/alloc_wait_s": wait_s / n,
           "time/plan_fit_s": fit_s / n}
  out = []
  for bucket, plan in chosen:
    deferred_row = plan is None
    plan = planner.gc_plan(pl, ps) if deferred_row else plan
    metrics = warmup.plan_metrics(plan, bucket, ps.saved, ps.gaps.get(bucket, 0.0), deferred_row, times)
    policies = model.uniform(pl.num_layers, model.FULL_REMAT) if deferred_row else planner.policies(pl, ps, plan)
    out.append(Allocation(bucket, plan, policies, {**metrics, **step_metrics},
                          "none" if deferred_row else ps.active.get(bucket, "none")))
  return Rows(ps, out, deferred, fitted)
