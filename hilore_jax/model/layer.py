"""One pre-norm decoder layer: the producer ops of model/ops.py in the table's order, run in an explicit mode.

As MaxText's layers take a `model_mode`, the layer takes one mode value, whose type says what the pass is for:
`Train` (the gradient pass and plain forwards, under a remat policy, optionally after a shared prompt's keys),
`Probe` (calibration), `Taps` (every unit's tensor out) or `Prefill` (through a KV cache). The mode decides only how
the ops read their inputs for backward and what the layer returns besides its output; the math is the ops'.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hilore_jax.model import lora, lowp, ops
from hilore_jax.model import units as U
from hilore_jax.model.config import ModelConfig
from hilore_jax.model.ops import LayerCtx
from hilore_jax.model.policy import LayerPolicy


@dataclasses.dataclass(frozen=True)
class Train:
  """Each unit kept (H), recomputed (R) or coded (L, read in backward from its code) as `policy` says; with
  prefix_kv=(k [B, S0, K, H], v) the queries attend over those keys first, then their own (a shared prompt:
  model/shared.py). Returns the layer's own (k, v) besides its output."""

  policy: LayerPolicy | None = None
  prefix_kv: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Probe:
  """Calibration: every unit read in backward as exact + mix * (decoded - exact), codes of `fmt` in groups of
  group_size; mix [len(UNITS)] (or lowp.keeper's dict with error channels). Returns the layer's own (k, v)."""

  fmt: str
  group_size: int
  mix: Any


@dataclasses.dataclass(frozen=True)
class Taps:
  """Exact, returning each unit's tensor by name, token-major (read only inside a jitted statistic)."""


@dataclasses.dataclass(frozen=True)
class Prefill:
  """Write this step's k/v into cache=(k, v) [B, S, K, H] at slot `index` and attend over the cache (the query
  offset and key mask come with the layer context). Returns the written cache."""

  cache: tuple
  index: Any


Mode = Union[Train, Probe, Taps, Prefill]
TRAIN = Train()


class LayerReads(ops.Reads):
  """A mode's reads: L units as the policy's or probe's codes, the projections of one input together (one code),
  every tensor under its checkpoint name, and into `taps` where given."""

  def __init__(self, mode: Mode, dtype, taps: dict | None = None):
    policy = mode.policy if isinstance(mode, Train) else None
    probe = (mode.fmt, mode.group_size, mode.mix) if isinstance(mode, Probe) else None
    self._keep, self._dtype, self._taps, self._groups = lowp.keeper(policy, probe), dtype, taps, {}

  def keep(self, unit: str, size: int) -> tuple:
    return self._keep(unit, size, self._dtype)

  def tag(self, name: str, x: jax.Array) -> jax.Array:
    x = checkpoint_name(x, name)
    if self._taps is not None and name in U.UNITS:  # token-major: T second ([B, T, K, G, S] for the probabilities)
      axis = U.BY_NAME[name].shape.index("T")
      self._taps[name] = x if axis == 1 else jnp.moveaxis(x, axis, 1)
    return x

  def project(self, cfg: ModelConfig, p: dict, x, target: str) -> jax.Array:
    unit = lora.TARGETS[target].unit
    if unit not in self._groups:
      group = ops.GROUPS[unit]
      self._groups[unit] = dict(zip(group, ops.projections(cfg, p, x, group, self.km(unit, x))))
    return self._groups[unit][target]


def decoder_layer(cfg: ModelConfig, p: dict, x_BTD: jax.Array, ctx: LayerCtx, mode: Mode = TRAIN) -> tuple:
  """(the layer's output [B, T, D], what the mode returns besides) of one pre-norm decoder layer."""
  taps = {} if isinstance(mode, Taps) else None
  r = LayerReads(mode, x_BTD.dtype, taps)
  t = {U.LAYER_INPUT: r.tag(U.LAYER_INPUT, x_BTD)}
  for name, fn in ops.BEFORE_ATTENTION:
    t[name] = fn(cfg, p, t, ctx, r)
  extra = (t[U.K], t[U.V])
  if isinstance(mode, Prefill):
    ck, cv = (jax.lax.dynamic_update_slice(c, own.astype(c.dtype), (0, mode.index, 0, 0))
              for c, own in zip(mode.cache, extra))
    extra, t[U.K], t[U.V] = (ck, cv), ck.astype(t[U.Q].dtype), cv.astype(t[U.Q].dtype)
  elif isinstance(mode, Train) and mode.prefix_kv is not None:
    t[U.K], t[U.V] = (jnp.concatenate([pre.astype(own.dtype), own], axis=1) for pre, own in zip(mode.prefix_kv, extra))
  t[U.ATTN_CTX] = ops.attention(cfg, p, t, ctx, r)
  chunks = mlp_chunks(cfg, mode, x_BTD.shape[1])
  for name, fn in ops.AFTER_ATTENTION[:len(ops.AFTER_ATTENTION) - (len(ops.MLP_OPS) if chunks > 1 else 0)]:
    t[name] = fn(cfg, p, t, ctx, r)
  if chunks > 1:
    t[U.MLP_OUT] = _chunked_mlp(cfg, p, t[U.MLP_NORM], ctx, mode, chunks)
  return t[U.MLP_INPUT] + t[U.MLP_OUT], (taps if taps is not None else extra)


# what a chunked MLP recomputes inside its chunks: none of these may be kept (H, L or O) by the layer's policy
_MLP_INSIDE = frozenset({U.MLP_GATE, U.MLP_UP, U.MLP_SILU, U.MLP_DOWN_IN, U.MLP_OUT, U.LORA_XA})


def mlp_chunks(cfg: ModelConfig, mode: Mode, T: int) -> int:
  """Chunks of the sequence the layer's MLP runs in (1: whole). Only a Train layer whose policy recomputes the MLP
  (cfg.mlp_chunk_len > 0 and T longer): its backward then holds the MLP's [T, F] intermediates a chunk at a time."""
  policy = mode.policy if isinstance(mode, Train) else None
  if not cfg.mlp_chunk_len or T <= cfg.mlp_chunk_len or policy is None or not policy.remat:
    return 1
  # an L mlp_norm is read by the projections' backward from its code: made inside a chunk, it would never be kept
  if _MLP_INSIDE & (set(policy.save) | set(policy.lowp) | set(policy.offload)) or U.MLP_NORM in policy.lowp:
    return 1
  return -(-T // cfg.mlp_chunk_len)


def _chunked_mlp(cfg: ModelConfig, p: dict, x_BTD: jax.Array, ctx: LayerCtx, mode: Train, chunks: int) -> jax.Array:
  """The MLP's output [B, T, D] from its normed input, over `chunks` slices of the sequence, each rematerialised on
  its own: the backward reruns one chunk's gate/up and holds its [B, T / chunks, F] intermediates, not the whole
  sequence's. Scanned, that is the difference: inside a layer loop's body XLA:CPU kept six [T, F] intermediates of
  the MLP's backward where the same layer unrolled kept three (docs/benchmarks.md#the-mlp-in-chunks-of-the-sequence)."""
  B, T, D = x_BTD.shape
  size = -(-T // chunks)
  x_CBSD = jnp.pad(x_BTD, ((0, 0), (0, chunks * size - T), (0, 0))).reshape(B, chunks, size, D).swapaxes(0, 1)

  def one(_, xs):
    c, x_BSD = xs
    # a chunk's own LoRA dropout draws (the same key in every chunk would repeat one mask along the sequence)
    pc = {**p, lora.KEY: lora.fold_dropout(p[lora.KEY], c)} if lora.KEY in p else p
    r, t = LayerReads(mode, x_BSD.dtype), {U.MLP_NORM: x_BSD}
    for name, fn in ops.MLP_OPS:
      t[name] = fn(cfg, pc, t, ctx, r)
    return None, t[U.MLP_OUT]

  _, out_CBSD = jax.lax.scan(jax.checkpoint(one), None, (jnp.arange(chunks), x_CBSD))
  return out_CBSD.swapaxes(0, 1).reshape(B, chunks * size, -1)[:, :T]
