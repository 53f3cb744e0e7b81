"""Synthetic GRPO minibatches with realistic loss coefficients: zero-advantage groups, off-policy ratios that clip,
ragged completions. For the benchmark and the risk report, where rollouts would only add noise and time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import grpo, train_step
from hilore_jax.model import ModelConfig


def grpo_batch(cfg: ModelConfig, params, rng: np.random.Generator, rows: int, prompt_len: int, completion_len: int,
               group: int = 8, zero_adv_frac: float = 0.25, logp_noise: float = 0.3, ref_noise: float = 0.05) -> dict:
  """One minibatch: `rows` = groups x `group` responses; a `zero_adv_frac` share of groups has all-equal rewards;
  old log-probs are the current ones plus N(0, logp_noise) so some ratios leave the clip range."""
  if rows % group:
    raise ValueError(f"rows {rows} is not a multiple of the group size {group}")
  V = cfg.vocab_size
  plen = rng.integers(max(1, prompt_len // 2), prompt_len + 1, rows)
  prompt_mask = (np.arange(prompt_len)[None] >= prompt_len - plen[:, None]).astype(np.int32)  # left-padded
  clen = rng.integers(max(1, completion_len // 3), completion_len + 1, rows)
  mask = (np.arange(completion_len)[None] < clen[:, None]).astype(np.int32)  # right-padded
  batch = {"prompt_ids": (rng.integers(1, V, (rows, prompt_len)) * prompt_mask).astype(np.int32),
           "prompt_mask": prompt_mask, "tokens": (rng.integers(1, V, (rows, completion_len)) * mask).astype(np.int32),
           "mask": mask}
  groups = rows // group
  p_success = rng.uniform(0.1, 0.9, groups)
  rewards = (rng.random((groups, group)) < p_success[:, None]).astype(np.float32)
  flat = rng.permutation(groups)[:int(round(zero_adv_frac * groups))]
  rewards[flat] = rng.integers(0, 2, (len(flat), 1))  # every response scored the same: zero advantage
  batch["adv"] = np.asarray(grpo.grpo_advantages(jnp.asarray(rewards))).reshape(rows).astype(np.float32)
  logp = np.asarray(_logp(cfg, params, {k: jnp.asarray(v) for k, v in batch.items()}))  # the current policy
  batch["old_logp"] = ((logp + rng.normal(0, logp_noise, logp.shape)) * mask).astype(np.float32)
  batch["ref_logp"] = ((logp + rng.normal(0, ref_noise, logp.shape)) * mask).astype(np.float32)
  return batch


_logp = jax.jit(lambda cfg, p, b: train_step.completion_logprobs(cfg, p, b)[0], static_argnums=0)
