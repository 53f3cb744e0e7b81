"""Incremental decoding: per-layer KV buffers and a forward pass over cached keys and values."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hilore_jax.model.config import ModelConfig
from hilore_jax.model.decoder import decoder_layer, embed, layer_ctx, logits, rms_norm, stack_layers


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> tuple:
  """(k, v) buffers for every layer, [L, B, S, K, H] each."""
  shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_size)
  dt = dtype or cfg.compute_dtype
  return jnp.zeros(shape, dt), jnp.zeros(shape, dt)


def forward_cached(cfg: ModelConfig, params: dict, input_ids_BT, positions_BT, key_mask_BS, cache: tuple,
                   cache_index) -> tuple[jax.Array, tuple]:
  """Logits [B, T, V] for tokens placed at cache slots cache_index..+T, attending to valid earlier slots."""
  ctx = layer_ctx(cfg, positions_BT, key_mask_BS, cache_index)
  x = embed(cfg, params, input_ids_BT)

  def body(x, layer):
    p, kv = layer
    x, kv = decoder_layer(cfg, p, x, ctx, kv, cache_index)
    return x, kv

  layers = params["layers"]
  stacked = stack_layers(layers) if isinstance(layers, (list, tuple)) else layers  # generate stacks once per call
  x, new_cache = jax.lax.scan(body, x, (stacked, cache))
  h = rms_norm(x, params["final_norm_D"], cfg.rms_norm_eps)
  return logits(cfg, params, h), new_cache
