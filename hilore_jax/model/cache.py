"""Incremental decoding: the prompt's KV cache (prefill, `forward_cached`) and the one-token decode step
(`decode_step`), which writes the layers' keys and values into a stacked cache in place and attends only to the
cache's filled chunks, so a token's cost follows the sequence so far, not the cache's allocated length."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hilore_jax.model import ops
from hilore_jax.model import units as U
from hilore_jax.model.config import ModelConfig
from hilore_jax.model.decoder import embed, logits
from hilore_jax.model.layer import Prefill, decoder_layer
from hilore_jax.model.layers import stack_layers
from hilore_jax.model.ops import layer_ctx, rms_norm
from hilore_jax.model.rope import rope_cos_sin


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> tuple:
  """(k, v) buffers for every layer, [L, B, S, K, H] each."""
  shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_size)
  dt = dtype or cfg.compute_dtype
  return jnp.zeros(shape, dt), jnp.zeros(shape, dt)


def forward_cached(cfg: ModelConfig, params: dict, input_ids_BT, positions_BT, key_mask_BS, cache: tuple,
                   cache_index) -> tuple[jax.Array, tuple]:
  """Logits [B, T, V] for tokens placed at cache slots cache_index..+T, attending to valid earlier slots (the
  prefill: the layer scan returns each layer's cache as a new stacked buffer, a copy a decode step avoids)."""
  ctx = layer_ctx(cfg, positions_BT, key_mask_BS, cache_index)
  x = embed(cfg, params, input_ids_BT)

  def body(x, layer):
    p, kv = layer
    x, kv = decoder_layer(cfg, p, x, ctx, Prefill(kv, cache_index))
    return x, kv

  layers = params["layers"]
  stacked = stack_layers(layers) if isinstance(layers, (list, tuple)) else layers  # generate stacks once per call
  x, new_cache = jax.lax.scan(body, x, (stacked, cache))
  h = rms_norm(x, params["final_norm_D"], cfg.rms_norm_eps)
  return logits(cfg, params, h), new_cache


class _Rope(NamedTuple):
  """What the decoder's q and k producer ops read of a layer context: RoPE tables [R, 1, H]."""

  cos_BTH: jax.Array
  sin_BTH: jax.Array


def filled_attention(q_RNH: jax.Array, k_LRSKH: jax.Array, v_LRSKH: jax.Array, layer, filled, key_start_R,
                     chunk: int, n_chunks: int) -> jax.Array:
  """One query per row [R, N, H] over layer `layer`'s cached keys at slots key_start_r..filled-1, read `chunk`
  slots at a time over the first n_chunks chunks only (online softmax in float32): a step's cost follows the chunks
  its caller knows are filled (n_chunks, static), never the cache's allocated length. The chunks are unrolled: a
  loop of dynamic length (up to the traced `filled`) made XLA:CPU's decode step 3.4x slower at 64 rows x 64 slots.
  Output in q's dtype."""
  R, N, H = q_RNH.shape
  KV = k_LRSKH.shape[3]
  q = q_RNH.reshape(R, KV, N // KV, H).astype(jnp.float32) * (1.0 / math.sqrt(H))
  shape = q.shape[:-1]
  m, l, acc = jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(q.shape, jnp.float32)
  for c in range(n_chunks):
    start = (layer, 0, c * chunk, 0, 0)
    k = jax.lax.dynamic_slice(k_LRSKH, start, (1, R, chunk, KV, H))[0].astype(jnp.float32)
    v = jax.lax.dynamic_slice(v_LRSKH, start, (1, R, chunk, KV, H))[0].astype(jnp.float32)
    s = jnp.einsum("rkgh,rskh->rkgs", q, k)
    slot = c * chunk + jnp.arange(chunk)
    valid = ((slot[None, :] >= key_start_R[:, None]) & (slot[None, :] < filled))[:, None, None, :]
    m_new = jnp.maximum(m, jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no valid key in the chunks so far
    p = jnp.where(valid, jnp.exp(s - m_safe[..., None]), 0.0)
    alpha = jnp.exp(m - m_safe)
    m, l, acc = m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + jnp.einsum("rkgs,rskh->rkgh", p, v)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return out.reshape(R, N, H).astype(q_RNH.dtype)


def decode_step(cfg: ModelConfig, params: dict, tok_R: jax.Array, pos_R: jax.Array, cache: tuple, slot,
                key_start_R: jax.Array, chunk: int, n_chunks: int = 1) -> tuple[jax.Array, tuple]:
  """Logits [R, V] (float32) of one token per row placed at cache slot `slot` (the same for every row) with RoPE
  position pos_R; each row attends to its own slots key_start_r..slot. params["layers"] is stacked; cache is the
  stacked (k, v) [L, R, S, K, H], a carry of the layer scan written in place (one [R, 1, K, H] slot per layer),
  never copied. Attention reads the first n_chunks chunks of `chunk` slots (static; the caller's bound on slot + 1,
  within the cache). The layer computes the decoder's own producer ops (model/ops.py), attention aside."""
  if not 0 < n_chunks * chunk <= cache[0].shape[2]:
    raise ValueError(f"{n_chunks} attention chunks of {chunk} slots do not fit a cache of {cache[0].shape[2]} slots")
  cos, sin = rope_cos_sin(cfg, pos_R[:, None])
  rope = _Rope(cos, sin)
  x = embed(cfg, params, tok_R[:, None])

  def layer(carry, xs):
    x, k_all, v_all = carry
    p, i = xs
    t = {U.LAYER_INPUT: x}
    for name, fn in ops.BEFORE_ATTENTION:
      t[name] = fn(cfg, p, t, rope)
    q, k, v = t[U.Q], t[U.K], t[U.V]
    k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), (i, 0, slot, 0, 0))
    v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), (i, 0, slot, 0, 0))
    t[U.ATTN_CTX] = filled_attention(q[:, 0], k_all, v_all, i, slot + 1, key_start_R, chunk, n_chunks)[:, None]
    for name, fn in ops.AFTER_ATTENTION:
      t[name] = fn(cfg, p, t, rope)
    return (t[U.MLP_INPUT] + t[U.MLP_OUT], k_all, v_all), None

  n = cfg.num_hidden_layers
  (x, k_all, v_all), _ = jax.lax.scan(layer, (x, *cache), (params["layers"], jnp.arange(n, dtype=jnp.int32)))
  h = rms_norm(x, params["final_norm_D"], cfg.rms_norm_eps)
  return logits(cfg, params, h)[:, 0], (k_all, v_all)
