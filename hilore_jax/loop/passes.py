"""A rollout's update run on the train state: every pass (grpo.num_iterations) over the plan's minibatches, each
minibatch's compiled step under the memory manager's allocation. A function of the state that returns the new one
with a typed record of what ran."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from hilore_jax.config import Config
from hilore_jax.loop import update_plan
from hilore_jax.memory import methods
from hilore_jax.rl import train_step
from hilore_jax.rl.train_state import TrainState


class MemoryWork(NamedTuple):
  """What the memory manager planned the step for (the minibatches, or with the token budget their microbatches, and
  the current log-probs where known): its work after the step reads them."""

  batches: list
  logp: list | None


@dataclasses.dataclass(frozen=True)
class Passes:
  """What the update ran: each optimizer update's metrics (on the devices), each one's compiled peak, the memory
  manager's allocation rows, and its work after the step (None without a planned memory method)."""

  updates: list[dict]
  peaks: list[int]
  alloc_rows: list[dict]
  memory_work: MemoryWork | None


def run(c: Config, state: TrainState, plan: update_plan.UpdatePlan, step: int, spec: train_step.StepSpec, stepper,
        packer, memory: Any = None) -> tuple[TrainState, Passes]:
  """(the state after the plan's updates, what ran): stepper (engine.Stepper) runs unpacked minibatches, packer
  (packed_step.PackedStepper) those with microbatches; memory (a MemoryManager or ShapedMemory) allocates."""
  specs, plans = [spec] * len(plan), plan.grad
  alloc_rows, allocations, work = [], None, None
  if memory is not None and len(plan):
    # what the memory manager plans for: the minibatches, or with the token budget their microbatches
    work = MemoryWork(*plan.memory_batches(plan.batches, list(plan.current)))
    allocations = memory.step(state.params, work.batches, step, work.logp, state.opt_state)
  # hilore reallocates every later pass: its minibatches are off-policy, and the previous pass's log-probs (an
  # output of that pass's step, no extra forward) tell the exposure which tokens now clip
  per_pass = methods.REGISTRY[c.memory.policy].exposure
  updates, peaks, token_logp = [], [], []
  for it in range(c.grpo.num_iterations):
    batches = plan.pass_batches(it, spec.use_old_logp)
    if allocations is not None:
      if it > 0 and per_pass:
        allocations = memory.allocate(*plan.memory_batches(batches, token_logp))
      specs = [dataclasses.replace(spec, policies=a.policies) for a in allocations]
      if any(m is not None for m in plans):  # one spec per microbatch, by minibatch (one for one run whole)
        ends = np.cumsum([1 if m is None else len(m) for m in plans])
        specs = [specs[e - 1] if m is None else specs[e - len(m):e] for e, m in zip(ends, plans)]
      alloc_rows += [a.metrics for a in allocations]
    token_logp = []
    for s, b, micros in zip(specs, batches, plans):
      if micros is None:
        compiled = stepper.get(s, b, reason=f"memory.policy={c.memory.policy}")
        state, m = compiled(state, b)
        peaks.append(compiled.peak_bytes)
      else:
        state, m, peak = packer.step(s, state, b, micros)
        peaks.append(peak)
      token_logp.append(m.pop(train_step.TOKEN_LOGP))
      updates.append(m)
  return state, Passes(updates, peaks, alloc_rows, work)
