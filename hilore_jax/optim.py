"""optax AdamW with linear warmup then constant or cosine decay, after global-norm clipping."""

from __future__ import annotations

import optax

from hilore_jax.config import OptimizerConfig


def schedule(oc: OptimizerConfig, total_updates: int) -> optax.Schedule:
  if oc.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0 if oc.warmup_steps else oc.lr, oc.lr, oc.warmup_steps,
                                              max(total_updates, oc.warmup_steps + 1), oc.lr * oc.min_lr_ratio)
  if oc.warmup_steps:
    return optax.join_schedules([optax.linear_schedule(0.0, oc.lr, oc.warmup_steps), optax.constant_schedule(oc.lr)],
                                [oc.warmup_steps])
  return optax.constant_schedule(oc.lr)


def make_optimizer(oc: OptimizerConfig, total_updates: int) -> optax.GradientTransformation:
  parts = [optax.clip_by_global_norm(oc.max_grad_norm)] if oc.max_grad_norm > 0 else []
  parts.append(optax.adamw(schedule(oc, total_updates), oc.b1, oc.b2, oc.eps, weight_decay=oc.weight_decay))
  return optax.chain(*parts)
