"""Incremental decoding: per-layer KV buffers and a forward pass over cached keys and values."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hilore_jax.model.config import ModelConfig
from hilore_jax.model.decoder import LayerCtx, decoder_layer, embed, logits, rms_norm, rope_cos_sin, stack_layers


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> tuple:
  """(k, v) buffers for every layer, [L, B, S, K, H] each."""
  shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_size)
  dt = dtype or cfg.compute_dtype
  return jnp.zeros(shape, dt), jnp.zeros(shape, dt)


def forward_cached(cfg: ModelConfig, params: dict, input_ids_BT, positions_BT, key_mask_BS, cache: tuple,
                   cache_index) -> tuple[jax.Array, tuple]:
  """Logits [B, T, V] for tokens placed at cache slots cache_index..+T, attending to valid earlier slots."""
  B, T = input_ids_BT.shape
  S = key_mask_BS.shape[1]
  slot_T = cache_index + jnp.arange(T)
  mask_BTS = (jnp.arange(S)[None, :] <= slot_T[:, None])[None] & key_mask_BS.astype(bool)[:, None, :]
  ctx = LayerCtx(*rope_cos_sin(cfg, positions_BT), mask_BTS)
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
