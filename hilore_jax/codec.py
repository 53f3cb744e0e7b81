"""Low-precision (L) codes for saved activations: int8 with per-group absmax scales along the last axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _groups(x: jax.Array, group_size: int) -> tuple[jax.Array, int]:
  """[..., D] -> [..., G, group_size] (zero-padded), and the pad."""
  D = x.shape[-1]
  g = min(group_size, D)
  pad = -D % g
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], (D + pad) // g, g), pad


def quantize_int8(x: jax.Array, group_size: int = 64) -> tuple[jax.Array, jax.Array]:
  """(codes int8 [..., G, g], scales float32 [..., G, 1]); |x - dequant| <= scale / 2 per element."""
  xg, _ = _groups(x.astype(jnp.float32), group_size)
  scale = jnp.max(jnp.abs(xg), axis=-1, keepdims=True) / 127.0
  scale = jnp.where(scale == 0, 1.0, scale)
  codes = jnp.clip(jnp.round(xg / scale), -127, 127).astype(jnp.int8)
  return codes, scale


def dequantize_int8(codes: jax.Array, scale: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
  """Inverse of quantize_int8 to the original shape and dtype."""
  x = (codes.astype(jnp.float32) * scale).reshape(*shape[:-1], -1)[..., :shape[-1]]
  return x.astype(dtype)


def code_bytes(shape: tuple[int, ...], group_size: int = 64) -> int:
  """Bytes of an L copy: one int8 per (padded) element plus one float32 scale per group."""
  D = shape[-1]
  g = min(group_size, D)
  groups = -(-D // g)
  rows = 1
  for s in shape[:-1]:
    rows *= s
  return rows * (groups * g + 4 * groups)
