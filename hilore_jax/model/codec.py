"""Low-precision (L) codes for saved activations: per-group absmax scales along the last axis.

Formats: int8 (the default), fp8_e4m3 (float8 codes), int4 (two codes packed per byte) and bf16 (16-bit copy);
every format keeps one float32 scale per group so decode is one multiply.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

FORMATS = ("int8", "fp8_e4m3", "int4", "bf16")
BITS = {"int4": 4, "int8": 8, "fp8_e4m3": 8, "bf16": 16}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _check(fmt: str):
  if fmt not in FORMATS:
    raise ValueError(f"unknown low-precision format {fmt!r}; choose one of {list(FORMATS)}")


def _group(D: int, group_size: int, fmt: str) -> int:
  g = min(group_size, D)
  return g + g % 2 if fmt == "int4" else g  # int4 packs pairs, so groups are even


def _groups(x: jax.Array, g: int) -> jax.Array:
  """[..., D] -> [..., G, g] (zero-padded)."""
  D = x.shape[-1]
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -D % g)])
  return x.reshape(*x.shape[:-1], -(-D // g), g)


def encode(x: jax.Array, fmt: str = "int8", group_size: int = 64) -> tuple[jax.Array, jax.Array]:
  """(codes [..., G, g or g/2], scales float32 [..., G, 1]) of x in `fmt`."""
  _check(fmt)
  xg = _groups(x.astype(jnp.float32), _group(x.shape[-1], group_size, fmt))
  absmax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
  top = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": _FP8_MAX, "bf16": 1.0}[fmt]
  scale = jnp.where(absmax == 0, 1.0, absmax / top)
  y = xg / scale
  if fmt == "int8":
    return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scale
  if fmt == "fp8_e4m3":
    return y.astype(jnp.float8_e4m3fn), scale
  if fmt == "bf16":
    return y.astype(jnp.bfloat16), scale
  q = (jnp.clip(jnp.round(y), -7, 7) + 8).astype(jnp.uint8)  # int4: 1..15, two per byte
  return q[..., 0::2] | (q[..., 1::2] << 4), scale


def decode(codes: jax.Array, scale: jax.Array, shape: tuple[int, ...], dtype, fmt: str = "int8") -> jax.Array:
  """Inverse of encode, to the original shape and dtype."""
  _check(fmt)
  if fmt == "int4":
    lo, hi = (codes & 0xF).astype(jnp.float32) - 8, (codes >> 4).astype(jnp.float32) - 8
    y = jnp.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
  else:
    y = codes.astype(jnp.float32)
  return (y * scale).reshape(*shape[:-1], -1)[..., :shape[-1]].astype(dtype)


def code_bytes(shape: tuple[int, ...], group_size: int = 64, fmt: str = "int8") -> int:
  """Bytes of an L copy: the (padded) codes plus one float32 scale per group."""
  _check(fmt)
  D = shape[-1]
  g = _group(D, group_size, fmt)
  groups = -(-D // g)
  return math.prod(shape[:-1]) * groups * (g * BITS[fmt] // 8 + 4)
