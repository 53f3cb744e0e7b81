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

# The units the allocator chooses H/L/R(/O) for; the layer input is always kept (it is the remat boundary).
KINDS = (model.ATTN_NORM, model.Q, model.K, model.V, model.ATTN_CTX, model.MLP_INPUT, model.MLP_NORM, model.MLP_GATE,
         model.MLP_UP, model.MLP_DOWN_IN)
# The forward op that produces each unit (and the attention probabilities, never kept), and its inputs.
PRODUCER = {model.ATTN_NORM: ("attn_norm_op", (model.LAYER_INPUT,)), model.Q: ("q_proj", (model.ATTN_NORM,)),
            model.K: ("k_proj", (model.ATTN_NORM,)), model.V: ("v_proj", (model.ATTN_NORM,)),
            model.ATTN_PROBS: ("scores", (model.Q, model.K)), model.ATTN_CTX: ("pv", (model.ATTN_PROBS, model.V)),
            model.MLP_INPUT: ("o_proj", (model.ATTN_CTX, model.LAYER_INPUT)),
            model.MLP_NORM: ("mlp_norm_op", (model.MLP_INPUT,)), model.MLP_GATE: ("gate_proj", (model.MLP_NORM,)),
            model.MLP_UP: ("up_proj", (model.MLP_NORM,)), model.MLP_DOWN_IN: ("act", (model.MLP_GATE, model.MLP_UP))}
OPS = tuple(op for op, _ in PRODUCER.values())
PROFILE_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Unit:
  layer: int
  kind: str
  shape: tuple[int, ...]
  bytes_h: int
  bytes_l: int | None  # None: this kind cannot be kept low-precision
  recompute_s: float  # the unit's own producer op
  codec_s: float  # encode + decode in the configured format
  offload_s: float | None = None  # device -> host -> device; None where offloading is unsupported


def kind_shapes(cfg: ModelConfig, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
  B, T, D, F = batch, seq, cfg.hidden_size, cfg.intermediate_size
  N, K, Hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
  return {model.ATTN_NORM: (B, T, D), model.Q: (B, T, N, Hd), model.K: (B, T, K, Hd), model.V: (B, T, K, Hd),
          model.ATTN_CTX: (B, T, N, Hd), model.MLP_INPUT: (B, T, D), model.MLP_NORM: (B, T, D),
          model.MLP_GATE: (B, T, F), model.MLP_UP: (B, T, F), model.MLP_DOWN_IN: (B, T, F)}


def _median_time(fn: Callable, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _ops(cfg: ModelConfig, batch: int, seq: int) -> dict[str, tuple[Callable, tuple]]:
  """Each producer op as a jitted function of example inputs with the real shapes and dtype."""
  dt = cfg.compute_dtype
  key = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  rnd = lambda shape: jax.random.normal(next(key), shape, dt)
  B, T, D = batch, seq, cfg.hidden_size
  N, Hd, K, F = cfg.num_attention_heads, cfg.head_size, cfg.num_key_value_heads, cfg.intermediate_size
  x, w_d = rnd((B, T, D)), jnp.ones((D,), dt)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  cos, sin = model.rope_cos_sin(cfg, pos)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  q, k, v = rnd((B, T, N, Hd)), rnd((B, T, K, Hd)), rnd((B, T, K, Hd))
  probs = jax.nn.softmax(rnd((B, K, N // K, T, T)).astype(jnp.float32), -1).astype(dt)
  norm = jax.jit(lambda x, w: model.rms_norm(x, w, cfg.rms_norm_eps))
  qk = jax.jit(lambda h, w: model.apply_rope(jnp.einsum("btd,dnh->btnh", h, w), cos, sin))
  mm = jax.jit(lambda h, w, s: jnp.einsum(s, h, w), static_argnums=2)

  def scores(q, k):
    qg = q.reshape(B, T, K, N // K, Hd)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k).astype(jnp.float32) / math.sqrt(Hd)
    return jax.nn.softmax(jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min), -1).astype(dt)

  pv = jax.jit(lambda p, v: jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N, Hd))
  o = jax.jit(lambda c, w, x: x + jnp.einsum("btnh,nhd->btd", c, w))
  return {"attn_norm_op": (norm, (x, w_d)), "q_proj": (qk, (x, rnd((D, N, Hd)))), "k_proj": (qk, (x, rnd((D, K, Hd)))),
          "v_proj": (mm, (x, rnd((D, K, Hd)), "btd,dkh->btkh")), "scores": (jax.jit(scores), (q, k)),
          "pv": (pv, (probs, v)), "o_proj": (o, (rnd((B, T, N, Hd)), rnd((N, Hd, D)), x)),
          "mlp_norm_op": (norm, (x, w_d)), "gate_proj": (mm, (x, rnd((D, F)), "btd,df->btf")),
          "up_proj": (mm, (x, rnd((D, F)), "btd,df->btf")),
          "act": (jax.jit(lambda g, u: jax.nn.silu(g) * u), (rnd((B, T, F)), rnd((B, T, F))))}


def profile_key(cfg: ModelConfig, batch: int, seq: int, group_size: int) -> str:
  shape = {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim")}
  ident = json.dumps({"model": shape, "batch": [batch, seq], "dtype": cfg.dtype, "group": group_size,
                      "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                      "version": PROFILE_VERSION}, sort_keys=True)
  return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _offload_roundtrip(shape, dt) -> tuple[Callable, tuple]:
  dev = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  back = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  return (lambda x: jax.device_put(jax.device_put(x, host), back)), (jnp.zeros(shape, dt),)


def profile_kinds(cfg: ModelConfig, batch: int, seq: int, group_size: int = 64, reps: int = 7,
                  cache_dir: str | None = None) -> dict:
  """Measured seconds (median of reps) per producer op, per unit and format for encode+decode, and per unit for
  a host round trip where offloading is supported; cached on disk by model shape, batch, dtype and backend."""
  cache_dir = cache_dir or os.path.join(tokenizer.cache_root(), "profiles")
  path = os.path.join(cache_dir, profile_key(cfg, batch, seq, group_size) + ".json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  shapes = kind_shapes(cfg, batch, seq)
  out: dict = {"ops": {op: _median_time(fn, args, reps) for op, (fn, args) in _ops(cfg, batch, seq).items()},
               "codec": {}, "offload": {}}
  for kind in model.LOWP_UNITS:
    x = jnp.zeros(shapes[kind], cfg.compute_dtype) + 0.5
    out["codec"][kind] = {}
    for fmt in codec.FORMATS:
      rt = jax.jit(lambda x, f=fmt: codec.decode(*codec.encode(x, f, group_size), x.shape, x.dtype, f))
      out["codec"][kind][fmt] = _median_time(rt, (x,), reps)
  if model.offload_supported():
    for kind in KINDS:
      out["offload"][kind] = _median_time(*_offload_roundtrip(shapes[kind], cfg.compute_dtype), reps)
  os.makedirs(cache_dir, exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(out, f, indent=2)
  os.replace(tmp, path)
  return out


def enumerate_units(cfg: ModelConfig, batch: int, seq: int, group_size: int = 64, profile: dict | None = None,
                    fmt: str = "int8") -> list[Unit]:
  """Every layer's units with bytes as H (compute dtype) and as L (codes + scales in `fmt`), and measured times."""
  shapes = kind_shapes(cfg, batch, seq)
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  ops = (profile or {}).get("ops", {})
  codecs = (profile or {}).get("codec", {})
  offload = (profile or {}).get("offload", {})
  units = []
  for layer in range(cfg.num_hidden_layers):
    for kind in KINDS:
      shape = shapes[kind]
      lowp = kind in model.LOWP_UNITS
      units.append(Unit(layer, kind, shape, math.prod(shape) * itemsize,
                        codec.code_bytes(shape, group_size, fmt) if lowp else None,
                        ops.get(PRODUCER[kind][0], 0.0), codecs.get(kind, {}).get(fmt, 0.0) if lowp else 0.0,
                        offload.get(kind)))
  return units
