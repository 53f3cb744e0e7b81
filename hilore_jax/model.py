"""Qwen2/Llama decoder as pure functions of a params pytree, with per-layer remat policies."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hilore_jax import codec, lowp
from hilore_jax.model_config import ModelConfig

# Per-layer tensors that backward may keep; the HiLoRe memory manager allocates these units.
LAYER_INPUT = "layer_input"      # residual stream entering the layer
ATTN_NORM = "attn_norm"          # RMSNorm output read by q/k/v projections (one unit)
Q, K, V = "q", "k", "v"          # q/k after RoPE, v
ATTN_PROBS = "attn_probs"        # softmax probabilities [B, N, T, S]
ATTN_CTX = "attn_ctx"            # attention output, the o_proj input
ATTN_OUT = "attn_out"            # o_proj output
MLP_INPUT = "mlp_input"          # residual stream after attention
MLP_NORM = "mlp_norm"            # RMSNorm output read by gate/up projections (one unit)
MLP_GATE, MLP_UP = "mlp_gate", "mlp_up"
MLP_SILU = "mlp_silu"            # silu(gate)
MLP_DOWN_IN = "mlp_down_in"      # silu(gate) * up, the down-projection input
MLP_OUT = "mlp_out"              # down-projection output
CHECKPOINT_NAMES = (LAYER_INPUT, ATTN_NORM, Q, K, V, ATTN_PROBS, ATTN_CTX, ATTN_OUT, MLP_INPUT, MLP_NORM,
                    MLP_GATE, MLP_UP, MLP_SILU, MLP_DOWN_IN, MLP_OUT)
# Units that can be kept as int8 (L): projection inputs, whose only backward use is the weight gradient.
LOWP_UNITS = (ATTN_NORM, ATTN_CTX, MLP_NORM, MLP_DOWN_IN)


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
  """How one layer keeps activations for backward.

  remat=False keeps everything (H). remat=True keeps the `save` names in compute dtype (H), the `lowp` units as
  low-precision codes plus scales (L, format per unit in `formats`, default int8), the `offload` names in host
  memory (O, accelerators only), and recomputes the rest (R).
  """

  remat: bool = False
  save: tuple[str, ...] = ()
  lowp: tuple[str, ...] = ()
  group_size: int = 64
  formats: tuple[str, ...] = ()  # one codec format per lowp unit; empty: all int8
  offload: tuple[str, ...] = ()

  def __post_init__(self):
    unknown = sorted(set(self.save) - set(CHECKPOINT_NAMES))
    if unknown:
      raise ValueError(f"unknown checkpoint names {unknown}; valid: {list(CHECKPOINT_NAMES)}")
    bad = sorted(set(self.lowp) - set(LOWP_UNITS))
    if bad:
      raise ValueError(f"units {bad} cannot be kept low-precision; L units: {list(LOWP_UNITS)}")
    if (self.save or self.lowp) and not self.remat:
      raise ValueError("LayerPolicy.save / lowp only apply when remat=True")
    both = sorted(set(self.save) & set(self.lowp))
    if both:
      raise ValueError(f"units {both} are both saved (H) and low-precision (L)")
    if self.formats and len(self.formats) != len(self.lowp):
      raise ValueError(f"LayerPolicy.formats has {len(self.formats)} entries for {len(self.lowp)} lowp units")
    for f in self.formats:
      if f not in codec.FORMATS:
        raise ValueError(f"unknown low-precision format {f!r}; choose one of {list(codec.FORMATS)}")
    unknown = sorted(set(self.offload) - set(CHECKPOINT_NAMES))
    if unknown:
      raise ValueError(f"unknown offload names {unknown}; valid: {list(CHECKPOINT_NAMES)}")
    if self.offload and not self.remat:
      raise ValueError("LayerPolicy.offload only applies when remat=True")
    both = sorted(set(self.offload) & (set(self.save) | set(self.lowp)))
    if both:
      raise ValueError(f"units {both} are both offloaded (O) and saved (H) or low-precision (L)")

  def format_of(self, unit: str) -> str:
    return self.formats[self.lowp.index(unit)] if self.formats else "int8"

  @property
  def saved_names(self) -> tuple[str, ...]:
    """Names the checkpoint policy keeps: H units and the codes/scales of L units."""
    return tuple(self.save) + tuple(n for u in self.lowp for n in lowp.code_names(u))


NO_REMAT = LayerPolicy(remat=False)
FULL_REMAT = LayerPolicy(remat=True)


def uniform_policies(cfg: ModelConfig, policy: LayerPolicy) -> tuple[LayerPolicy, ...]:
  """The same policy for every layer."""
  return (policy,) * cfg.num_hidden_layers


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
  return params


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


def _projections(x, unit: str, ws: tuple, bs: tuple, specs: tuple, policy: LayerPolicy | None):
  """Projections of one input; through the int8-residual custom VJP when the unit is L."""
  if policy is None or unit not in policy.lowp:
    return tuple(_proj(x, w, b, s) for w, b, s in zip(ws, bs, specs))
  ys = lowp.project(x, ws, specs, unit, policy.group_size, policy.format_of(unit))
  return tuple(y if b is None else y + b.astype(y.dtype) for y, b in zip(ys, bs))


def attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS) -> tuple[jax.Array, jax.Array]:
  """Grouped-query attention; softmax in float32. Returns (context [B,T,N,H], probs [B,K,G,T,S])."""
  B, T, N, H = q_BTNH.shape
  KV = k_BSKH.shape[2]
  q = q_BTNH.reshape(B, T, KV, N // KV, H)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH).astype(jnp.float32) / math.sqrt(H)
  scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(q_BTNH.dtype), ATTN_PROBS)
  ctx = jnp.einsum("bkgts,bskh->btkgh", probs, v_BSKH)
  return ctx.reshape(B, T, N, H), probs


def decoder_layer(cfg: ModelConfig, p: dict, x_BTD, cos_BTH, sin_BTH, mask_BTS, kv_cache=None, cache_index=None,
                  policy: LayerPolicy | None = None, taps: dict | None = None):
  """One pre-norm decoder layer; with kv_cache=(k, v) writes this step's k/v at cache_index first.

  taps, if given, receives each L-capable unit's tensor (for exposure; read only inside a jitted statistic).
  """
  tap = (lambda name, t: taps.__setitem__(name, t)) if taps is not None else (lambda name, t: None)
  x_BTD = checkpoint_name(x_BTD, LAYER_INPUT)
  a = p["attn"]
  h = checkpoint_name(rms_norm(x_BTD, p["attn_norm_D"], cfg.rms_norm_eps), ATTN_NORM)
  tap(ATTN_NORM, h)
  q, k, v = _projections(h, ATTN_NORM, (a["wq_DNH"], a["wk_DKH"], a["wv_DKH"]),
                         (a.get("bq_NH"), a.get("bk_KH"), a.get("bv_KH")),
                         ("btd,dnh->btnh", "btd,dkh->btkh", "btd,dkh->btkh"), policy)
  v = checkpoint_name(v, V)
  q = checkpoint_name(apply_rope(q, cos_BTH, sin_BTH), Q)
  k = checkpoint_name(apply_rope(k, cos_BTH, sin_BTH), K)
  new_cache = None
  if kv_cache is not None:
    ck, cv = kv_cache
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, cache_index, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, cache_index, 0, 0))
    new_cache, k, v = (ck, cv), ck.astype(q.dtype), cv.astype(q.dtype)
  ctx, _ = attention(q, k, v, mask_BTS)
  ctx = checkpoint_name(ctx, ATTN_CTX)
  tap(ATTN_CTX, ctx)
  (attn_out,) = _projections(ctx, ATTN_CTX, (a["wo_NHD"],), (a.get("bo_D"),), ("btnh,nhd->btd",), policy)
  attn_out = checkpoint_name(attn_out, ATTN_OUT)
  x_BTD = checkpoint_name(x_BTD + attn_out, MLP_INPUT)
  m = p["mlp"]
  h = checkpoint_name(rms_norm(x_BTD, p["mlp_norm_D"], cfg.rms_norm_eps), MLP_NORM)
  tap(MLP_NORM, h)
  gate, up = _projections(h, MLP_NORM, (m["wgate_DF"], m["wup_DF"]), (m.get("bgate_F"), m.get("bup_F")),
                          ("btd,df->btf", "btd,df->btf"), policy)
  gate, up = checkpoint_name(gate, MLP_GATE), checkpoint_name(up, MLP_UP)
  act = checkpoint_name(jax.nn.silu(gate), MLP_SILU)
  down_in = checkpoint_name(act * up, MLP_DOWN_IN)
  tap(MLP_DOWN_IN, down_in)
  (out,) = _projections(down_in, MLP_DOWN_IN, (m["wdown_FD"],), (m.get("bdown_D"),), ("btf,fd->btd",), policy)
  out = checkpoint_name(out, MLP_OUT)
  return x_BTD + out, new_cache


class OffloadUnsupported(RuntimeError):
  """Offloading (O) was asked for on a backend without separate host memory."""


def offload_supported() -> bool:
  """True on backends whose device has its own memory and a pinned_host memory kind (GPU, TPU)."""
  if jax.default_backend() == "cpu":
    return False  # CPU "device" memory already is host memory: offloading would move nothing
  return any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories())


def _remat_layer(cfg: ModelConfig, policy: LayerPolicy):
  fn = lambda p, x, cos, sin, mask: decoder_layer(cfg, p, x, cos, sin, mask, policy=policy)[0]
  if not policy.remat:
    return fn
  if policy.offload:
    if not offload_supported():
      raise OffloadUnsupported(
          f"offloading {list(policy.offload)} (O) is unsupported on the {jax.default_backend()} backend: it needs a "
          "device with its own memory and a pinned_host memory kind (GPU/TPU); use H, L or R here")
    pol = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(policy.saved_names), names_which_can_be_offloaded=list(policy.offload),
        offload_src="device", offload_dst="pinned_host")
    return jax.checkpoint(fn, policy=pol)
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*policy.saved_names))


def default_positions(attention_mask_BT: jax.Array) -> jax.Array:
  """Positions counting only real tokens, so left-padded rows start at 0 (as HF generate does)."""
  return jnp.maximum(jnp.cumsum(attention_mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def embed(cfg: ModelConfig, params: dict, input_ids_BT: jax.Array) -> jax.Array:
  return jnp.take(params["embed_VD"], input_ids_BT, axis=0).astype(cfg.compute_dtype)


def lm_head_weight(cfg: ModelConfig, params: dict) -> jax.Array:
  """Output projection [D, V] (the transposed embedding when tied)."""
  return params["embed_VD"].T if cfg.tie_word_embeddings else params["lm_head_DV"]


def hidden_states(cfg: ModelConfig, params: dict, input_ids_BT: jax.Array, attention_mask_BT=None, *,
                  positions_BT=None, layer_policies: Sequence[LayerPolicy] | None = None,
                  taps: list | None = None) -> jax.Array:
  """Final-norm hidden states [B, T, D]; each layer runs under its own remat policy.

  taps, if a list, gets one dict per layer of its L-capable units' tensors (layers then run without remat).
  """
  B, T = input_ids_BT.shape
  if attention_mask_BT is None:
    attention_mask_BT = jnp.ones((B, T), jnp.int32)
  if positions_BT is None:
    positions_BT = default_positions(attention_mask_BT)
  policies = tuple(layer_policies) if layer_policies is not None else uniform_policies(cfg, NO_REMAT)
  if len(policies) != cfg.num_hidden_layers:
    raise ValueError(f"got {len(policies)} layer policies for {cfg.num_hidden_layers} layers")
  causal_TT = jnp.tril(jnp.ones((T, T), bool))
  mask_BTS = causal_TT[None] & attention_mask_BT.astype(bool)[:, None, :]
  cos, sin = rope_cos_sin(cfg, positions_BT)
  x = embed(cfg, params, input_ids_BT)
  for p, policy in zip(params["layers"], policies):
    if taps is not None:
      taps.append({})
      x = decoder_layer(cfg, p, x, cos, sin, mask_BTS, taps=taps[-1])[0]
    else:
      x = _remat_layer(cfg, policy)(p, x, cos, sin, mask_BTS)
  return rms_norm(x, params["final_norm_D"], cfg.rms_norm_eps)


def forward(cfg: ModelConfig, params: dict, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
            positions: jax.Array | None = None, layer_policies: Sequence[LayerPolicy] | None = None) -> jax.Array:
  """Logits [B, T, V] in float32."""
  h = hidden_states(cfg, params, input_ids, attention_mask, positions_BT=positions, layer_policies=layer_policies)
  return jnp.einsum("btd,dv->btv", h, lm_head_weight(cfg, params).astype(h.dtype)).astype(jnp.float32)


# ----------------------------------------------------------------------------- KV cache


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> tuple:
  """Per-layer (k, v) buffers [B, S, K, H]."""
  shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_size)
  dt = dtype or cfg.compute_dtype
  return tuple((jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_hidden_layers))


def forward_cached(cfg: ModelConfig, params: dict, input_ids_BT, positions_BT, key_mask_BS, cache: tuple,
                   cache_index) -> tuple[jax.Array, tuple]:
  """Logits [B, T, V] for tokens placed at cache slots cache_index..+T, attending to valid earlier slots."""
  B, T = input_ids_BT.shape
  S = key_mask_BS.shape[1]
  slot_T = cache_index + jnp.arange(T)
  mask_BTS = (jnp.arange(S)[None, :] <= slot_T[:, None])[None] & key_mask_BS.astype(bool)[:, None, :]
  cos, sin = rope_cos_sin(cfg, positions_BT)
  x = embed(cfg, params, input_ids_BT)
  new_cache = []
  for p, kv in zip(params["layers"], cache):
    x, kv = decoder_layer(cfg, p, x, cos, sin, mask_BTS, kv, cache_index)
    new_cache.append(kv)
  h = rms_norm(x, params["final_norm_D"], cfg.rms_norm_eps)
  logits = jnp.einsum("btd,dv->btv", h, lm_head_weight(cfg, params).astype(h.dtype)).astype(jnp.float32)
  return logits, tuple(new_cache)
