"""Before and beside a method's plans: full checkpointing while set-up has measured nothing, and the measured guard
that compares the plans' update time with full checkpointing's and keeps GC's program where the plans are no
faster. Measurements live in the manager's state (`ManagerState.timings`, `.guard`, `.warmup_steps`), so a resumed
or cached run judges as the first did."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax.memory.calibration import UpdateContext

log = logging.getLogger(__name__)

GC_METRICS = {"alloc/frac_H": 0.0, "alloc/frac_L": 0.0, "alloc/frac_R": 1.0, "alloc/frac_O": 0.0, "alloc/bucket": -1,
              "alloc/deferred": 0.0, "time/schedule_s": 0.0, "time/alloc_wait_s": 0.0, "time/plan_fit_s": 0.0}
# the first warm-up step compiles (and set-up follows it), the second times GC for the guard; a fixed count, so runs
# warm up alike wherever they run (only whether a step's time is clean depends on what had to compile)
WARMUP_STEPS = 2


def gc_metrics(guard: bool) -> dict:
  """The alloc/* metrics of a minibatch on full checkpointing: a warm-up's, or the guard's (the plans were slower)."""
  return {**GC_METRICS, "alloc/warmup": 0.0 if guard else 1.0, "alloc/guard_gc": 1.0 if guard else 0.0}


def plan_metrics(plan, bucket: int, st, greedy_gap: float, deferred: bool, times: dict) -> dict:
  """The alloc/* and memory/* metrics of a minibatch on a plan (deferred: GC's, while its bucket waits for its fit),
  with the allocation's times."""
  fr = plan.fractions()
  return {"alloc/frac_H": fr["frac_H"], "alloc/frac_L": fr["frac_L"], "alloc/frac_R": fr["frac_R"],
          "alloc/frac_O": fr["frac_O"], "alloc/bucket": bucket, "alloc/greedy_gap": greedy_gap,
          "alloc/predicted_err": float(plan.risk), "memory/budget_bytes": st.budget_bytes,
          "memory/predicted_bytes": st.gc_bytes + plan.bytes, "alloc/warmup": 0.0, "alloc/guard_gc": 0.0,
          "alloc/deferred": float(deferred), **times}


def verdict(gc_s: list[float], plan_s: list[float]) -> str:
  """"plan" where the plans' median seconds per minibatch is below GC's, "gc" where it is not, "" without both."""
  if not gc_s or not plan_s:
    return ""
  return "plan" if float(np.median(plan_s)) < float(np.median(gc_s)) else "gc"


class Guard:
  """What each step ran and how long its update took, judged once enough plan steps ran without a compile."""

  def __init__(self, verify_steps: int, method: str):
    self.verify_steps, self.method = verify_steps, method
    self.last: str | None = None  # what the last allocation ran: gc (warm-up), plan, guard (GC by verdict)
    self.warmup_steps = 0  # before the state exists (then state.warmup_steps)
    self.gc_times: list[float] = []  # likewise

  def sample_due(self, st) -> bool:
    """A trainer that warmed up on GC runs one more GC step after set-up, so the guard has GC's time (a caller that
    sets up and allocates itself never warms up)."""
    return 0 < st.warmup_steps < WARMUP_STEPS and self.verify_steps > 0

  def observe(self, st, seconds: float, clean: bool) -> bool:
    """File a step's update seconds per minibatch under what it ran (clean: no compile, no plan fit in it) and judge
    once verify_steps clean plan steps are in; st is None before set-up. True if the state changed."""
    kind, self.last = self.last, None
    if kind == "gc":
      if st is None:
        self.warmup_steps += 1
      else:
        st.warmup_steps += 1
    if not clean or kind not in ("gc", "plan"):
      return st is not None and kind == "gc"
    if st is None:
      self.gc_times.append(float(seconds))
      return False
    st.timings[kind].append(float(seconds))
    if not st.guard and self.verify_steps and len(st.timings["plan"]) >= self.verify_steps:
      st.guard = verdict(st.timings["gc"], st.timings["plan"][-self.verify_steps:])
      gc_s, plan_s = (float(np.median(st.timings[k])) if st.timings[k] else float("nan") for k in ("gc", "plan"))
      if st.guard == "gc":
        log.warning("memory (%s): its plans ran %.2fs per update minibatch against full checkpointing's %.2fs: no "
                    "faster, so this run (and the next from the cache) runs GC's program", self.method, plan_s, gc_s)
      elif st.guard == "plan":
        log.info("memory (%s): its plans run %.2fs per update minibatch against full checkpointing's %.2fs (%+.1f%%)",
                 self.method, plan_s, gc_s, 100 * (plan_s / gc_s - 1))
    return True

  def handover(self) -> tuple[dict, int]:
    """(timings, warm-up steps) measured before set-up, for the state set-up creates."""
    return {"gc": list(self.gc_times), "plan": []}, self.warmup_steps


class Collector:
  """Calibration minibatches gathered over the first rollouts while full checkpointing runs: every minibatch of each
  rollout, with the params (and optimizer state) that rollout's update left, until `rollouts` rollouts and `count`
  minibatches are in; then `count` of them, taken in turn from each rollout (memory.calib_batches from
  memory.calib_rollouts rollouts)."""

  def __init__(self, count: int, rollouts: int, keep_opt_state: bool = False):
    self.count, self.rollouts, self.keep_opt_state = count, min(rollouts, count), keep_opt_state
    self.by_rollout: list[tuple[list, list]] = []  # per rollout: (minibatches, their UpdateContexts)

  def add(self, params, minibatches: list, logp=None, opt_state=None, copy: bool = True):
    """A rollout's minibatches at the params (and optimizer state) its step left. The next step donates the
    trainer's state, so they are copied unless (copy False) they are measured before it runs."""
    if copy:
      params = jax.tree_util.tree_map(jnp.copy, params)
    keep = self.keep_opt_state and opt_state is not None
    opt_state = (jax.tree_util.tree_map(jnp.copy, opt_state) if copy else opt_state) if keep else None
    # no rollout contributes more than `count` (and each keeps its own params: the copies are what this costs)
    minibatches, logp = list(minibatches)[:self.count], ([None] * len(minibatches) if logp is None else logp)
    self.by_rollout.append((minibatches, [UpdateContext(params, opt_state, lp) for lp in logp[:self.count]]))

  def ready(self) -> bool:
    return self.ready_with(0, 0)

  def ready_with(self, minibatches: int, rollouts: int = 1) -> bool:
    """Whether the collector is ready once `rollouts` more rollouts of `minibatches` minibatches are in."""
    have = sum(len(b) for b, _ in self.by_rollout) + min(minibatches, self.count)
    return len(self.by_rollout) + rollouts >= self.rollouts and have >= self.count

  def take(self) -> tuple[list, list]:
    """(minibatches, contexts): up to `count`, in turn from each rollout (the first of each, then the second, ...);
    the collector is emptied."""
    batches, contexts = [], []
    depth = max((len(b) for b, _ in self.by_rollout), default=0)
    for i in range(depth):
      for b, c in self.by_rollout:
        if i < len(b) and len(batches) < self.count:
          batches.append(b[i])
          contexts.append(c[i])
    self.by_rollout = []
    return batches, contexts
