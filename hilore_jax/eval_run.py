"""Evaluate a saved policy (a run's orbax checkpoint or an HF export) on a task's test split."""

from __future__ import annotations

import dataclasses
import os

import jax

from hilore_jax import evaluation, hf, tokenizer as tokenizers
from hilore_jax.config import Config
from hilore_jax.trainer import Trainer, build_task


def load_policy(config: Config, checkpoint: str):
  """(model cfg, params, tokenizer) from an HF directory, a run directory, or its checkpoints/ folder."""
  if os.path.exists(os.path.join(checkpoint, "config.json")):
    cfg, params = hf.load_hf(checkpoint, config.model.param_dtype, config.model.dtype)
    has_tok = any(os.path.exists(os.path.join(checkpoint, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return cfg, params, tokenizers.load_tokenizer(checkpoint if has_tok else config.tokenizer_path)
  run_dir = os.path.dirname(checkpoint.rstrip("/")) if os.path.basename(checkpoint.rstrip("/")) == "checkpoints" \
      else checkpoint
  if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
    raise FileNotFoundError(f"{checkpoint}: neither an HF directory (config.json) nor a run directory "
                            f"with checkpoints/")
  trainer = Trainer(dataclasses.replace(config, out_dir=run_dir))
  if not trainer.restore_latest():
    raise FileNotFoundError(f"{run_dir}/checkpoints holds no checkpoint")
  return trainer.model_cfg, trainer.state["params"], trainer.tokenizer


def evaluate_checkpoint(config: Config, checkpoint: str) -> dict:
  cfg, params, tok = load_policy(config, checkpoint)
  task = build_task(config.task)
  c = config
  out = evaluation.evaluate(cfg, params, tok, task.test_examples[:c.eval.num_examples], task.reward,
                            max_prompt_len=c.rollout.max_prompt_len, max_new_tokens=c.rollout.max_new_tokens,
                            pass_k=c.eval.pass_k, temperature=c.eval.temperature, batch_size=c.eval.batch_size,
                            rng=jax.random.PRNGKey(c.seed + 1))
  return {"checkpoint": checkpoint, "task": task.name, **out}
