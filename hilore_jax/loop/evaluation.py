"""Greedy accuracy and pass@k of a policy on a task's test split, and of saved policies (HF exports or run
directories, restored without constructing a trainer)."""

from __future__ import annotations

import os
from typing import Sequence

import jax
import numpy as np

from hilore_jax import model, optim, stats, tasks
from hilore_jax.loop import adapters, checkpointing, engine, preflight
from hilore_jax import config as config_lib
from hilore_jax.config import Config
from hilore_jax.errors import CheckpointError
from hilore_jax.model import lora
from hilore_jax.rl import rollout, rollout_engine, train_state
from hilore_jax.rl.config import SamplingConfig
from hilore_jax.tasks import Example, prompts
from hilore_jax.tasks.prompts import Prompter


def evaluate(cfg, params, prompter: Prompter, examples: Sequence[Example], reward_fn, *, max_prompt_len: int,
             max_new_tokens: int, pass_k: int = 4, temperature: float = 1.0, batch_size: int = 128,
             rng: jax.Array | None = None, sampler=None) -> dict:
  """{'eval/accuracy': greedy accuracy, 'eval/accuracy_ci95': its Wilson interval across examples,
  'eval/correct': '0'/'1' per example (for paired comparisons), 'eval/completion_len': mean greedy completion tokens
  (stop token included), 'eval/pass@k': any of k samples correct, 'eval/n': examples}; sampled by sampler (a
  rollout engine, rl/rollout_engine.py; default: the JAX engine)."""
  rng = jax.random.PRNGKey(0) if rng is None else rng
  greedy = SamplingConfig(max_new_tokens=max_new_tokens, greedy=True)
  sampled = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature)
  correct, passed, lens = [], [], []
  for i in range(0, len(examples), batch_size):
    chunk = list(examples[i:i + batch_size])
    r = rollout.sample_completions(cfg, params, prompter, chunk, 1, max_prompt_len, greedy, rng, reward_fn, sampler)
    correct.extend(r.rewards >= 1.0)
    lens.extend(r.mask.sum(1))
    if pass_k > 0:
      rng, key = jax.random.split(rng)
      r = rollout.sample_completions(cfg, params, prompter, chunk, pass_k, max_prompt_len, sampled, key, reward_fn,
                                     sampler)
      passed.extend((r.rewards.reshape(len(chunk), pass_k) >= 1.0).any(axis=1))
  out = {"eval/accuracy": float(np.mean(correct)),
         "eval/accuracy_ci95": stats.wilson_ci(int(np.sum(correct)), len(correct)),
         "eval/correct": "".join("1" if c else "0" for c in correct), "eval/completion_len": float(np.mean(lens)),
         "eval/n": len(examples)}
  if pass_k > 0:
    out[f"eval/pass@{pass_k}"] = float(np.mean(passed))
  return out


def paired_gain_ci(before: str, after: str) -> list[float]:
  """[lo, hi] in points of accuracy: the bench's bootstrap CI of the per-example difference between two evaluations
  of the same examples ('0'/'1' strings), which pairing narrows where both solve the same ones."""
  if len(before) != len(after):
    raise ValueError(f"paired evaluations differ in length: {len(before)} vs {len(after)}")
  lo, hi = stats.bootstrap_ci([int(a) - int(b) for a, b in zip(after, before)])
  return [100 * lo, 100 * hi]


# ----------------------------------------------------------------------------- saved policies


def restore_params(run_dir: str, config: Config) -> tuple[model.ModelConfig, dict]:
  """(model cfg, params) of a run directory's newest intact orbax checkpoint, restored onto the default device."""
  directory = os.path.join(run_dir, "checkpoints")
  ckpt = checkpointing.Checkpointer(directory, keep=1 << 30, create=False)
  chosen = {}

  def abstract_for(meta: dict):
    run_config = config
    saved = meta.get("config") or {}
    if saved.get("model"):  # the run's own model and optimizer, not whatever the eval config says
      saved = dict(saved, out_dir=run_dir, train=dict(saved.get("train", {}), resume=False))
      run_config = config_lib.from_dict(saved)
    if meta.get("lora"):  # the adapters' checkpoint, on the base its metadata names
      model_cfg, chosen["base"] = adapters.saved_base(meta, run_config, meta["step"])
    else:
      model_cfg = engine.model_config(run_config)
    chosen["model_cfg"] = model_cfg
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = jax.eval_shape(lambda: model.init_params(model_cfg, jax.random.PRNGKey(0)))
    if meta.get(checkpointing.LAYERS_KEY) == checkpointing.STACKED:  # the train layout (older runs: per layer)
      params = jax.eval_shape(model.stacked, params)
    train = train_state.abstract(params, optim.make_optimizer(run_config.optimizer, 1))
    ref = params if run_config.grpo.beta > 0 and not meta.get("lora") else None
    tree = checkpointing.run_tree(train.checkpoint(), ref)
    return engine.abstract(tree, jax.tree.map(lambda _: dev, tree))

  try:
    found = ckpt.restore_newest(abstract_for)
    if found is None:
      raise CheckpointError(f"{directory} holds no checkpoint")
    params = found[1]["train"]["params"]
    if "base" in chosen:
      base = chosen["base"]  # per layer as loaded; the adapters in the layout they were saved in
      params = lora.Split(model.stacked(base) if model.is_stacked(params) else base, params).combined()
    return chosen["model_cfg"], params
  finally:
    ckpt.close()


def load_policy(config: Config, checkpoint: str):
  """(model cfg, params, prompter) from an HF directory, a run directory, or its checkpoints/ folder."""
  if os.path.exists(os.path.join(checkpoint, "config.json")):
    cfg, params = preflight.load_hf("checkpoint", checkpoint, config.model)
    has_tok = any(os.path.exists(os.path.join(checkpoint, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    key, tok_path = ("checkpoint", checkpoint) if has_tok else (preflight.tokenizer_key(config), config.tokenizer_path)
    tok = preflight.load_tokenizer(key, tok_path)
    return cfg, params, prompts.build_prompter(tok, config.task, tok_path, checkpoint)
  run_dir = os.path.dirname(checkpoint.rstrip("/")) if os.path.basename(checkpoint.rstrip("/")) == "checkpoints" \
      else checkpoint
  if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
    raise CheckpointError(f"{checkpoint}: neither an HF directory (config.json) nor a run directory with checkpoints/")
  cfg, params = restore_params(run_dir, config)
  tok = preflight.load_tokenizer(preflight.tokenizer_key(config), config.tokenizer_path)
  return cfg, params, prompts.build_prompter(tok, config.task, config.tokenizer_path, config.model.path)


def evaluate_checkpoint(config: Config, checkpoint: str) -> dict:
  """Greedy accuracy and pass@k of a saved policy on the config's task."""
  preflight.check_task_files(config)
  cfg, params, prompter = load_policy(config, checkpoint)
  task = tasks.build_task(config.task)
  c = config
  out = evaluate(cfg, params, prompter, task.test_examples[:c.eval.num_examples], task.reward,
                 max_prompt_len=c.rollout.max_prompt_len, max_new_tokens=c.rollout.max_new_tokens,
                 pass_k=c.eval.pass_k, temperature=c.eval.temperature, batch_size=c.eval.batch_size,
                 rng=jax.random.PRNGKey(c.seed + 1),
                 sampler=rollout_engine.build(cfg, c.rollout, prompter.stop_ids, prompter.tokenizer.pad_token_id))
  return {"checkpoint": checkpoint, "task": task.name, **out}
