"""A rollout's update as one typed value: its minibatches (placed), what the host knows of each (completion and
prompt lengths, prompts), and the token budget's microbatches for the gradient and the log-prob passes (length
buckets, or with `train.packing` buffers of rows end to end). Built once per rollout (`build`), read by every pass:
no per-minibatch state hides in the trainer."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax.config import Config
from hilore_jax.rl import packing, prompt_share, token_budget, update_batch
from hilore_jax.rl.update_batch import UpdateBatch

# a minibatch's microbatches under one budget (length buckets' Micro or packed Buffer); None: that budget is off
Micros = list[token_budget.Micro] | list[packing.Buffer] | None
# a microbatch of a placed minibatch and its slice of a [B, N] array (the memory manager's)
_gather = jax.jit(lambda b, idx, layout: layout.gather(b, idx), static_argnums=2)
_values = jax.jit(lambda x, idx, layout: layout.values(x, idx), static_argnums=2)


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """Per minibatch i: batches[i] (on the mesh), lengths[i] and prompt_lengths[i] ([B] host ints), grad[i] and
  logp[i] (its microbatches, or None); current[i]: the current policy's log-probs where a forward computed them;
  prompt_keys[i] ([B] host ids, equal for equal prompts) and split (its tables' slices) where prompts are shared;
  packing: train.packing (each minibatch packed or, where that saves too little, padded: see microbatches)."""

  batches: tuple[UpdateBatch, ...]
  stats: dict
  lengths: tuple[np.ndarray, ...]
  prompt_lengths: tuple[np.ndarray, ...]
  grad: tuple[Micros, ...]
  logp: tuple[Micros, ...]
  current: tuple = ()
  prompt_keys: tuple = ()
  split: int = 1
  packing: bool = False

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
    if all(p is None for p in self.grad):
      return list(batches), logp
    # a minibatch without microbatches (packing fell back to it unbudgeted) is planned as itself
    micro = [x for b, p in zip(batches, self.grad) for x in ([b] if p is None else
                                                             [_gather(b, m.arrays(), m.layout) for m in p])]
    if logp is not None:
      logp = [y for x, p in zip(logp, self.grad) for y in ([x] if p is None else
                                                           [None if x is None else _values(x, m.arrays(), m.layout)
                                                            for m in p])]
    return micro, logp

  def tokens(self) -> tuple[int, int, int]:
    """(positions one gradient pass computes, those of them that hold a real token, rows x (P + N) without packing
    or sharing): tokens/computed, tokens/real and tokens/unshared per pass."""
    computed, unshared = token_budget.step_tokens(list(self.batches), list(self.grad))
    keys = self.prompt_keys or (None,) * len(self)
    real = sum(_real(b, m, n, p, k, self.split)
               for b, m, n, p, k in zip(self.batches, self.grad, self.lengths, self.prompt_lengths, keys))
    return computed, real, unshared

  def padding_frac(self) -> float:
    """Padded positions / the positions one gradient pass holds (rows x (P + cap), before sharing; packed: of the
    positions it computes, 1 - tokens/fill)."""
    if self.packing:
      computed, real, _ = self.tokens()
      return 1.0 - real / computed if computed else 0.0
    real = sum(float(np.sum((n + p) * (n > 0))) for n, p in zip(self.lengths, self.prompt_lengths))
    held = sum(b.rows * (b.prompt_len + b.completion_len) if m is None else token_budget.positions(m, b.prompt_len)
               for b, m in zip(self.batches, self.grad))
    return 1.0 - real / held if held else 0.0

  def packed_frac(self) -> float:
    """The share of a gradient pass's minibatches that run packed buffers (the rest: length buckets, or unbudgeted)."""
    return sum(_packed(m) for m in self.grad) / len(self) if len(self) else 0.0


def _packed(micros: Micros) -> bool:
  """Whether a minibatch's microbatches are packed buffers."""
  return bool(micros) and isinstance(micros[0], packing.Buffer)


def _real(batch: UpdateBatch, micros: Micros, n_B, p_B, keys_B, split: int) -> int:
  """Positions of a minibatch's gradient pass that hold a real token: each live row's completion, and its prompt
  once per row or, where a table holds it, once per table (slice, microbatch or buffer) that computes it."""
  if _packed(micros):
    return packing.real_positions(micros, p_B)
  prompts = lambda rows, shared: int(p_B[rows].sum() if not shared else
                                     p_B[rows[np.unique(keys_B[rows], return_index=True)[1]]].sum())
  live = n_B > 0
  if micros is None:
    m = len(n_B) // split
    return int(n_B.sum()) + sum(prompts(np.flatnonzero(live[j * m:(j + 1) * m]) + j * m, prompt_share.shared(batch))
                                for j in range(split))
  return int(n_B.sum()) + sum(prompts(m.rows[m.live > 0], m.table is not None) for m in micros)


def microbatches(c: Config, key: str, batch: UpdateBatch, prompt_keys, n_shards: int) -> Micros:
  """A minibatch's microbatches under train.<key> (batch: its host rows; prompt_keys: each row's prompt, or None
  without a shared prompt): length buckets, or with train.packing packed buffers where they save
  train.packing_min_saving of the positions of the length buckets under the buffers' own count (a shared prompt's
  rows: completions only, as a buffer holds them); None where that budget is off, or packing falls back to every
  row at the cap (the minibatch unbudgeted)."""
  budget = getattr(c.train, key)
  if not budget:
    return None
  P, distinct = c.rollout.max_prompt_len, prompt_share.max_distinct(c)
  caps = token_budget.bucket_caps(c.rollout.max_new_tokens, c.train.length_buckets)
  # a packed budget counts a buffer's positions: the padded rows it falls back to count theirs the same way, so
  # neither holds more than the longest buffer (and its table) does
  row_prompt = 0 if c.train.packing and prompt_keys is not None else P
  micros = token_budget.plan(batch.mask.sum(1), row_prompt, caps, budget, c.minibatch_size, n_shards)
  if prompt_keys is not None:
    micros = token_budget.share(micros, prompt_keys, distinct)
  if not c.train.packing:
    return micros
  buffers = packing.plan(batch.mask, batch.prompt_mask, packing.sizes(budget // n_shards, c.train.length_buckets,
                                                                    c.train.packing_granule),
                         n_shards, prompt_keys, distinct, f"train.{key}")
  chosen = packing.choose(buffers, micros, P, c.train.packing_min_saving)
  # every row at the cap in one microbatch is the minibatch itself: the step without a budget runs it, with no
  # gather or gradient accumulator
  whole = chosen is micros and len(micros) == 1 and micros[0].shape == (batch.rows, batch.completion_len)
  return None if whole and micros[0].live.all() else chosen


def build(c: Config, roll, rng: np.random.Generator, replay_buffer, step: int, use_old_logp: bool,
          split: int, n_shards: int, place: Callable) -> UpdatePlan:
  """The rollout's update: minibatches built on the host (rl/update_batch.py), with a shared prompt's tables
  (split: the spec's microbatch slices) and the token budget's microbatches, each placed in one transfer."""
  batches, stats = update_batch.minibatches(c, roll, rng, replay_buffer, step, use_old_logp)
  lengths = tuple(b.mask.sum(1) for b in batches)
  keys = [prompt_share.prompt_keys(b) if c.train.share_prompt else None for b in batches]
  if c.train.share_prompt:
    batches = prompt_share.share_all(batches, split, prompt_share.max_distinct(c, c.minibatch_size // split))
  plans = {k: tuple(microbatches(c, k, b, p, n_shards) for b, p in zip(batches, keys))
           for k in ("max_tokens_per_microbatch", "max_tokens_per_logprob_pass")}
  return UpdatePlan(tuple(place(b) for b in batches), stats, lengths, tuple(b.prompt_mask.sum(1) for b in batches),
                    plans["max_tokens_per_microbatch"], plans["max_tokens_per_logprob_pass"],
                    prompt_keys=tuple(keys) if c.train.share_prompt else (), split=split,
                    packing=c.train.packing)


def with_logprobs(c: Config, plan: UpdatePlan, params, logprobs: Callable, reference: Callable | None) -> UpdatePlan:
  """The plan with ref_logp (reference(batch, micros), where the loss has a KL term) and old_logp filled in on the
  devices (logprobs(params, batch, micros)), and `current`: the current policy's log-probs of each minibatch where a
  forward computed them, else None. old_logp comes from the policy that sampled, which is the current one: every
  fresh row an update sees after the rollout's first update needs it; replayed rows keep the behaviour log-probs
  stored with them (their current log-probs are the exposure's ratio numerator)."""
  later = c.grpo.num_iterations > 1
  sampled = c.grpo.old_logp == "sampler"  # fresh rows carry the sampler's: no forward for them
  out, current = [], []
  for i, (b, micros) in enumerate(zip(plan.batches, plan.logp)):
    if reference is not None:
      b = b.replace(ref_logp=reference(b, micros))
    logp = None
    if update_batch.needs_old_forward(b, i, later) and not (sampled and b.replayed is None):
      logp = logprobs(params, b, micros)
      if b.replayed is not None:  # replayed rows keep their stored behaviour log-probs
        b = b.replace(old_logp=jnp.where(b.replayed[:, None] > 0, b.old_logp, logp))
      else:  # every row: a later pass reads the on-policy rows' too
        b = b.replace(old_logp=logp)
    out.append(b)
    current.append(logp if b.replayed is not None else None)
  return plan.replace(batches=tuple(out), current=tuple(current))
