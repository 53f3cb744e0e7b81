"""The attention kernels behind `model.attention`: xla (the softmax probabilities as a tensor of the layer, which
units.TABLE names) and dot_product_attention (jax.nn's fused kernel, cuDNN flash attention on GPU)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def attention_scores(q_BTNH, k_BSKH) -> jax.Array:
  """Grouped-query scores [B, K, G, T, S], accumulated in float32 whatever the compute dtype (bf16 sums over H
  lose the scores' small differences)."""
  B, T, N, H = q_BTNH.shape
  KV = k_BSKH.shape[2]
  q = q_BTNH.reshape(B, T, KV, N // KV, H)
  return jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH, preferred_element_type=jnp.float32) / math.sqrt(H)


def attention_probs(q_BTNH, k_BSKH, mask_BTS) -> jax.Array:
  """Grouped-query softmax probabilities [B, K, G, T, S], computed in float32, returned in q's dtype."""
  scores = jnp.where(mask_BTS[:, None, None], attention_scores(q_BTNH, k_BSKH), jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=-1).astype(q_BTNH.dtype)


def attention_context(probs_BKGTS, v_BSKH) -> jax.Array:
  """Probability-weighted values [B, T, N, H]."""
  B, KV, G, T, _ = probs_BKGTS.shape
  ctx = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
  return ctx.reshape(B, T, KV * G, ctx.shape[-1])


def fused_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS) -> jax.Array:
  """jax.nn.dot_product_attention [B, T, N, H]: cuDNN flash attention on GPU, XLA elsewhere; the probabilities
  are never a tensor of the layer (units.table: no attn_probs row under this kernel)."""
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None])
