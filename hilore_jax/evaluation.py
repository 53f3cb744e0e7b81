"""Greedy accuracy and pass@k of a policy on a task's test split."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from hilore_jax import rollout, sampler
from hilore_jax.tasks import Example


def evaluate(cfg, params, tokenizer, examples: Sequence[Example], reward_fn, *, max_prompt_len: int,
             max_new_tokens: int, pass_k: int = 4, temperature: float = 1.0, batch_size: int = 128,
             rng: jax.Array | None = None) -> dict:
  """{'eval/accuracy': greedy accuracy, 'eval/pass@k': any of k samples correct, 'eval/n': examples}."""
  rng = jax.random.PRNGKey(0) if rng is None else rng
  greedy = sampler.SamplingConfig(max_new_tokens=max_new_tokens, greedy=True)
  sampled = sampler.SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature)
  correct, passed = [], []
  for i in range(0, len(examples), batch_size):
    chunk = list(examples[i:i + batch_size])
    r = rollout.sample_completions(cfg, params, tokenizer, chunk, 1, max_prompt_len, greedy, rng, reward_fn)
    correct.extend(r.rewards >= 1.0)
    if pass_k > 0:
      rng, key = jax.random.split(rng)
      r = rollout.sample_completions(cfg, params, tokenizer, chunk, pass_k, max_prompt_len, sampled, key, reward_fn)
      passed.extend((r.rewards.reshape(len(chunk), pass_k) >= 1.0).any(axis=1))
  out = {"eval/accuracy": float(np.mean(correct)), "eval/n": len(examples)}
  if pass_k > 0:
    out[f"eval/pass@{pass_k}"] = float(np.mean(passed))
  return out
