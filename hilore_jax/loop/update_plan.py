"""A rollout's update as one typed value: its minibatches (placed), what the host knows of each (completion and
prompt lengths), and the token budget's microbatches for the gradient and the log-prob passes. Built once per
rollout (`build`), read by every pass: no per-minibatch state hides in the trainer."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax.config import Config
from hilore_jax.rl import prompt_share, token_budget, update_batch
from hilore_jax.rl.update_batch import UpdateBatch

Micros = list[token_budget.Micro] | None  # a minibatch's microbatches under one budget; None: that budget is off
_gather = jax.jit(token_budget.gather, static_argnums=2)  # a microbatch of a placed minibatch (the memory manager's)
_columns = jax.jit(lambda x, rows, cap: x[rows, :cap], static_argnums=2)


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """Per minibatch i: batches[i] (on the mesh), lengths[i] and prompt_lengths[i] ([B] host ints), grad[i] and
  logp[i] (its microbatches, or None); current[i]: the current policy's log-probs where a forward computed them."""

  batches: tuple[UpdateBatch, ...]
  stats: dict
  lengths: tuple[np.ndarray, ...]
  prompt_lengths: tuple[np.ndarray, ...]
  grad: tuple[Micros, ...]
  logp: tuple[Micros, ...]
  current: tuple = ()

  @classmethod
  def of(cls, batches, stats: dict | None = None) -> UpdatePlan:
    """A plan of given minibatches without the token budget."""
    lengths = tuple(np.asarray(b.mask).sum(1) for b in batches)
    none = (None,) * len(batches)
    return cls(tuple(batches), stats or {}, lengths, tuple(np.asarray(b.prompt_mask).sum(1) for b in batches), none,
               none)

  def __len__(self) -> int:
    return len(self.batches)

  def replace(self, **kw) -> UpdatePlan:
    return dataclasses.replace(self, **kw)

  def pass_batches(self, it: int, off_policy: bool) -> list[UpdateBatch]:
    """The minibatches of pass `it`: on a later pass of an off-policy step the first minibatch is off-policy too."""
    if not (off_policy and it > 0 and self.batches):
      return list(self.batches)
    first = self.batches[0]
    return [first.replace(on_policy=jnp.zeros_like(first.on_policy)), *self.batches[1:]]

  def memory_batches(self, batches, logp=None) -> tuple[list, list | None]:
    """(batches, logp), or with the token budget their microbatches, gathered on the devices, and logp's slices of
    them: what the memory manager plans for (loop/shaped_memory.py: one manager per microbatch shape)."""
    if not self.grad or self.grad[0] is None:
      return list(batches), logp
    micro = [_gather(b, m.arrays(), m.cap) for b, p in zip(batches, self.grad) for m in p]
    if logp is not None:
      logp = [None if x is None else _columns(x, m.rows, m.cap) for x, p in zip(logp, self.grad) for m in p]
    return micro, logp

  def tokens(self) -> tuple[int, int]:
    """(positions one gradient pass computes, rows x (P + N) without packing or sharing)."""
    return token_budget.step_tokens(list(self.batches), list(self.grad))

  def padding_frac(self) -> float:
    """Padded positions / the positions one gradient pass holds (rows x (P + cap), before sharing)."""
    real = sum(float(np.sum((n + p) * (n > 0))) for n, p in zip(self.lengths, self.prompt_lengths))
    held = sum(b.rows * (b.prompt_len + b.completion_len) if m is None else token_budget.positions(m, b.prompt_len)
               for b, m in zip(self.batches, self.grad))
    return 1.0 - real / held if held else 0.0


def microbatches(c: Config, key: str, lengths, prompt_keys, n_shards: int) -> Micros:
  """A minibatch's microbatches under train.<key> (its rows' completion lengths; prompt_keys: each row's prompt,
  or None without a shared prompt); None where that budget is off."""
  budget = getattr(c.train, key)
  if not budget:
    return None
  caps = token_budget.bucket_caps(c.rollout.max_new_tokens, c.train.length_buckets)
  micros = token_budget.plan(lengths, c.rollout.max_prompt_len, caps, budget, c.minibatch_size, n_shards)
  if prompt_keys is not None:
    micros = token_budget.share(micros, prompt_keys, prompt_share.max_distinct(c))
  return micros


def build(c: Config, roll, rng: np.random.Generator, replay_buffer, step: int, use_old_logp: bool,
          split: int, n_shards: int, place: Callable) -> UpdatePlan:
  """The rollout's update: minibatches built on the host (rl/update_batch.py), with a shared prompt's tables
  (split: the spec's microbatch slices) and the token budget's microbatches, each placed in one transfer."""
  batches, stats = update_batch.minibatches(c, roll, rng, replay_buffer, step, use_old_logp)
  lengths = tuple(b.mask.sum(1) for b in batches)
  keys = [prompt_share.prompt_keys(b) if c.train.share_prompt else None for b in batches]
  if c.train.share_prompt:
    batches = prompt_share.share_all(batches, split, prompt_share.max_distinct(c))
  plans = {k: tuple(microbatches(c, k, n, p, n_shards) for n, p in zip(lengths, keys))
           for k in ("max_tokens_per_microbatch", "max_tokens_per_logprob_pass")}
  return UpdatePlan(tuple(place(b) for b in batches), stats, lengths, tuple(b.prompt_mask.sum(1) for b in batches),
                    plans["max_tokens_per_microbatch"], plans["max_tokens_per_logprob_pass"])
