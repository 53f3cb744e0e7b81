"""Supervised warm-start on gold completions (prompt -> target + end token), for models trained from scratch."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hilore_jax.model import ModelConfig
from hilore_jax.rl import train_step
from hilore_jax.rl.update_batch import UpdateBatch
from hilore_jax.tasks import Example
from hilore_jax.tasks.prompts import Prompter


def encode_targets(prompter: Prompter, examples: Sequence[Example], max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded target ids + the end token (eos, or the chat end-of-turn) and mask [n, max_len]."""
  tokenizer = prompter.tokenizer
  ids = np.full((len(examples), max_len), tokenizer.pad_token_id, np.int32)
  mask = np.zeros((len(examples), max_len), np.int32)
  for i, e in enumerate(examples):
    if e.target is None:
      raise ValueError(f"example {e.prompt!r} has no target completion for the supervised warm-start")
    toks = (tokenizer(e.target, add_special_tokens=False)["input_ids"] + [prompter.end_id])[:max_len]
    ids[i, :len(toks)] = toks
    mask[i, :len(toks)] = 1
  return ids, mask


def sft_batch(prompter: Prompter, examples, max_prompt_len: int, max_new_tokens: int) -> UpdateBatch:
  """Prompts exactly as the rollouts encode them, gold completions after them."""
  p_ids, p_mask, _ = prompter.encode(examples, max_prompt_len)
  t_ids, t_mask = encode_targets(prompter, examples, max_new_tokens)
  return UpdateBatch(p_ids, p_mask, t_ids, t_mask)


@functools.lru_cache(maxsize=8)
def _optimizer(lr: float, steps: int) -> optax.GradientTransformation:
  # one object per setting, so the jitted step (static in it) compiles once per process, not once per trainer
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(lr, steps, 0.1)))


@functools.partial(jax.jit, static_argnames=("cfg", "optimizer"), donate_argnums=(1, 2))
def _sft_step(cfg: ModelConfig, params, opt_state, batch, optimizer):
  def loss_fn(p):
    logp, _ = train_step.completion_logprobs(cfg, p, batch)
    m = batch.mask.astype(jnp.float32)
    return -jnp.sum(logp * m) / jnp.maximum(m.sum(), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _on_mesh_of(params, tree):
  """tree's leaves not yet on params' mesh (the optimizer's step counts) replicated on it, as the step returns them:
  otherwise the second step's inputs differ in type from the first's and the step is traced and compiled again."""
  mesh = next((x.sharding.mesh for x in jax.tree_util.tree_leaves(params)
               if isinstance(x.sharding, jax.sharding.NamedSharding)), None)
  if mesh is None:
    return tree
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree_util.tree_map(
      lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding) else jax.device_put(x, on_mesh), tree)


def warmstart(cfg: ModelConfig, params, prompter: Prompter, example_at: Callable[[int], Example], *, steps: int,
              batch_size: int, lr: float, max_prompt_len: int, max_new_tokens: int, place=lambda b: b,
              progress=None) -> tuple[dict, list[float]]:
  """Run `steps` supervised steps on the task's training stream (positions from 10**9, apart from GRPO's)."""
  optimizer = _optimizer(lr, steps)
  opt_state = _on_mesh_of(params, optimizer.init(params))
  params = jax.tree_util.tree_map(jnp.copy, params)  # the caller's params are not donated
  losses = []
  for step in range(steps):
    examples = [example_at(10**9 + step * batch_size + i) for i in range(batch_size)]
    batch = place(sft_batch(prompter, examples, max_prompt_len, max_new_tokens))
    params, opt_state, loss = _sft_step(cfg, params, opt_state, batch, optimizer)
    losses.append(loss)
    if progress is not None:
      progress(step, loss)
  return params, [float(x) for x in jax.device_get(losses)]
