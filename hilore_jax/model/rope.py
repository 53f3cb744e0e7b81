"""Rotary position embeddings: the inverse frequencies with the config's scaling, the cos/sin tables of integer
positions, and the rotate-half rotation (the transformers convention), as MaxText keeps RoPE in its own module."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hilore_jax.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """RoPE inverse frequencies [H/2] with the config's scaling (default, linear, llama3)."""
  H = cfg.head_size
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  scaling = dict(cfg.rope_scaling or ())
  if cfg.rope_type == "linear":
    inv = inv / scaling["factor"]
  elif cfg.rope_type == "llama3":
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    inv = jnp.where(medium, smoothed, scaled)
  return inv


def rope_cos_sin(cfg: ModelConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, H] for integer positions."""
  freqs = positions_BT.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTNH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
  """Rotate-half RoPE (the transformers convention)."""
  half = x_BTNH.shape[-1] // 2
  rotated = jnp.concatenate([-x_BTNH[..., half:], x_BTNH[..., :half]], axis=-1)
  cos, sin = cos_BTH[:, :, None, :].astype(x_BTNH.dtype), sin_BTH[:, :, None, :].astype(x_BTNH.dtype)
  return x_BTNH * cos + rotated * sin
