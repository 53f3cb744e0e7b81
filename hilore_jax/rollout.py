"""Rollouts: tokenize prompts, sample G completions each, decode, and score them with the verifier."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from hilore_jax import sampler
from hilore_jax.config import SamplingConfig
from hilore_jax.model import ModelConfig
from hilore_jax.tasks import Example


@dataclasses.dataclass
class Rollout:
  """Host-side arrays of one rollout batch, rows grouped by prompt (G consecutive rows per prompt)."""

  prompt_ids: np.ndarray  # [B, P] left-padded
  prompt_mask: np.ndarray
  tokens: np.ndarray  # [B, N] right-padded
  mask: np.ndarray  # [B, N] 1 on generated tokens up to and including EOS
  sample_logprobs: np.ndarray  # [B, N] under the sampling distribution
  texts: list[str]
  rewards: np.ndarray  # [B]
  truncated_prompts: int = 0


def encode_prompts(tokenizer, prompts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Left-padded ids and mask [n, max_len]; over-long prompts keep their last max_len tokens (counted)."""
  ids = np.full((len(prompts), max_len), tokenizer.pad_token_id, np.int32)
  mask = np.zeros((len(prompts), max_len), np.int32)
  truncated = 0
  for i, p in enumerate(prompts):
    toks = tokenizer(p)["input_ids"]
    if len(toks) > max_len:
      truncated += 1
      toks = toks[-max_len:]
    if toks:
      ids[i, max_len - len(toks):] = toks
      mask[i, max_len - len(toks):] = 1
  return ids, mask, truncated


def decode_completions(tokenizer, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
  eos = tokenizer.eos_token_id
  out = []
  for row, m in zip(tokens, mask):
    toks = [int(t) for t, k in zip(row, m) if k and t != eos]
    out.append(tokenizer.decode(toks, skip_special_tokens=True))
  return out


def sample_completions(cfg: ModelConfig, params, tokenizer, examples: Sequence[Example], num_generations: int,
                       max_prompt_len: int, sc: SamplingConfig, rng: jax.Array, reward_fn) -> Rollout:
  """G completions for every example, scored by reward_fn(completion_text, reference)."""
  ids, mask, truncated = encode_prompts(tokenizer, [e.prompt for e in examples], max_prompt_len)
  ids, mask = np.repeat(ids, num_generations, 0), np.repeat(mask, num_generations, 0)
  out = jax.device_get(sampler.generate(cfg, params, ids, mask, rng, sc, tokenizer.eos_token_id,
                                        tokenizer.pad_token_id))
  texts = decode_completions(tokenizer, out["tokens"], out["mask"])
  refs = [e.reference for e in examples for _ in range(num_generations)]
  rewards = np.array([reward_fn(t, r) for t, r in zip(texts, refs)], np.float32)
  return Rollout(np.asarray(out["prompt_ids"]), np.asarray(out["prompt_mask"]), np.asarray(out["tokens"]),
                 np.asarray(out["mask"]), np.asarray(out["logprobs"]), texts, rewards, truncated)
