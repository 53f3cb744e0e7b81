"""A step's metrics row as the typed records of its parts: the rollout, the optimizer updates, the memory plans, the
tokens the update computed, and the run's compile, host and time figures. Each record names its keys once
(`metrics()`); the row is the step number and their union (`row`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from hilore_jax.errors import TrainingDiverged
from hilore_jax.loop import metrics


@dataclasses.dataclass(frozen=True)
class RolloutRecord:
  """What the step's rollout sampled: rewards, completion lengths, prompts cut to fit, and the data stream's position
  after it."""

  reward_mean: float
  reward_std: float
  completion_len_mean: float
  lengths: dict  # metrics.completion_lengths: p50, p90, max, the share cut at the cap
  prompts_truncated: int
  data_position: int

  @classmethod
  def of(cls, roll, data_position: int) -> RolloutRecord:
    return cls(float(roll.rewards.mean()), float(roll.rewards.std()), float(roll.mask.sum(1).mean()),
               metrics.completion_lengths(roll), roll.truncated_prompts, data_position)

  def metrics(self) -> dict:
    return {"reward/mean": self.reward_mean, "reward/std": self.reward_std,
            "completion_len/mean": self.completion_len_mean, **self.lengths,
            "prompts/truncated": self.prompts_truncated, "data/position": self.data_position}


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
  """The step's optimizer updates: each one's metrics (on the host), the learning rate the last one used, and the
  compiled peak of each update's step."""

  updates: list[dict]
  lr: float
  peaks: list[int]

  def check_finite(self, step: int):
    """TrainingDiverged where the step's mean loss or gradient norm is not finite."""
    m = metrics.reduce_updates(self.updates)
    if not all(np.isfinite(m[k]) for k in ("loss", "grad_norm")):
      raise TrainingDiverged(f"non-finite loss or gradient at step {step} (loss={m['loss']}, "
                             f"grad_norm={m['grad_norm']})")

  def metrics(self) -> dict:
    out = {"lr": self.lr, "updates": len(self.updates), **metrics.reduce_updates(self.updates)}
    if self.peaks:
      out["memory/compiled_bytes"] = max(self.peaks)
    out["memory/peak_bytes"] = self.peaks[-1] if self.peaks else 0
    return out


@dataclasses.dataclass(frozen=True)
class AllocationRecord:
  """The memory manager's allocations of the step's minibatches (alloc/*, memory/*, time/schedule_s per row)."""

  rows: list[dict]

  def metrics(self) -> dict:
    return metrics.reduce_allocations(self.rows)


@dataclasses.dataclass(frozen=True)
class TokenRecord:
  """The positions the update's gradient passes computed against the real tokens among them (tokens/*), and the
  padded share of what it held (budget/*: with the token budget on, its microbatches and the shapes compiled so
  far)."""

  computed: int
  real: int
  unshared: int
  passes: int
  padding_frac: float
  microbatches: int | None = None
  compiled_shapes: int | None = None
  packed_frac: float | None = None  # train.packing: the share of minibatches packed (the rest padded)

  @classmethod
  def of(cls, plan, passes: int, microbatches: int, packer=None) -> TokenRecord:
    """plan's (update_plan.UpdatePlan) over its passes; microbatches: a minibatch's without the token budget;
    packer: the token budget's programs (packed_step.PackedStepper) or None."""
    micro = shapes = None
    if packer is not None:
      micro = passes * sum(microbatches if m is None else len(m) for m in plan.grad)
      shapes = len(packer.shapes)
    return cls(*plan.tokens(), passes, plan.padding_frac(), micro, shapes,
               plan.packed_frac() if plan.packing else None)

  def metrics(self) -> dict:
    out = {**metrics.token_counts(self.computed, self.real, self.unshared, self.passes),
           "budget/padding_frac": self.padding_frac}
    if self.microbatches is not None:
      out.update({"budget/microbatches": self.microbatches, "budget/compiled_shapes": self.compiled_shapes})
    if self.packed_frac is not None:
      out["budget/packed_frac"] = self.packed_frac
    return out


@dataclasses.dataclass(frozen=True)
class RunRecord:
  """The run's figures at the step's end: the update's seconds and throughput (over the tokens without sharing or
  packing), compiles (the train step's, its probes, XLA's), host memory, and seconds since the process started."""

  update_s: float
  unshared_tokens: int
  compiles: dict
  host_memory: dict
  elapsed_s: float

  def metrics(self) -> dict:
    tok_s = self.unshared_tokens / self.update_s if self.update_s > 0 else 0.0
    return {"time/update_s": self.update_s, "throughput/update_tokens_per_s": tok_s, **self.compiles,
            **self.host_memory, "time/elapsed_s": self.elapsed_s}


def row(step: int, *records) -> dict:
  """The step's metrics row: its number and each record's metrics, in order (a dict: the memory manager's seconds
  after the previous step)."""
  out = {"step": step}
  for r in records:
    out.update(r if isinstance(r, dict) else r.metrics())
  return out
