"""Qwen2/Llama decoder as pure functions of a params pytree, with per-layer remat policies.

A layer is a sequence of producer ops (`OPS`, the functions the memory profile times) over the tensors of
`units.TABLE`; each tensor is tagged with its checkpoint name so a per-layer policy decides what backward keeps.
Over the usual module size on purpose: the layer reads top to bottom as the table's dataflow, in one place.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hilore_jax.model import lora, lowp
from hilore_jax.model import units as U
from hilore_jax.model.attention import (Segments, attention_context, attention_probs, blockwise_kernel, fused_attention,
                                       segment_mask)
from hilore_jax.model.config import ModelConfig
from hilore_jax.model.layers import (is_stacked, layer_at, policy_runs, run_layers, stack_layers, stacked,  # noqa: F401
                                     unstack_layers, unstacked)
from hilore_jax.model.policy import NO_REMAT, LayerPolicy, Residual, remat, saved_residuals, uniform

# ----------------------------------------------------------------------------- params


def init_params(cfg: ModelConfig, rng: jax.Array, init_std: float = 0.02) -> dict:
  """Random params (normal(0, init_std) weights, zero biases, unit norms) in cfg.param_dtype."""
  D, F, N, KV, H = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                    cfg.num_key_value_heads, cfg.head_size)
  dt = cfg.params_dtype
  keys = iter(jax.random.split(rng, 2 + 7 * cfg.num_hidden_layers))

  def normal(shape):
    return (init_std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

  layers = []
  for _ in range(cfg.num_hidden_layers):
    attn = {"wq_DNH": normal((D, N, H)), "wk_DKH": normal((D, KV, H)), "wv_DKH": normal((D, KV, H)),
            "wo_NHD": normal((N, H, D))}
    if cfg.attention_bias:
      attn.update(bq_NH=jnp.zeros((N, H), dt), bk_KH=jnp.zeros((KV, H), dt), bv_KH=jnp.zeros((KV, H), dt))
    if cfg.o_proj_bias:
      attn["bo_D"] = jnp.zeros((D,), dt)
    mlp = {"wgate_DF": normal((D, F)), "wup_DF": normal((D, F)), "wdown_FD": normal((F, D))}
    if cfg.mlp_bias:
      mlp.update(bgate_F=jnp.zeros((F,), dt), bup_F=jnp.zeros((F,), dt), bdown_D=jnp.zeros((D,), dt))
    layers.append({"attn": attn, "mlp": mlp, "attn_norm_D": jnp.ones((D,), dt),
                   "mlp_norm_D": jnp.ones((D,), dt)})
  params = {"embed_VD": normal((cfg.vocab_size, D)), "layers": layers, "final_norm_D": jnp.ones((D,), dt)}
  if not cfg.tie_word_embeddings:
    params["lm_head_DV"] = normal((D, cfg.vocab_size))
  return params if cfg.lora is None else lora.add_adapters(cfg, params, rng)


def layer_params(params: dict, layer: int) -> dict:
  """One layer's params (or gradients: any pytree shaped like params), from either layout."""
  return layer_at(params["layers"], layer)


def num_layers(params: dict) -> int:
  layers = params["layers"]
  return jax.tree_util.tree_leaves(layers)[0].shape[0] if isinstance(layers, dict) else len(layers)


# ----------------------------------------------------------------------------- pieces


def rms_norm(x_BTD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, cast back before the weight (as transformers does)."""
  x32 = x_BTD.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return w_D.astype(x_BTD.dtype) * y.astype(x_BTD.dtype)


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


def _proj(x, w, b, spec):
  y = jnp.einsum(spec, x, w.astype(x.dtype))
  return y if b is None else y + b.astype(x.dtype)


def _adapted(c: ModelConfig, p: dict, target: str, x, y):
  """y (a frozen projection of x) plus its LoRA adapter's output where c runs adapters (model/lora.py)."""
  ad = lora.layer_adapters(c, p)
  return y if ad is None else lora.projections(c, ad, (target,), x, (None, None), (y,))[0]




# The units read in backward by their projections' weight gradients alone (lowp.apply's VJP of x @ W at the kept x:
# the input's cotangent is delta @ W^T, which never reads x), with the params (block, names) those projections own:
# an L error in such a unit lands in these weights' gradients and nowhere else (calibration's one-probe
# decomposition, memory/calibration.py)
WEIGHT_READS: dict[str, tuple[str, tuple[str, ...]]] = {
    U.ATTN_NORM: ("attn", ("wq_DNH", "wk_DKH", "wv_DKH")), U.ATTN_CTX: ("attn", ("wo_NHD",)),
    U.MLP_NORM: ("mlp", ("wgate_DF", "wup_DF")), U.MLP_DOWN_IN: ("mlp", ("wdown_FD",))}


def weight_read_leaves(cfg: ModelConfig) -> dict[str, tuple[tuple[str, str], ...]]:
  """WEIGHT_READS as paths within a layer's gradient: its projections' weights, or with LoRA (whose frozen weights
  have no gradient) their adapters' A, the only gradients that read the unit; a unit no adapter reads has none."""
  if cfg.lora is None:
    return {k: tuple((blk, n) for n in names) for k, (blk, names) in WEIGHT_READS.items()}
  return {k: tuple((t, "A") for t in cfg.lora.targets if lora.TARGETS[t].unit == k) for k in WEIGHT_READS}


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
    return (blockwise_kernel(cfg.attention_block_q, cfg.attention_block_k),
            (key_mask_BS, jnp.asarray(ctx.query_offset, jnp.int32), *(ctx.segments or ())))
  return fused_attention, (ctx.mask_BTS,)


def _fused(cfg: ModelConfig, q, k, v, ctx: LayerCtx) -> jax.Array:
  fn, args = fused_kernel(cfg, ctx, k)
  return fn(q, k, v, *args)


# The producer ops of units.TABLE, each (cfg, layer params, tensors by name, ctx) -> its tensor. The memory
# profile times exactly these; the layer below computes the same math (with L projections where the policy says).
# A LoRA config's projections carry their adapters (and its table one more op, units.LORA_OP: every x A).
OPS = {
    "attn_norm_op": lambda c, p, t, x: rms_norm(t[U.LAYER_INPUT], p["attn_norm_D"], c.rms_norm_eps),
    "q_proj": lambda c, p, t, x: apply_rope(_adapted(c, p, "q", t[U.ATTN_NORM], _proj(
        t[U.ATTN_NORM], p["attn"]["wq_DNH"], p["attn"].get("bq_NH"), "btd,dnh->btnh")), x.cos_BTH, x.sin_BTH),
    "k_proj": lambda c, p, t, x: apply_rope(_adapted(c, p, "k", t[U.ATTN_NORM], _proj(
        t[U.ATTN_NORM], p["attn"]["wk_DKH"], p["attn"].get("bk_KH"), "btd,dkh->btkh")), x.cos_BTH, x.sin_BTH),
    "v_proj": lambda c, p, t, x: _adapted(c, p, "v", t[U.ATTN_NORM], _proj(
        t[U.ATTN_NORM], p["attn"]["wv_DKH"], p["attn"].get("bv_KH"), "btd,dkh->btkh")),
    "scores": lambda c, p, t, x: attention_probs(t[U.Q], t[U.K], x.mask_BTS),
    "pv": lambda c, p, t, x: attention_context(t[U.ATTN_PROBS], t[U.V]),
    U.FUSED_ATTN: lambda c, p, t, x: _fused(c, t[U.Q], t[U.K], t[U.V], x),
    "o_proj": lambda c, p, t, x: t[U.LAYER_INPUT] + _adapted(c, p, "o", t[U.ATTN_CTX], _proj(
        t[U.ATTN_CTX], p["attn"]["wo_NHD"], p["attn"].get("bo_D"), "btnh,nhd->btd")),
    "mlp_norm_op": lambda c, p, t, x: rms_norm(t[U.MLP_INPUT], p["mlp_norm_D"], c.rms_norm_eps),
    "gate_proj": lambda c, p, t, x: _adapted(c, p, "gate", t[U.MLP_NORM], _proj(
        t[U.MLP_NORM], p["mlp"]["wgate_DF"], p["mlp"].get("bgate_F"), "btd,df->btf")),
    "up_proj": lambda c, p, t, x: _adapted(c, p, "up", t[U.MLP_NORM], _proj(
        t[U.MLP_NORM], p["mlp"]["wup_DF"], p["mlp"].get("bup_F"), "btd,df->btf")),
    "act": lambda c, p, t, x: jax.nn.silu(t[U.MLP_GATE]) * t[U.MLP_UP],
    "down_proj": lambda c, p, t, x: _adapted(c, p, "down", t[U.MLP_DOWN_IN], _proj(
        t[U.MLP_DOWN_IN], p["mlp"]["wdown_FD"], p["mlp"].get("bdown_D"), "btf,fd->btd")),
    U.LORA_OP: lambda c, p, t, x: lora.xa_products(c, p[lora.KEY], t),
}


def decoder_layer(cfg: ModelConfig, p: dict, x_BTD, ctx: LayerCtx, kv_cache=None, cache_index=None,
                  policy: LayerPolicy | None = None, taps: dict | None = None, probe=None, prefix_kv=None):
  """One pre-norm decoder layer; with kv_cache=(k, v) writes this step's k/v at cache_index first; with
  prefix_kv=(k [B, S0, K, H], v) attends over those keys first, then its own (a shared prompt: model/shared.py).

  Each L unit of the policy is kept by the op that reads it in backward (model/lowp.py); probe=(format, group
  size, mix [len(UNITS)]) instead reads every unit as exact + mix * (decoded - exact) (calibration). taps, if
  given, receives each unit's tensor (read only inside a jitted statistic).
  """
  tap = (lambda name, t: taps.__setitem__(name, t)) if taps is not None else (lambda name, t: None)
  keep = lowp.keeper(policy, probe)
  km = lambda unit, t: keep(unit, t.shape[-1], x_BTD.dtype)
  adapters = lora.layer_adapters(cfg, p)

  def proj(x, unit, ws, bs, specs, targets):
    if adapters is None:
      return lowp.projections(_proj, x, km(unit, x), ws, bs, specs)
    # LoRA: the frozen projections' backward reads no x (no weight gradient); the adapters' A gradients do
    return lora.projections(cfg, adapters, targets, x, km(unit, x),
                            tuple(_proj(x, w, b, s) for w, b, s in zip(ws, bs, specs)))

  norm = lambda x, unit, w: lowp.norm(rms_norm, x, w, cfg.rms_norm_eps, km(unit, x))
  x_BTD = checkpoint_name(x_BTD, U.LAYER_INPUT)
  tap(U.LAYER_INPUT, x_BTD)
  a = p["attn"]
  h = checkpoint_name(norm(x_BTD, U.LAYER_INPUT, p["attn_norm_D"]), U.ATTN_NORM)
  tap(U.ATTN_NORM, h)
  q, k, v = proj(h, U.ATTN_NORM, (a["wq_DNH"], a["wk_DKH"], a["wv_DKH"]), (a.get("bq_NH"), a.get("bk_KH"),
                                                                           a.get("bv_KH")),
                 ("btd,dnh->btnh", "btd,dkh->btkh", "btd,dkh->btkh"), ("q", "k", "v"))
  v = checkpoint_name(v, U.V)
  q = checkpoint_name(apply_rope(q, ctx.cos_BTH, ctx.sin_BTH), U.Q)
  k = checkpoint_name(apply_rope(k, ctx.cos_BTH, ctx.sin_BTH), U.K)
  for name, t in ((U.Q, q), (U.K, k), (U.V, v)):
    tap(name, t)
  new_cache = None
  if kv_cache is not None:
    ck, cv = kv_cache
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, cache_index, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, cache_index, 0, 0))
    new_cache, k, v = (ck, cv), ck.astype(q.dtype), cv.astype(q.dtype)
  if prefix_kv is not None:
    k, v = (jnp.concatenate([pre.astype(own.dtype), own], axis=1) for pre, own in zip(prefix_kv, (k, v)))
  kms = [km(U.Q, q), km(U.K, k), km(U.V, v)]
  if U.fused(cfg.attention):  # the fused kernel's backward reads q, k, v as kept
    fn, args = fused_kernel(cfg, ctx, k)
    if kv_cache is None and any(c[0] is not None for c in kms):
      none = (None,) * len(args)
      ctx_BTNH = lowp.apply(fn, tuple(c[0] for c in kms) + none, (q, k, v) + args, tuple(c[1] for c in kms) + none)
    else:
      ctx_BTNH = fn(q, k, v, *args)
  else:
    kms.append(keep(U.ATTN_PROBS, k.shape[1], q.dtype))
    if kv_cache is None and any(c[0] is not None for c in kms):
      ctx_BTNH = lowp.attention(q, k, v, ctx.mask_BTS, tuple(c[0] for c in kms), tuple(c[1] for c in kms))
    else:
      probs = checkpoint_name(attention_probs(q, k, ctx.mask_BTS), U.ATTN_PROBS)
      tap(U.ATTN_PROBS, jnp.moveaxis(probs, 3, 1))  # taps are token-major: [B, T, K, G, S]
      ctx_BTNH = attention_context(probs, v)
  ctx_BTNH = checkpoint_name(ctx_BTNH, U.ATTN_CTX)
  tap(U.ATTN_CTX, ctx_BTNH)
  (attn_out,) = proj(ctx_BTNH, U.ATTN_CTX, (a["wo_NHD"],), (a.get("bo_D"),), ("btnh,nhd->btd",), ("o",))
  attn_out = checkpoint_name(attn_out, U.ATTN_OUT)
  x_BTD = checkpoint_name(x_BTD + attn_out, U.MLP_INPUT)
  tap(U.MLP_INPUT, x_BTD)
  m = p["mlp"]
  h = checkpoint_name(norm(x_BTD, U.MLP_INPUT, p["mlp_norm_D"]), U.MLP_NORM)
  tap(U.MLP_NORM, h)
  gate, up = proj(h, U.MLP_NORM, (m["wgate_DF"], m["wup_DF"]), (m.get("bgate_F"), m.get("bup_F")),
                  ("btd,df->btf", "btd,df->btf"), ("gate", "up"))
  gate, up = checkpoint_name(gate, U.MLP_GATE), checkpoint_name(up, U.MLP_UP)
  tap(U.MLP_GATE, gate)
  tap(U.MLP_UP, up)
  kg, ku = km(U.MLP_GATE, gate), km(U.MLP_UP, up)
  if kg[0] is not None or ku[0] is not None:  # SiLU's derivative reads gate and up from what is kept
    down_in = lowp.apply(lambda g, u: jax.nn.silu(g) * u, (kg[0], ku[0]), (gate, up), (kg[1], ku[1]))
  else:
    down_in = checkpoint_name(jax.nn.silu(gate), U.MLP_SILU) * up
  down_in = checkpoint_name(down_in, U.MLP_DOWN_IN)
  tap(U.MLP_DOWN_IN, down_in)
  (out,) = proj(down_in, U.MLP_DOWN_IN, (m["wdown_FD"],), (m.get("bdown_D"),), ("btf,fd->btd",), ("down",))
  out = checkpoint_name(out, U.MLP_OUT)
  return x_BTD + out, new_cache


def default_positions(attention_mask_BT: jax.Array) -> jax.Array:
  """Positions counting only real tokens, so left-padded rows start at 0 (as HF generate does)."""
  return jnp.maximum(jnp.cumsum(attention_mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def embed(cfg: ModelConfig, params: dict, input_ids_BT: jax.Array) -> jax.Array:
  return jnp.take(params["embed_VD"], input_ids_BT, axis=0).astype(cfg.compute_dtype)


def head_logits(h_BTD: jax.Array, w_DV: jax.Array) -> jax.Array:
  """h @ w in the compute dtype with float32 accumulation and result (a bf16 sum over D misranks close tokens)."""
  return jnp.einsum("btd,dv->btv", h_BTD, w_DV.astype(h_BTD.dtype), preferred_element_type=jnp.float32)


def logits(cfg: ModelConfig, params: dict, h_BTD: jax.Array) -> jax.Array:
  """Logits [B, T, V] in float32 from final hidden states."""
  return head_logits(h_BTD, lm_head_weight(cfg, params))


def lm_head_weight(cfg: ModelConfig, params: dict) -> jax.Array:
  """Output projection [D, V] (the transposed embedding when tied)."""
  return params["embed_VD"].T if cfg.tie_word_embeddings else params["lm_head_DV"]


def hidden_states(cfg: ModelConfig, params: dict, input_ids_BT: jax.Array, attention_mask_BT=None, *,
                  positions_BT=None, layer_policies: Sequence[LayerPolicy] | None = None,
                  taps: dict | None = None, probe=None, segment_ids_BT=None) -> jax.Array:
  """Final-norm hidden states [B, T, D]; each layer runs under its own remat policy.

  Consecutive layers with the same policy run as one `lax.scan` (run_layers), so compile time grows with the
  number of policy runs, not with depth; params in the train layout (stacked) scan without a copy. taps, if a
  dict, receives each unit's tensor for every layer, stacked [L, B, T, ...] (no remat then). probe=(format,
  group size, mix [L, len(UNITS)]) runs every layer without remat, each unit read in backward as exact + mix *
  (decoded - exact): one program measures the gradient error of any set of L units (calibration).
  segment_ids_BT: packed rows (several sequences end to end, give their positions_BT): a position attends only to
  earlier positions of its own segment id.
  """
  B, T = input_ids_BT.shape
  if attention_mask_BT is None:
    attention_mask_BT = jnp.ones((B, T), jnp.int32)
  if positions_BT is None:
    positions_BT = default_positions(attention_mask_BT)
  policies = tuple(layer_policies) if layer_policies is not None else uniform(cfg.num_hidden_layers, NO_REMAT)
  if len(policies) != cfg.num_hidden_layers:
    raise ValueError(f"got {len(policies)} layer policies for {cfg.num_hidden_layers} layers")
  segments = None if segment_ids_BT is None else Segments(segment_ids_BT, segment_ids_BT, segment_ids_BT)
  ctx = layer_ctx(cfg, positions_BT, attention_mask_BT, segments=segments)
  x = embed(cfg, params, input_ids_BT)
  if taps is not None:
    def tapped(x, p):
      t: dict = {}
      return decoder_layer(cfg, p, x, ctx, taps=t)[0], t

    x, taps_L = jax.lax.scan(tapped, x, stack_layers(params["layers"]))
    taps.update(taps_L)
  elif probe is not None:
    fmt, group_size, mix_LU = probe
    x, _ = jax.lax.scan(lambda x, pm: (decoder_layer(cfg, pm[0], x, ctx, probe=(fmt, group_size, pm[1]))[0], None),
                        x, (stack_layers(params["layers"]), mix_LU))
  else:
    x = run_layers(lambda policy: lambda p, x, ctx: decoder_layer(cfg, p, x, ctx, policy=policy)[0], policies,
                   params["layers"], x, ctx, cfg.scan_layers)
  return rms_norm(x, params["final_norm_D"], cfg.rms_norm_eps)


def layer_residuals(cfg: ModelConfig, params: dict, input_ids_BT: jax.Array,
                    layer_policies: Sequence[LayerPolicy]) -> list[list[Residual]]:
  """What backward keeps in each layer under its policy, with checkpoint names.

  Under the layer scan the same tensors are the scan's stacked outputs, whose names XLA's residual listing cannot
  see; each layer is therefore traced here on its own, on its real input (tests/model/test_model.py checks the scan
  keeps exactly these, stacked).
  """
  B, T = input_ids_BT.shape
  mask_BT = jnp.ones((B, T), jnp.int32)
  ctx = layer_ctx(cfg, default_positions(mask_BT), mask_BT)
  x = embed(cfg, params, input_ids_BT)
  out = []
  # a LoRA model differentiates its adapters alone (as the trainer's gradient does): its frozen weights stop here
  frozen = lora.stop_frozen if cfg.lora is not None else (lambda p: p)
  for i, policy in enumerate(layer_policies):
    p = layer_params(params, i)
    layer = remat(lambda p, x, policy=policy: decoder_layer(cfg, frozen(p), x, ctx, policy=policy)[0], policy)
    out.append(saved_residuals(lambda p, x, layer=layer: jnp.sum(layer(p, x)), p, x))
    x = layer(p, x)
  return out


def forward(cfg: ModelConfig, params: dict, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
            positions: jax.Array | None = None, layer_policies: Sequence[LayerPolicy] | None = None) -> jax.Array:
  """Logits [B, T, V] in float32."""
  h = hidden_states(cfg, params, input_ids, attention_mask, positions_BT=positions, layer_policies=layer_policies)
  return logits(cfg, params, h)
