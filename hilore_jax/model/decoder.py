"""Qwen2/Llama decoder as pure functions of a params pytree, with per-layer remat policies.

The model around its layers: embedding, the layer stack (each layer under its own remat policy, runs of one policy
scanned), final norm and logits. A layer is model/layer.py's `decoder_layer` in a mode, composed of the producer ops
of model/ops.py (`OPS`, what the memory profile times); RoPE is in model/rope.py, random params in model/init.py.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from hilore_jax.model import key_blocks, lora
from hilore_jax.model.attention import Segments
from hilore_jax.model.config import ModelConfig
from hilore_jax.model.layer import Probe, Taps, Train, decoder_layer
from hilore_jax.model.layers import layer_at, run_layers, stack_layers
from hilore_jax.model.ops import OPS, WEIGHT_READS, layer_ctx, rms_norm, weight_read_leaves  # noqa: F401
from hilore_jax.model.policy import NO_REMAT, LayerPolicy, Residual, remat, saved_residuals, uniform


def layer_params(params: dict, layer: int) -> dict:
  """One layer's params (or gradients: any pytree shaped like params), from either layout."""
  return layer_at(params["layers"], layer)


def num_layers(params: dict) -> int:
  layers = params["layers"]
  return jax.tree_util.tree_leaves(layers)[0].shape[0] if isinstance(layers, dict) else len(layers)


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
                  taps: dict | None = None, probe=None, segment_ids_BT=None,
                  max_segment_len: int | None = None) -> jax.Array:
  """Final-norm hidden states [B, T, D]; each layer runs under its own remat policy.

  Consecutive layers with the same policy run as one `lax.scan` (run_layers), so compile time grows with the
  number of policy runs, not with depth; params in the train layout (stacked) scan without a copy. taps, if a
  dict, receives each unit's tensor for every layer, stacked [L, B, T, ...] (no remat then). probe=(format,
  group size, mix [L, len(UNITS)]) runs every layer without remat, each unit read in backward as exact + mix *
  (decoded - exact): one program measures the gradient error of any set of L units (calibration).
  segment_ids_BT: packed rows (several sequences end to end, give their positions_BT): a position attends only to
  earlier positions of its own segment id; max_segment_len: no segment is longer (ids ascending along a row), so
  blockwise attention visits only the band of keys that allows.
  """
  B, T = input_ids_BT.shape
  if attention_mask_BT is None:
    attention_mask_BT = jnp.ones((B, T), jnp.int32)
  if positions_BT is None:
    positions_BT = default_positions(attention_mask_BT)
  policies = tuple(layer_policies) if layer_policies is not None else uniform(cfg.num_hidden_layers, NO_REMAT)
  if len(policies) != cfg.num_hidden_layers:
    raise ValueError(f"got {len(policies)} layer policies for {cfg.num_hidden_layers} layers")
  segments = None
  if segment_ids_BT is not None:
    key_blocks.check(segment_ids_BT, attention_mask_BT, max_segment_len)
    segments = Segments(segment_ids_BT, segment_ids_BT, segment_ids_BT, max_segment_len)
  ctx = layer_ctx(cfg, positions_BT, attention_mask_BT, segments=segments)
  x = embed(cfg, params, input_ids_BT)
  if taps is not None:
    x, taps_L = jax.lax.scan(lambda x, p: decoder_layer(cfg, p, x, ctx, Taps()), x, stack_layers(params["layers"]))
    taps.update(taps_L)
  elif probe is not None:
    fmt, group_size, mix_LU = probe
    x, _ = jax.lax.scan(lambda x, pm: (decoder_layer(cfg, pm[0], x, ctx, Probe(fmt, group_size, pm[1]))[0], None),
                        x, (stack_layers(params["layers"]), mix_LU))
  else:
    x = run_layers(lambda policy: lambda p, x, ctx: decoder_layer(cfg, p, x, ctx, Train(policy))[0], policies,
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
    layer = remat(lambda p, x, policy=policy: decoder_layer(cfg, frozen(p), x, ctx, Train(policy))[0], policy)
    out.append(saved_residuals(lambda p, x, layer=layer: jnp.sum(layer(p, x)), p, x))
    x = layer(p, x)
  return out


def forward(cfg: ModelConfig, params: dict, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
            positions: jax.Array | None = None, layer_policies: Sequence[LayerPolicy] | None = None) -> jax.Array:
  """Logits [B, T, V] in float32."""
  h = hidden_states(cfg, params, input_ids, attention_mask, positions_BT=positions, layer_policies=layer_policies)
  return logits(cfg, params, h)
