"""Rollouts: encode prompts (prompts.py), sample G completions each, decode, and score them with the verifier."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from hilore_jax.model import ModelConfig, lora
from hilore_jax.rl import sampler
from hilore_jax.rl.config import SamplingConfig
from hilore_jax.tasks import Example
from hilore_jax.tasks.prompts import Prompter


@dataclasses.dataclass
class Rollout:
  """Host-side arrays of one rollout batch, rows grouped by prompt (G consecutive rows per prompt)."""

  prompt_ids: np.ndarray  # [B, P] left-padded
  prompt_mask: np.ndarray
  tokens: np.ndarray  # [B, N] right-padded
  mask: np.ndarray  # [B, N] 1 on generated tokens up to and including the stop token
  sample_logprobs: np.ndarray  # [B, N] under the sampling distribution
  texts: list[str]
  rewards: np.ndarray  # [B]
  truncated_prompts: int = 0
  # [B] bool: completions the cap cut (max_new_tokens reached with no stop id); None: those at the cap
  cut_at_cap: np.ndarray | None = None

  @property
  def lengths(self) -> np.ndarray:
    """[B] completion tokens per row (the sampler stops a row at its stop id, and the loop when all have)."""
    return self.mask.sum(1)


def sample_rows(prompter: Prompter, roll: Rollout, rows: Sequence[int]) -> list[dict]:
  """Decoded prompt (special tokens kept: the chat structure shows), completion and reward of some rollout rows."""
  tok = prompter.tokenizer
  return [{"prompt": tok.decode(roll.prompt_ids[i][roll.prompt_mask[i] > 0].tolist()), "completion": roll.texts[i],
           "reward": float(roll.rewards[i])} for i in rows]


def sample_completions(cfg: ModelConfig, params, prompter: Prompter, examples: Sequence[Example],
                       num_generations: int, max_prompt_len: int, sc: SamplingConfig, rng: jax.Array,
                       reward_fn) -> Rollout:
  """G completions for every example, scored by reward_fn(completion_text, reference)."""
  ids, mask, truncated = prompter.encode(examples, max_prompt_len)
  cfg, params = lora.sampling_model(cfg, params)  # a LoRA model's adapters merged once per rollout
  # the distinct prompts: the sampler prefills each once and copies its cache to the group's G rows
  out = jax.device_get(sampler.generate(cfg, params, ids, mask, rng, sc, prompter.stop_ids,
                                        prompter.tokenizer.pad_token_id, num_generations=num_generations))
  texts = prompter.decode(out["tokens"], out["mask"])
  refs = [e.reference for e in examples for _ in range(num_generations)]
  rewards = np.array([reward_fn(t, r) for t, r in zip(texts, refs)], np.float32)
  tokens, mask = np.asarray(out["tokens"]), np.asarray(out["mask"])
  cut = (mask.sum(1) == sc.max_new_tokens) & ~np.isin(tokens[:, -1], prompter.stop_ids)
  return Rollout(np.asarray(out["prompt_ids"]), np.asarray(out["prompt_mask"]), tokens, mask,
                 np.asarray(out["logprobs"]), texts, rewards, truncated, cut)
