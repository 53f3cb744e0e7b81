"""Recovery units: per-layer tensors backward may keep, with bytes as H and L and measured times."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import codec, model, tokenizer
from hilore_jax.model_config import ModelConfig

# The units the allocator chooses H/L/R for; the layer input is always kept (it is the remat boundary).
KINDS = (model.ATTN_NORM, model.Q, model.K, model.V, model.ATTN_CTX, model.MLP_NORM, model.MLP_GATE, model.MLP_UP,
         model.MLP_DOWN_IN)


@dataclasses.dataclass(frozen=True)
class Unit:
  layer: int
  kind: str
  shape: tuple[int, ...]
  bytes_h: int
  bytes_l: int | None  # None: this kind cannot be kept low-precision
  recompute_s: float
  codec_s: float  # int8 encode + decode


def kind_shapes(cfg: ModelConfig, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
  B, T, D, F = batch, seq, cfg.hidden_size, cfg.intermediate_size
  N, K, Hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
  return {model.ATTN_NORM: (B, T, D), model.Q: (B, T, N, Hd), model.K: (B, T, K, Hd), model.V: (B, T, K, Hd),
          model.ATTN_CTX: (B, T, N, Hd), model.MLP_NORM: (B, T, D), model.MLP_GATE: (B, T, F),
          model.MLP_UP: (B, T, F), model.MLP_DOWN_IN: (B, T, F)}


def _median_time(fn: Callable, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _producers(cfg: ModelConfig, shapes: dict) -> dict[str, tuple[Callable, tuple]]:
  """For each kind, a jitted function recomputing it from its inputs, and example inputs."""
  dt = cfg.compute_dtype
  key = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  rnd = lambda shape: jax.random.normal(next(key), shape, dt)
  B, T, D = shapes[model.ATTN_NORM]
  N, Hd, K, F = cfg.num_attention_heads, cfg.head_size, cfg.num_key_value_heads, cfg.intermediate_size
  x, w_d = rnd((B, T, D)), jnp.ones((D,), dt)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  cos, sin = model.rope_cos_sin(cfg, pos)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  norm = jax.jit(lambda x, w: model.rms_norm(x, w, cfg.rms_norm_eps))
  qk = jax.jit(lambda h, w: model.apply_rope(jnp.einsum("btd,dnh->btnh", h, w), cos, sin))
  v = jax.jit(lambda h, w: jnp.einsum("btd,dnh->btnh", h, w))
  attn = jax.jit(lambda q, k, v: model.attention(q, k, v, mask)[0])
  mm = jax.jit(lambda h, w: jnp.einsum("btd,df->btf", h, w))
  act = jax.jit(lambda g, u: jax.nn.silu(g) * u)
  return {model.ATTN_NORM: (norm, (x, w_d)), model.Q: (qk, (x, rnd((D, N, Hd)))), model.K: (qk, (x, rnd((D, K, Hd)))),
          model.V: (v, (x, rnd((D, K, Hd)))), model.ATTN_CTX: (attn, (rnd((B, T, N, Hd)), rnd((B, T, K, Hd)),
                                                                      rnd((B, T, K, Hd)))),
          model.MLP_NORM: (norm, (x, w_d)), model.MLP_GATE: (mm, (x, rnd((D, F)))), model.MLP_UP: (mm, (x, rnd((D, F)))),
          model.MLP_DOWN_IN: (act, (rnd((B, T, F)), rnd((B, T, F))))}


def profile_key(cfg: ModelConfig, batch: int, seq: int, group_size: int) -> str:
  shape = {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim")}
  ident = json.dumps({"model": shape, "batch": [batch, seq], "dtype": cfg.dtype, "group": group_size,
                      "backend": jax.default_backend(), "device": jax.devices()[0].device_kind}, sort_keys=True)
  return hashlib.sha256(ident.encode()).hexdigest()[:16]


def profile_kinds(cfg: ModelConfig, batch: int, seq: int, group_size: int = 64, reps: int = 7,
                  cache_dir: str | None = None) -> dict[str, dict]:
  """Measured recompute and codec seconds per kind (median of reps), cached on disk by shape/dtype/backend."""
  cache_dir = cache_dir or os.path.join(tokenizer.cache_root(), "profiles")
  path = os.path.join(cache_dir, profile_key(cfg, batch, seq, group_size) + ".json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  shapes = kind_shapes(cfg, batch, seq)
  out = {}
  for kind, (fn, args) in _producers(cfg, shapes).items():
    x = jnp.zeros(shapes[kind], cfg.compute_dtype) + 0.5
    roundtrip = jax.jit(lambda x: codec.dequantize_int8(*codec.quantize_int8(x, group_size), x.shape, x.dtype))
    out[kind] = {"recompute_s": _median_time(fn, args, reps), "codec_s": _median_time(roundtrip, (x,), reps)}
  os.makedirs(cache_dir, exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(out, f, indent=2)
  os.replace(tmp, path)
  return out


def enumerate_units(cfg: ModelConfig, batch: int, seq: int, group_size: int = 64,
                    profile: dict[str, dict] | None = None) -> list[Unit]:
  """Every layer's units with bytes as H (compute dtype) and as L (int8 + scales), and measured times."""
  shapes = kind_shapes(cfg, batch, seq)
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  profile = profile or {k: {"recompute_s": 0.0, "codec_s": 0.0} for k in KINDS}
  units = []
  for layer in range(cfg.num_hidden_layers):
    for kind in KINDS:
      shape = shapes[kind]
      units.append(Unit(layer, kind, shape, math.prod(shape) * itemsize,
                        codec.code_bytes(shape, group_size) if kind in model.LOWP_UNITS else None,
                        profile[kind]["recompute_s"], profile[kind]["codec_s"]))
  return units
