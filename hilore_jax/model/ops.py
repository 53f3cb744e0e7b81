"""A decoder layer's producer ops: the functions computing the tensors of `units.TABLE`, the one statement of the
layer's math.

Every op is (cfg, layer params, tensors by name, layer context, reads) -> the tensor it produces. The layer
(model/layer.py) is these ops in the table's order; the memory profile times each alone (`OPS`, filled by `@op` as
they are defined here); the decode step (model/cache.py) runs them around its own attention. `reads` is how an op
keeps its inputs for backward and names what it produces: `EXACT` (every input as itself, nothing named, one
projection at a time: what the profile times), or the layer's reads of its mode (L units as codes, checkpoint names,
taps).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from hilore_jax.model import lora, lowp
from hilore_jax.model import units as U
from hilore_jax.model.attention import (Segments, attention_context, attention_probs, blockwise_kernel, fused_attention,
                                       segment_mask)
from hilore_jax.model.config import ModelConfig
from hilore_jax.model.rope import apply_rope, rope_cos_sin


def rms_norm(x_BTD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, cast back before the weight (as transformers does)."""
  x32 = x_BTD.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return over_positions(jnp.multiply, y.astype(x_BTD.dtype), w_D.astype(x_BTD.dtype))


def over_positions(op, x, p):
  """op(x, p) for a parameter p of x's trailing shape, applied over x as [positions, *p.shape]: p's gradient then
  sums over one leading axis (on a packed buffer's [1, L, D] XLA:CPU summed over the middle axis of three, ~20x
  slower than over a padded [B, T, D]'s leading axes; issue 45)."""
  return op(x.reshape(-1, *p.shape), p).reshape(x.shape)


class LayerCtx(NamedTuple):
  """What every layer reads besides its own params and input: RoPE tables and the attention mask, as [B, T, S]
  and as its parts (the blockwise kernel builds each block's mask from them, never the T x S one)."""

  cos_BTH: jax.Array
  sin_BTH: jax.Array
  mask_BTS: jax.Array
  key_mask_BS: jax.Array | None = None  # valid keys; None: every key
  query_offset: jax.Array | int = 0  # query t sits at key slot query_offset + t (a cache index when decoding)
  segments: Segments | None = None  # packed rows: a query sees only its own (or prefix) segment's keys


def layer_ctx(cfg: ModelConfig, positions_BT: jax.Array, key_mask_BS: jax.Array, query_offset=0,
              segments: Segments | None = None) -> LayerCtx:
  """RoPE tables and the causal mask of queries at key slots query_offset.. over the valid keys of key_mask_BS
  (and, packed, of their own segment: positions_BT then restart at each one)."""
  T, S = positions_BT.shape[1], key_mask_BS.shape[1]
  key_mask_BS = key_mask_BS.astype(bool)
  slot_T = query_offset + jnp.arange(T)
  mask_BTS = (jnp.arange(S)[None, :] <= slot_T[:, None])[None] & key_mask_BS[:, None, :]
  if segments is not None:
    mask_BTS = mask_BTS & segment_mask(segments)
  return LayerCtx(*rope_cos_sin(cfg, positions_BT), mask_BTS, key_mask_BS, jnp.asarray(query_offset, jnp.int32),
                  segments)


def fused_kernel(cfg: ModelConfig, ctx: LayerCtx, k_BSKH: jax.Array) -> tuple:
  """(the fused kernel of cfg.attention as fn(q, k, v, *args), its args besides q, k, v from the layer context)."""
  if cfg.attention == "blockwise":
    key_mask_BS = jnp.ones(k_BSKH.shape[:2], bool) if ctx.key_mask_BS is None else ctx.key_mask_BS
    seg = ctx.segments
    return (blockwise_kernel(cfg.attention_block_q, cfg.attention_block_k, seg.max_len if seg else None),
            (key_mask_BS, jnp.asarray(ctx.query_offset, jnp.int32), *(seg.arrays() if seg else ())))
  return fused_attention, (ctx.mask_BTS,)


# ----------------------------------------------------------------------------- projections


def _proj(x, w, b, spec):
  y = jnp.einsum(spec, x, w.astype(x.dtype))
  return y if b is None else over_positions(jnp.add, y, b.astype(x.dtype))


# the projections reading each input unit, in lora.TARGETS' order: a layer computes them together (an L input is
# encoded once for all of them)
GROUPS: dict[str, tuple[str, ...]] = {u: tuple(t for t, tg in lora.TARGETS.items() if tg.unit == u)
                                      for u in U.PROJECTION_INPUTS}


def projections(cfg: ModelConfig, p: dict, x, targets: tuple[str, ...], km: tuple) -> tuple:
  """Each target's projection of x (bias and, where cfg runs them, LoRA adapters included); km: (x's Keep or None,
  its probe mix): an L x is read in backward from its code (model/lowp.py)."""
  tgs = [lora.TARGETS[t] for t in targets]
  ws = tuple(p[tg.block][tg.weight] for tg in tgs)
  bs = tuple(p[tg.block].get(tg.bias) for tg in tgs)
  specs = tuple(tg.spec for tg in tgs)
  adapters = lora.layer_adapters(cfg, p)
  if adapters is None:
    return lowp.projections(_proj, x, km, ws, bs, specs)
  # LoRA: the frozen projections' backward reads no x (no weight gradient); the adapters' A gradients do
  return lora.projections(cfg, adapters, targets, x, km, tuple(_proj(x, w, b, s) for w, b, s in zip(ws, bs, specs)))


class Reads:
  """Exact reads: every input kept as itself, nothing named, each projection alone (what the profile times)."""

  def keep(self, unit: str, size: int) -> tuple:
    """(Keep or None, probe mix or None) of an input of that unit whose last axis has `size` (lowp.keeper)."""
    return None, None

  def km(self, unit: str, x: jax.Array) -> tuple:
    return self.keep(unit, x.shape[-1])

  def tag(self, name: str, x: jax.Array) -> jax.Array:
    """x, as the tensor `name` of the table (the layer's reads name it for the remat policy)."""
    return x

  def project(self, cfg: ModelConfig, p: dict, x, target: str) -> jax.Array:
    """Target's projection of x (x: the tensor of the target's input unit)."""
    return projections(cfg, p, x, (target,), self.km(lora.TARGETS[target].unit, x))[0]


EXACT = Reads()
Op = Callable[..., jax.Array]
OPS: dict[str, Op] = {}  # every producer op by its name in units.TABLE (and LoRA's x A op): the profile's list


def op(fn: Op) -> Op:
  """Register a producer op under its function's name."""
  OPS[fn.__name__] = fn
  return fn


# ----------------------------------------------------------------------------- the ops, in the table's order


def _pre_norm(c: ModelConfig, p: dict, t: dict, r: Reads, unit_in: str, weight: str, unit_out: str):
  """RMSNorm of t[unit_in] by p[weight], read in backward as unit_in's policy says (an L code, or kept)."""
  x = t[unit_in]
  return r.tag(unit_out, lowp.norm(rms_norm, x, p[weight], c.rms_norm_eps, r.km(unit_in, x)))


@op
def attn_norm_op(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return _pre_norm(c, p, t, r, U.LAYER_INPUT, "attn_norm_D", U.ATTN_NORM)


@op
def q_proj(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.Q, apply_rope(r.project(c, p, t[U.ATTN_NORM], "q"), ctx.cos_BTH, ctx.sin_BTH))


@op
def k_proj(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.K, apply_rope(r.project(c, p, t[U.ATTN_NORM], "k"), ctx.cos_BTH, ctx.sin_BTH))


@op
def v_proj(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.V, r.project(c, p, t[U.ATTN_NORM], "v"))


@op
def scores(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.ATTN_PROBS, attention_probs(t[U.Q], t[U.K], ctx.mask_BTS))


@op
def pv(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.ATTN_CTX, attention_context(t[U.ATTN_PROBS], t[U.V]))


@op
def attn(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  """The fused kernel (units.FUSED_ATTN): q, k, v -> context; its backward reads q, k, v as kept."""
  q, k, v = t[U.Q], t[U.K], t[U.V]
  fn, args = fused_kernel(c, ctx, k)
  kms = [r.km(U.Q, q), r.km(U.K, k), r.km(U.V, v)]
  if all(m[0] is None for m in kms):
    return r.tag(U.ATTN_CTX, fn(q, k, v, *args))
  none = (None,) * len(args)
  return r.tag(U.ATTN_CTX, lowp.apply(fn, tuple(m[0] for m in kms) + none, (q, k, v) + args,
                                      tuple(m[1] for m in kms) + none))


@op
def o_proj(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.MLP_INPUT, t[U.LAYER_INPUT] + r.tag(U.ATTN_OUT, r.project(c, p, t[U.ATTN_CTX], "o")))


@op
def mlp_norm_op(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return _pre_norm(c, p, t, r, U.MLP_INPUT, "mlp_norm_D", U.MLP_NORM)


@op
def gate_proj(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.MLP_GATE, r.project(c, p, t[U.MLP_NORM], "gate"))


@op
def up_proj(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.MLP_UP, r.project(c, p, t[U.MLP_NORM], "up"))


@op
def act(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  """silu(gate) * up; where gate or up is L, SiLU's derivative reads both from what is kept."""
  gate, up = t[U.MLP_GATE], t[U.MLP_UP]
  kg, ku = r.km(U.MLP_GATE, gate), r.km(U.MLP_UP, up)
  if kg[0] is None and ku[0] is None:
    return r.tag(U.MLP_DOWN_IN, r.tag(U.MLP_SILU, jax.nn.silu(gate)) * up)
  return r.tag(U.MLP_DOWN_IN, lowp.apply(lambda g, u: jax.nn.silu(g) * u, (kg[0], ku[0]), (gate, up),
                                         (kg[1], ku[1])))


@op
def down_proj(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  return r.tag(U.MLP_OUT, r.project(c, p, t[U.MLP_DOWN_IN], "down"))


@op
def lora_a(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  """LoRA's x A products as one tensor (units.LORA_OP): the layer computes them inside its projections."""
  return lora.xa_products(c, p[lora.KEY], t)


def attention(c: ModelConfig, p: dict, t: dict, ctx, r: Reads = EXACT):
  """The layer's attention context from q, k, v: the fused kernel's op, or scores then pv; with q, k, v or the
  probabilities L, one op whose backward reads them as kept (lowp.attention)."""
  if U.fused(c.attention):
    return attn(c, p, t, ctx, r)
  q, k, v = t[U.Q], t[U.K], t[U.V]
  kms = [r.km(U.Q, q), r.km(U.K, k), r.km(U.V, v), r.keep(U.ATTN_PROBS, k.shape[1])]
  if any(m[0] is not None for m in kms):
    return r.tag(U.ATTN_CTX, lowp.attention(q, k, v, ctx.mask_BTS, tuple(m[0] for m in kms),
                                            tuple(m[1] for m in kms)))
  return pv(c, p, {**t, U.ATTN_PROBS: scores(c, p, t, ctx, r)}, ctx, r)


# the ops around the attention, each with the tensor it produces, in order: the layer and the decode step run these
BEFORE_ATTENTION = ((U.ATTN_NORM, attn_norm_op), (U.Q, q_proj), (U.K, k_proj), (U.V, v_proj))
MLP_OPS = ((U.MLP_GATE, gate_proj), (U.MLP_UP, up_proj), (U.MLP_DOWN_IN, act), (U.MLP_OUT, down_proj))
AFTER_ATTENTION = ((U.MLP_INPUT, o_proj), (U.MLP_NORM, mlp_norm_op)) + MLP_OPS


# The units read in backward by their projections' weight gradients alone (lowp.apply's VJP of x @ W at the kept x:
# the input's cotangent is delta @ W^T, which never reads x), with the params (block, names) those projections own:
# an L error in such a unit lands in these weights' gradients and nowhere else (calibration's one-probe
# decomposition, memory/calibration.py)
WEIGHT_READS: dict[str, tuple[str, tuple[str, ...]]] = {
    u: (lora.TARGETS[ts[0]].block, tuple(lora.TARGETS[t].weight for t in ts)) for u, ts in GROUPS.items()}


def weight_read_leaves(cfg: ModelConfig) -> dict[str, tuple[tuple[str, str], ...]]:
  """WEIGHT_READS as paths within a layer's gradient: its projections' weights, or with LoRA (whose frozen weights
  have no gradient) their adapters' A, the only gradients that read the unit; a unit no adapter reads has none."""
  if cfg.lora is None:
    return {k: tuple((blk, n) for n in names) for k, (blk, names) in WEIGHT_READS.items()}
  return {k: tuple((t, "A") for t in GROUPS[k] if t in cfg.lora.targets) for k in WEIGHT_READS}
