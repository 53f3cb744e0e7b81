"""One step's update rows on the host: advantages, zero-std filtering, fresh-anchored replay, shuffled fixed-size
minibatches (a short last one padded with masked rows)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hilore_jax import grpo, replay
from hilore_jax.config import Config
from hilore_jax.rollout import Rollout

FRESH_KEYS = ("prompt_ids", "prompt_mask", "tokens", "mask")


def updates_per_step(c: Config) -> int:
  """Optimizer updates of a step at most: every fresh row plus the most rows replay can append, per iteration."""
  B = c.rollout.num_prompts * c.rollout.num_generations
  rows = B + replay.max_replay_rows(c.replay, B)
  return c.grpo.num_iterations * -(-rows // c.minibatch_size)


def minibatches(c: Config, roll: Rollout, rng: np.random.Generator, buffer: replay.ReplayBuffer | None = None,
                step: int = 0) -> tuple[list[dict], dict]:
  """Host minibatches of every kept fresh row and (with a buffer) the replayed rows, and the step's stats.

  With a buffer, each minibatch also carries `replayed` [mb] int32 and `old_logp` [mb, N]: the stored behaviour
  log-probs on replayed rows, NaN on fresh rows (the trainer fills those from the current policy). This step's
  rollouts enter the buffer after the batch is composed, so they are replayable from the next step on.
  """
  G = c.rollout.num_generations
  rewards_PG = jnp.asarray(roll.rewards.reshape(-1, G))
  adv = np.asarray(grpo.advantages(c.grpo.advantage, rewards_PG, c.grpo.std_scale)).reshape(-1)
  zero_std = np.asarray(grpo.zero_std_groups(rewards_PG))
  keep_rows = np.arange(len(adv))
  if c.grpo.filter_zero_std:
    keep_rows = np.flatnonzero(np.repeat(~zero_std, G))
  stats = {"frac_reward_zero_std": float(zero_std.mean()), "adv/abs_mean": float(np.abs(adv).mean())}
  full = {k: getattr(roll, k)[keep_rows] for k in FRESH_KEYS}
  full["adv"] = adv[keep_rows].astype(np.float32)
  if buffer is not None:
    full, replayed, replay_stats = buffer.compose(full, step, np.random.default_rng([c.seed, step, 1]))
    full["replayed"] = replayed.astype(np.int32)
    stats.update(replay_stats)
    buffer.add(roll, adv, step)
  n = len(full["adv"])
  stats["rows_updated"] = n
  if n == 0:
    return [], stats
  # a permutation of positions: with no replayed rows it reorders keep_rows exactly as shuffling them would
  order = np.arange(n)
  rng.shuffle(order)
  mb = c.minibatch_size
  n_pad = -n % mb
  rows = np.concatenate([order, np.full(n_pad, order[0])])
  live = np.concatenate([np.ones(n), np.zeros(n_pad)]).astype(np.int32)
  full = {k: v[rows] for k, v in full.items()}
  full["mask"] = full["mask"] * live[:, None]
  full["adv"] = (full["adv"] * live).astype(np.float32)
  return [{k: v[i:i + mb] for k, v in full.items()} for i in range(0, len(rows), mb)], stats
