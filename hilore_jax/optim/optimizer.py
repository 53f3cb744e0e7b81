"""The optimizer: global-norm clipping, then AdamW or LoGRA (AdamW on low-rank gradient sketches), with linear
warmup then constant or cosine decay."""

from __future__ import annotations

import optax

from hilore_jax.optim import logra
from hilore_jax.optim.config import OptimizerConfig

# LoGRA leaves that stay dense AdamW besides every leaf with < 2 dims (norms, 1-D biases): embeddings and the lm
# head (rows are tokens: one shared subspace does not fit them) and the attention biases, [N, H] by shape but one
# vector per head, not a matrix
DENSE_NAMES = logra.DENSE_NAMES + ("bq_NH", "bk_KH", "bv_KH")


def schedule(oc: OptimizerConfig, total_updates: int) -> optax.Schedule:
  if oc.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0 if oc.warmup_steps else oc.lr, oc.lr, oc.warmup_steps,
                                              max(total_updates, oc.warmup_steps + 1), oc.lr * oc.min_lr_ratio)
  if oc.warmup_steps:
    return optax.join_schedules([optax.linear_schedule(0.0, oc.lr, oc.warmup_steps), optax.constant_schedule(oc.lr)],
                                [oc.warmup_steps])
  return optax.constant_schedule(oc.lr)


def stacked_layers(path) -> int:
  """LoGRA's batch axes: the leading layer axis of the train layout's stacked layers (a per-layer list has none)."""
  keys = [getattr(k, "key", None) for k in path[:2]]
  return int(len(keys) == 2 and keys[0] == "layers" and isinstance(keys[1], str))


def make_optimizer(oc: OptimizerConfig, total_updates: int,
                   lr: optax.Schedule | None = None) -> optax.GradientTransformation:
  """chain(clip_by_global_norm, adamw | logra): one schedule (lr, or built from oc), betas, eps and weight decay (on
  every leaf) for both."""
  parts = [optax.clip_by_global_norm(oc.max_grad_norm)] if oc.max_grad_norm > 0 else []
  lr = schedule(oc, total_updates) if lr is None else lr
  if oc.kind == "logra":
    lc = oc.logra
    parts.append(logra.logra(lr, lc.rank, lc.refresh_every, oc.b1, oc.b2, oc.eps, oc.weight_decay, lc.scale, lc.seed,
                             lc.oversample, lc.power_iters, lc.min_dim, DENSE_NAMES, stacked_layers))
  else:
    parts.append(optax.adamw(lr, oc.b1, oc.b2, oc.eps, weight_decay=oc.weight_decay))
  return optax.chain(*parts)
