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
  for name, fn in ops.AFTER_ATTENTION:
    t[name] = fn(cfg, p, t, ctx, r)
  return t[U.MLP_INPUT] + t[U.MLP_OUT], (taps if taps is not None else extra)
