"""One step's update rows on the host, as typed minibatches: advantages, zero-std filtering, fresh-anchored replay,
shuffled fixed-size minibatches (a short last one padded with masked rows): whole groups shuffled (`train.shuffle:
group`, so a minibatch's prompt table serves G rows), or rows.

`UpdateBatch` is the one type the gradient program, the log-prob forward and the memory manager read. It is built
completely on the host (numpy) and placed on the devices with one `device_put` per minibatch; only what needs the
policy (the old and reference log-probs) is filled in on the devices afterwards. Which optional fields are present
is part of its pytree structure, so it is part of the compile key: `signature()` says what a compilation saw.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from hilore_jax.rl import grpo, replay
from hilore_jax.rl.config import SHUFFLES
from hilore_jax.rl.rollout import Rollout

Array = Any  # numpy on the host, jax.Array once placed
SEQUENCE_FIELDS = ("prompt_ids", "prompt_mask", "tokens", "mask")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packing:
  """A packed microbatch (rl/packing.py): S buffer rows of L positions holding some of the minibatch's rows end to
  end, each position's source. The buffer's rows are the batch's rows with a completion token in it."""

  row: Array  # [S, L] int32: the batch row a position holds (B, past the end, on padding)
  column: Array  # [S, L] int32: its column in the row's prompt + completion [P + N] (0 on padding)
  segment: Array  # [S, L] int32: its row's ordinal in the buffer row, from 1 (0 on padding)
  position: Array  # [S, L] int32: its RoPE position, the row's real tokens before it (restarts at each row)

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.row.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UpdateBatch:
  """B update rows: prompt + completion and what the GRPO loss needs; a field is None when the run never reads it."""

  prompt_ids: Array  # [B, P] int32, left-padded
  prompt_mask: Array  # [B, P] int32
  tokens: Array  # [B, N] int32 completions, right-padded
  mask: Array  # [B, N] int32: 1 on completion tokens that count (a padding row is all 0)
  adv: Array | None = None  # [B] float32 advantages
  # [B, N] float32: the ratio's denominator (behaviour log-probs). On the host: the stored ones of replayed rows and
  # NaN on fresh rows (0 where on_policy makes it unread), filled in on the devices (`UpdateBatch.with_old_logp`)
  old_logp: Array | None = None
  on_policy: Array | None = None  # [B] int32: rows whose denominator is stop_gradient(logp) (old_logp unread)
  replayed: Array | None = None  # [B] int32: rows from the replay buffer (their old_logp is stored)
  ref_logp: Array | None = None  # [B, N] float32: the reference policy's log-probs (KL), filled on the devices
  # a shared prompt (rl/prompt_share.py): each microbatch's distinct prompts [microbatches * U, P] (replicated on
  # the mesh) and each row's index into its own microbatch's U; prompt_ids/prompt_mask stay per row
  prompt_table: Array | None = None
  prompt_table_mask: Array | None = None
  prompt_index: Array | None = None  # [B] int32
  # a packed microbatch of this minibatch (rl/packing.py): its rows (mask and adv zero on the others) end to end in
  # buffer rows; with a prompt table, the buffer holds completions only and the table is the buffer's own
  packing: Packing | None = None

  @property
  def rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def prompt_len(self) -> int:
    return self.prompt_ids.shape[1]

  @property
  def completion_len(self) -> int:
    return self.tokens.shape[1]

  def sequences(self) -> UpdateBatch:
    """Only the token fields and a prompt table (what a log-prob forward reads: one compilation whatever else the
    batch carries)."""
    return UpdateBatch(self.prompt_ids, self.prompt_mask, self.tokens, self.mask, prompt_table=self.prompt_table,
                       prompt_table_mask=self.prompt_table_mask, prompt_index=self.prompt_index, packing=self.packing)

  def split(self, n: int) -> UpdateBatch:
    """Every field reshaped [n, B / n, ...]: n row slices (microbatches) for a scan or map."""
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), self)

  def signature(self) -> tuple:
    """(field, shape, dtype) of every present field (`packing.row` etc. for a packing's): what a compiled program
    depends on."""
    leaves = jax.tree_util.tree_flatten_with_path(self)[0]
    name = lambda path: ".".join(getattr(k, "name", str(k)) for k in path)
    return tuple((name(path), tuple(x.shape), str(x.dtype)) for path, x in leaves)

  def replace(self, **kw) -> UpdateBatch:
    return dataclasses.replace(self, **kw)


def updates_per_step(c) -> int:
  """Optimizer updates of a step at most: every fresh row plus the most rows replay can append, per iteration."""
  B = c.rollout.num_prompts * c.rollout.num_generations
  rows = B + replay.max_replay_rows(c.replay, B)
  return c.grpo.num_iterations * -(-rows // c.minibatch_size)


def minibatches(c, roll: Rollout, rng: np.random.Generator, buffer: replay.ReplayBuffer | None = None, step: int = 0,
                use_old_logp: bool = False) -> tuple[list[UpdateBatch], dict]:
  """Host minibatches of every kept fresh row and (with a buffer) the replayed rows, and the step's stats.

  With use_old_logp each minibatch carries old_logp and on_policy (the first minibatch's fresh rows are on-policy:
  its update is the rollout's first), with a buffer also `replayed`. This step's rollouts enter the buffer after the
  batch is composed, so they are replayable from the next step on. c is the run's Config.
  """
  G = c.rollout.num_generations
  rewards_PG = roll.rewards.reshape(-1, G)
  adv = grpo.advantages(c.grpo.advantage, rewards_PG, c.grpo.std_scale).reshape(-1)
  zero_std = grpo.zero_std_groups(rewards_PG)
  keep_rows = np.arange(len(adv))
  if c.grpo.filter_zero_std:
    keep_rows = np.flatnonzero(np.repeat(~zero_std, G))
  stats = {"frac_reward_zero_std": float(zero_std.mean()), "adv/abs_mean": float(np.abs(adv).mean())}
  full = {k: getattr(roll, k)[keep_rows] for k in SEQUENCE_FIELDS}
  full["adv"] = adv[keep_rows].astype(np.float32)
  if use_old_logp and c.grpo.old_logp == "sampler":  # the behaviour policy's own log-probs: no forward needed
    full["old_logp"] = roll.sample_logprobs[keep_rows].astype(np.float32)
  if buffer is not None:
    full, replayed, replay_stats = buffer.compose(full, step, np.random.default_rng([c.seed, step, 1]))
    full["replayed"] = replayed.astype(np.int32)
    stats.update(replay_stats)
    buffer.add(roll, adv, step)
  n = len(full["adv"])
  stats["rows_updated"] = n
  if n == 0:
    return [], stats
  order = shuffled(full["prompt_ids"], full["prompt_mask"], rng, c.train.shuffle)
  mb = c.minibatch_size
  n_pad = -n % mb
  rows = np.concatenate([order, np.full(n_pad, order[0])])
  live = np.concatenate([np.ones(n), np.zeros(n_pad)]).astype(np.int32)
  full = {k: v[rows] for k, v in full.items()}
  full["mask"] = full["mask"] * live[:, None]
  full["adv"] = (full["adv"] * live).astype(np.float32)
  out = []
  for j, i in enumerate(range(0, len(rows), mb)):
    part = {k: v[i:i + mb] for k, v in full.items()}
    if use_old_logp:
      replayed = part.get("replayed", np.zeros(mb, np.int32))
      # the rollout's first update is on-policy for its fresh rows: their denominator is the current log-prob
      part["on_policy"] = ((replayed == 0) & (j == 0)).astype(np.int32)
      stored = part.get("old_logp", np.full(part["tokens"].shape, np.nan, np.float32))
      # 0 where unread (on-policy), NaN where a forward must fill it in: a forgotten fill is a non-finite loss; the
      # sampler's log-probs stay on every row (a later pass reads the on-policy rows' too)
      if c.grpo.old_logp != "sampler":
        stored = np.where(part["on_policy"][:, None] > 0, 0.0, stored)
      part["old_logp"] = stored.astype(np.float32)
    else:
      part.pop("replayed", None)
    out.append(UpdateBatch(**part))
  return out, stats


def shuffled(prompt_ids_BP, prompt_mask_BP, rng: np.random.Generator, mode: str) -> np.ndarray:
  """A permutation of the rows: `row` shuffles rows (with no replayed rows it reorders keep_rows exactly as
  shuffling them would); `group` shuffles whole groups, the rows of one prompt kept together in their order (a
  replayed row joins its prompt's rows, if any), so cutting the order into minibatches splits a group only where a
  minibatch is not a multiple of G."""
  order = np.arange(len(prompt_ids_BP))
  if mode == "row":
    rng.shuffle(order)
    return order
  if mode != "group":
    raise ValueError(f"train.shuffle must be one of {list(SHUFFLES)}, got {mode!r}")
  key = np.concatenate([np.asarray(prompt_ids_BP), np.asarray(prompt_mask_BP)], axis=1)
  _, first, group = np.unique(key, axis=0, return_index=True, return_inverse=True)
  group = group.reshape(-1)
  units = np.argsort(first, kind="stable")  # groups in order of first appearance, then shuffled
  rng.shuffle(units)
  rank = np.empty(len(units), np.int64)
  rank[units] = np.arange(len(units))
  return np.argsort(rank[group], kind="stable")


def needs_old_forward(batch: UpdateBatch, index: int, later_passes: bool) -> bool:
  """Whether a forward pass must give old log-probs to minibatch `index` of a pass: a fresh row is on-policy only
  in the rollout's first minibatch of its first pass (minibatches' on_policy), or a replayed row's current log-prob
  is wanted. Decided on the host from the composition, never by reading placed arrays back (no device sync, and
  across processes none holds every row)."""
  if batch.old_logp is None:
    return False
  return later_passes or batch.replayed is not None or index > 0
