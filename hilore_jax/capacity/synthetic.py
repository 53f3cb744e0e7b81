"""Synthetic GRPO minibatches with realistic loss coefficients: zero-advantage groups, off-policy ratios that clip,
ragged completions. For the benchmark and the risk report, where rollouts would only add noise and time."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model
from hilore_jax.model import ModelConfig
from hilore_jax.rl import grpo, train_step
from hilore_jax.rl.update_batch import UpdateBatch


def grpo_batch(cfg: ModelConfig, params, rng: np.random.Generator, rows: int, prompt_len: int, completion_len: int,
               group: int = 8, zero_adv_frac: float = 0.25, logp_noise: float = 0.3,
               ref_noise: float = 0.05) -> UpdateBatch:
  """One minibatch: `rows` = groups x `group` responses; a `zero_adv_frac` share of groups has all-equal rewards;
  old log-probs are the current ones plus N(0, logp_noise) so some ratios leave the clip range."""
  if rows % group:
    raise ValueError(f"rows {rows} is not a multiple of the group size {group}")
  V = cfg.vocab_size
  plen = rng.integers(max(1, prompt_len // 2), prompt_len + 1, rows)
  prompt_mask = (np.arange(prompt_len)[None] >= prompt_len - plen[:, None]).astype(np.int32)  # left-padded
  clen = rng.integers(max(1, completion_len // 3), completion_len + 1, rows)
  mask = (np.arange(completion_len)[None] < clen[:, None]).astype(np.int32)  # right-padded
  seqs = UpdateBatch((rng.integers(1, V, (rows, prompt_len)) * prompt_mask).astype(np.int32), prompt_mask,
                     (rng.integers(1, V, (rows, completion_len)) * mask).astype(np.int32), mask)
  groups = rows // group
  p_success = rng.uniform(0.1, 0.9, groups)
  rewards = (rng.random((groups, group)) < p_success[:, None]).astype(np.float32)
  flat = rng.permutation(groups)[:int(round(zero_adv_frac * groups))]
  rewards[flat] = rng.integers(0, 2, (len(flat), 1))  # every response scored the same: zero advantage
  adv = np.asarray(grpo.grpo_advantages(jnp.asarray(rewards))).reshape(rows).astype(np.float32)
  logp = np.asarray(_logp(cfg, params, seqs))  # the current policy
  return seqs.replace(adv=adv, old_logp=((logp + rng.normal(0, logp_noise, logp.shape)) * mask).astype(np.float32),
                      ref_logp=((logp + rng.normal(0, ref_noise, logp.shape)) * mask).astype(np.float32))


def step_spec(mcfg: ModelConfig, grpo_cfg, logprob_chunk: int, completion_len: int):
  """The bench's step for these minibatches: no remat yet (plans replace the policies), old and (with beta > 0)
  reference log-probs carried by the batch, completions of completion_len tokens."""
  grpo_cfg = dataclasses.replace(grpo_cfg, max_completion_len=completion_len)
  return train_step.StepSpec(mcfg, grpo_cfg, model.uniform(mcfg.num_hidden_layers, model.NO_REMAT), 1, logprob_chunk,
                             use_old_logp=True, use_ref_logp=grpo_cfg.beta > 0)


def shape_batch(mcfg: ModelConfig, rows: int, prompt_len: int, completion_len: int, with_ref: bool) -> UpdateBatch:
  """A minibatch with the fields and shapes of grpo_batch's and no forward pass (compile-only measurements)."""
  b = token_batch(mcfg.vocab_size, np.random.default_rng(0), rows, prompt_len, completion_len)
  zeros = np.zeros((rows, completion_len), np.float32)
  return b.replace(old_logp=zeros, ref_logp=zeros if with_ref else None)


def token_batch(vocab_size: int, rng: np.random.Generator, rows: int, prompt_len: int,
                completion_len: int) -> UpdateBatch:
  """Random token ids, full masks and normal advantages: a batch whose shapes are all that matters (compile times,
  compiled memory)."""
  return UpdateBatch(rng.integers(0, vocab_size, (rows, prompt_len)).astype(np.int32),
                     np.ones((rows, prompt_len), np.int32),
                     rng.integers(0, vocab_size, (rows, completion_len)).astype(np.int32),
                     np.ones((rows, completion_len), np.int32), rng.normal(size=rows).astype(np.float32))


_logp = jax.jit(lambda cfg, p, b: train_step.completion_logprobs(cfg, p, b)[0], static_argnums=0)
