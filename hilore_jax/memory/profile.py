"""Recovery units with measured costs: each layer's units (from the model's dataflow table) with bytes as H and
L, their producer ops' times (the decoder's own functions), codec times and, on accelerators, host round trips."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model, runtime
from hilore_jax.memory.store import JsonStore
from hilore_jax.model import codec, lora
from hilore_jax.model import units as U

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


def _compile_all(calls: dict) -> dict:
  """Each (jitted fn, args) compiled, on as many threads as cores: XLA compiles outside the GIL, and on a cold
  start the op profile's two dozen small compiles were most of its time."""
  compile_one = lambda item: (item[0], (item[1][0].lower(*item[1][1]).compile(), item[1][1]))
  with ThreadPoolExecutor(max(1, min(len(calls), os.cpu_count() or 1))) as pool:
    return dict(pool.map(compile_one, calls.items()))


def _median_time(fn: Callable, args, reps: int) -> tuple[float, float]:
  """(median seconds of reps calls, the median's relative standard error): 1.2533 x the robust sd (1.4826 x MAD)
  over sqrt(reps), what a plan's predicted time inherits from the measurement (memory/lgain.py)."""
  jax.block_until_ready(fn(*args))  # warm up (and compile, where fn is not compiled yet)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  med = float(np.median(times))
  mad = float(np.median(np.abs(np.asarray(times) - med)))
  return med, (1.2533 * 1.4826 * mad / np.sqrt(reps) / med if med > 0 else 0.0)


def _op_calls(cfg: model.ModelConfig, batch: int, seq: int, abstract: bool = False
              ) -> dict[str, tuple[Callable, tuple]]:
  """Each producer op of the table as a jitted call of the decoder's own function on inputs of the real shapes
  (abstract: their shapes only, to compile; the real ones of a long sequence are many GiB: [B, K, G, T, S] probs)."""
  sizes = U.dims(cfg, batch, seq)
  layer_cfg = cfg.replace(num_hidden_layers=1)

  def fill(shape, dtype):  # op times do not depend on the values: a cheap pattern in [-0.3, 0.3], no zeros' shortcuts
    return ((jnp.arange(math.prod(shape), dtype=jnp.float32) % 13 - 6) * 0.05).reshape(shape).astype(dtype)

  def inputs():
    # shapes from the model's own init (eval_shape: nothing drawn), values a pattern: drawing a random layer and
    # table compiled threefry for 8 s of a cold set-up on 2 cores
    shapes = jax.eval_shape(lambda: model.layer_params(model.init_params(layer_cfg, jax.random.PRNGKey(0)), 0))
    params = jax.tree.map(lambda s: fill(s.shape, s.dtype), shapes)
    tensors = {t.name: fill(U.shape(t.name, sizes), cfg.compute_dtype) for t in U.TABLE}
    tensors[U.ATTN_PROBS] = jax.nn.softmax(tensors[U.ATTN_PROBS].astype(jnp.float32), -1).astype(cfg.compute_dtype)
    pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    return params, tensors, model.layer_ctx(cfg, pos, jnp.ones((batch, seq), bool))

  params, tensors, ctx = jax.eval_shape(inputs) if abstract else jax.jit(inputs)()  # one program, not one per tensor
  calls = {}
  for op, reads in producers(cfg).items():
    fn = jax.jit(lambda p, t, ctx, op=op: model.OPS[op](cfg, p, t, ctx))
    calls[op] = (fn, (params, {r: tensors[r] for r in reads}, ctx))
  return calls


def producers(cfg: model.ModelConfig) -> dict[str, tuple[str, ...]]:
  """The producer ops of cfg's layer (units.PRODUCERS; with LoRA the adapters' x A op too), each with its reads."""
  rows = U.table("xla", lora.adapted_inputs(cfg.lora))
  return {t.producer: t.reads for t in rows if t.producer}


def op_costs(cfg: model.ModelConfig, batch: int, seq: int) -> dict[str, tuple[float, float]]:
  """XLA's (FLOPs, bytes accessed) of each producer op at these shapes, compile-only: to project op times on a
  device that is not here."""
  out = {}
  for op, (fn, args) in _op_calls(cfg, batch, seq, abstract=True).items():
    cost = fn.lower(*args).compile().cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out[op] = (float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)))
  return out


def profile_key(cfg: model.ModelConfig, batch: int, seq: int, group_size: int) -> str:
  shape = {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim")}
  ident = {"model": shape, "batch": [batch, seq], "dtype": cfg.dtype, "group": group_size,
           "backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "version": PROFILE_VERSION}
  if cfg.lora is not None:  # its projections carry adapters and it has one more op
    ident["lora"] = [cfg.lora.rank, list(cfg.lora.targets)]
  ident = json.dumps(ident, sort_keys=True)
  return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _offload_roundtrip(shape, dt) -> tuple[Callable, tuple]:
  dev = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  back = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  return (lambda x: jax.device_put(jax.device_put(x, host), back)), (jnp.zeros(shape, dt),)


def profile_ops(cfg: model.ModelConfig, batch: int, seq: int, group_size: int = 64, reps: int = 7,
                cache_dir: str | None = None, formats: Sequence[str] | None = None) -> dict:
  """Measured seconds (median of reps) per producer op, per unit and format for encode+decode (`formats` only where
  given: the memory manager's own L format; the rest measured when asked for), and per unit for a host round trip
  where offloading is supported; each median's relative standard error beside it (`ops_err`, `codec_err`); cached
  on disk by model shape, batch, dtype and backend."""
  cache = JsonStore(cache_dir or runtime.cache_dir("profiles"), profile_key(cfg, batch, seq, group_size), "op profile")
  formats = tuple(codec.FORMATS if formats is None else formats)
  out = cache.load()
  missing = lambda p: [f for f in formats if any(f not in p["codec"].get(k, {}) for k in U.LOWP_UNITS)]
  if out is not None and not missing(out):
    return out
  sizes = U.dims(cfg, batch, seq)
  if out is None:  # compiled together first, then timed one at a time
    timed = {op: _median_time(fn, args, reps) for op, (fn, args) in _compile_all(_op_calls(cfg, batch, seq)).items()}
    out = {"ops": {op: t for op, (t, _) in timed.items()}, "ops_err": {op: e for op, (_, e) in timed.items()},
           "codec": {}, "codec_err": {}, "offload": {}}
    if model.offload_supported():
      for kind in U.UNITS:
        out["offload"][kind] = _median_time(*_offload_roundtrip(U.shape(kind, sizes), cfg.compute_dtype), reps)[0]
  roundtrip = lambda x, f: codec.decode(*codec.encode(x, f, group_size), x.shape, x.dtype, f)
  calls = {(fmt, kind): (jax.jit(functools.partial(roundtrip, f=fmt)),
                         (jnp.zeros(U.shape(kind, sizes), cfg.compute_dtype) + 0.5,))
           for fmt in missing(out) for kind in U.LOWP_UNITS}
  for (fmt, kind), (rt, args) in _compile_all(calls).items():
    t, e = _median_time(rt, args, reps)
    out["codec"].setdefault(kind, {})[fmt] = t
    out.setdefault("codec_err", {}).setdefault(kind, {})[fmt] = e
  cache.save(out)
  return out


def enumerate_units(cfg: model.ModelConfig, batch: int, seq: int, group_size: int = 64, profile: dict | None = None,
                    fmt: str = "int8", lowp_kinds: Sequence[str] = ()) -> list[Unit]:
  """Every layer's units with bytes as H (compute dtype) and as L (codes + scales in `fmt`; only lowp_kinds where
  given: memory.lowp_kinds), and measured times."""
  sizes = U.dims(cfg, batch, seq)
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  ops = (profile or {}).get("ops", {})
  codecs = (profile or {}).get("codec", {})
  offload = (profile or {}).get("offload", {})
  # with LoRA the units of its table (a projection input no adapter reads is none, x A is one); the layer input's
  # L then only where every unit of the full table is one (LayerPolicy's check that nothing else reruns sees those)
  rows = {t.name: t for t in U.table("xla", lora.adapted_inputs(cfg.lora))}
  kinds = [k for k, t in rows.items() if t.unit]
  whole = set(U.UNITS) <= set(kinds)
  units = []
  for layer in range(cfg.num_hidden_layers):
    for kind in kinds:
      shape = U.shape(kind, sizes)
      lowp = rows[kind].lowp and (not lowp_kinds or kind in lowp_kinds) and (kind != U.LAYER_INPUT or whole)
      units.append(Unit(layer, kind, shape, math.prod(shape) * itemsize,
                        codec.code_bytes(shape, group_size, fmt) if lowp else None,
                        ops.get(rows[kind].producer, 0.0), codecs.get(kind, {}).get(fmt, 0.0) if lowp else 0.0,
                        offload.get(kind)))
  return units
