"""A GRPO group's prompt computed once (issue 35): the decoder over a table of distinct prompts [U, P] and, per
row, its completion [B, N], which attends to its prompt's keys and values gathered by index, then to its own.

Exact: each completion query sees the same keys, values, positions and mask as in the unshared [B, P + N] pass
(the prompt's keys at slots 0..P-1, its own at P..P+N-1, causal), with either attention kernel (xla builds the
[B, N, P + N] mask, blockwise takes the key mask and the query offset P). Backward of the gather is a scatter-add,
so the G completions' gradients accumulate into their prompt's path by autodiff. The prompt's left-padding
queries see fewer keys here than unshared (none of the completion's), which only changes hidden states no valid
position ever reads.

Packed (issue 45, `packed_shared_hidden_states`): completions lie end to end in buffer rows [S, L] with segment ids;
each attends to its own prompt's keys in the whole table (flattened ahead of the buffer's keys, the other entries
masked by segment) and to its own segment's earlier keys, at the positions of the unshared pass.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from hilore_jax.model import key_blocks
from hilore_jax.model.config import ModelConfig
from hilore_jax.model.attention import Segments
from hilore_jax.model.decoder import default_positions, embed
from hilore_jax.model.layer import Train, decoder_layer
from hilore_jax.model.layers import run_layers
from hilore_jax.model.ops import layer_ctx, rms_norm
from hilore_jax.model.policy import NO_REMAT, LayerPolicy, uniform


def completion_ctx(cfg: ModelConfig, prompt_mask_BP: jax.Array, mask_BN: jax.Array):
  """The completion queries' layer context: positions and causal mask as rows P..P+N-1 of the unshared pass."""
  P = prompt_mask_BP.shape[1]
  mask_BN = mask_BN.astype(jnp.int32)
  lengths_B = jnp.sum(prompt_mask_BP.astype(jnp.int32), axis=-1)
  positions_BN = jnp.maximum(lengths_B[:, None] + jnp.cumsum(mask_BN, axis=-1) - 1, 0)
  key_mask_BS = jnp.concatenate([prompt_mask_BP.astype(jnp.int32), mask_BN], axis=1)
  return layer_ctx(cfg, positions_BN, key_mask_BS, P)


def packed_ctx(cfg: ModelConfig, prompt_table_mask_UP: jax.Array, positions_SL: jax.Array, segment_SL: jax.Array,
               entry_SL: jax.Array, max_segment_len: int | None = None):
  """Packed completions' layer context over [the table's U x P keys | the buffer's L]: a query sees its prompt's
  entry (id -(entry + 1)) and its own segment (ids >= 1, ascending; 0 on padding, whose entry is -1), at most
  max_segment_len positions long where given (blockwise then visits only that band of the buffer's keys)."""
  U, P = prompt_table_mask_UP.shape
  S = segment_SL.shape[0]
  key_blocks.check(segment_SL, segment_SL > 0, max_segment_len)
  segment_SL = segment_SL.astype(jnp.int32)
  table_ids = jnp.broadcast_to(-1 - jnp.repeat(jnp.arange(U, dtype=jnp.int32), P), (S, U * P))
  key_mask = jnp.concatenate([jnp.broadcast_to(prompt_table_mask_UP.reshape(1, U * P).astype(bool), (S, U * P)),
                              segment_SL > 0], axis=1)
  seg = Segments(segment_SL, -1 - entry_SL.astype(jnp.int32), jnp.concatenate([table_ids, segment_SL], axis=1),
                 max_segment_len)
  return layer_ctx(cfg, positions_SL, key_mask, U * P, seg)


def _layer(cfg: ModelConfig, policy: LayerPolicy):
  """One layer over both streams (run_layers applies the policy's remat): the prompts', then the completions' over
  their prompt's k, v (the prompt stream's own, tagged with the same checkpoint names): gathered per row by index_B,
  or packed (index_B None) the whole table's, flattened, ahead of every buffer row."""

  def fn(p, xs, consts):
    x_UPD, x_BND = xs
    ctx_prompt, ctx_completion, index_B = consts
    x_UPD, kv_prompt = decoder_layer(cfg, p, x_UPD, ctx_prompt, Train(policy))
    if index_B is None:
      flat = lambda t: jnp.broadcast_to(t.reshape(1, -1, *t.shape[2:]),
                                        (x_BND.shape[0], t.shape[0] * t.shape[1], *t.shape[2:]))
      prefix = tuple(flat(t) for t in kv_prompt)
    else:
      prefix = tuple(jnp.take(t, index_B, axis=0) for t in kv_prompt)
    x_BND = decoder_layer(cfg, p, x_BND, ctx_completion, Train(policy, prefix_kv=prefix))[0]
    return x_UPD, x_BND

  return fn


def _policies(cfg: ModelConfig, layer_policies) -> tuple[LayerPolicy, ...]:
  policies = tuple(layer_policies) if layer_policies is not None else uniform(cfg.num_hidden_layers, NO_REMAT)
  if len(policies) != cfg.num_hidden_layers:
    raise ValueError(f"got {len(policies)} layer policies for {cfg.num_hidden_layers} layers")
  return policies


def _layers(cfg: ModelConfig, params: dict, xs, ctx_p, ctx_c, index_B, policies):
  """Every layer over both streams, each run of one policy a scan (model/layers.py)."""
  return run_layers(lambda policy: _layer(cfg, policy), policies, params["layers"], xs, (ctx_p, ctx_c, index_B),
                    cfg.scan_layers)


def shared_hidden_states(cfg: ModelConfig, params: dict, prompt_table_UP: jax.Array, prompt_table_mask_UP: jax.Array,
                         prompt_index_B: jax.Array, tokens_BN: jax.Array, mask_BN: jax.Array,
                         layer_policies: Sequence[LayerPolicy] | None = None) -> jax.Array:
  """Final-norm hidden states [B, N, D] at the positions that predict the completion tokens (the prompt's last,
  then the completion's first N - 1): what `hidden_states` gives there on the rows' full sequences."""
  policies = _policies(cfg, layer_policies)
  index_B = prompt_index_B.astype(jnp.int32)
  ctx_p = layer_ctx(cfg, default_positions(prompt_table_mask_UP), prompt_table_mask_UP)
  ctx_c = completion_ctx(cfg, jnp.take(prompt_table_mask_UP, index_B, axis=0), mask_BN)
  xs = (embed(cfg, params, prompt_table_UP), embed(cfg, params, tokens_BN))
  xs = _layers(cfg, params, xs, ctx_p, ctx_c, index_B, policies)
  last_BD = jnp.take(xs[0][:, -1:], index_B, axis=0)
  return rms_norm(jnp.concatenate([last_BD, xs[1][:, :-1]], axis=1), params["final_norm_D"], cfg.rms_norm_eps)


def packed_shared_hidden_states(cfg: ModelConfig, params: dict, prompt_table_UP: jax.Array,
                                prompt_table_mask_UP: jax.Array, tokens_SL: jax.Array, positions_SL: jax.Array,
                                segment_SL: jax.Array, entry_SL: jax.Array,
                                layer_policies: Sequence[LayerPolicy] | None = None,
                                max_segment_len: int | None = None) -> jax.Array:
  """Final-norm hidden states [S, L, D] predicting each buffer token: completions packed end to end (segment ids
  >= 1, ascending; 0 on padding), each position at its unshared position and with its prompt's table entry
  (entry_SL, -1 on padding). A segment's first token is predicted by its prompt's last state, every other by the
  buffer's previous position: what `hidden_states` gives there on the rows' full sequences. max_segment_len: no
  completion is longer (the completion cap): blockwise attention then visits only the band of keys it allows."""
  policies = _policies(cfg, layer_policies)
  ctx_p = layer_ctx(cfg, default_positions(prompt_table_mask_UP), prompt_table_mask_UP)
  ctx_c = packed_ctx(cfg, prompt_table_mask_UP, positions_SL, segment_SL, entry_SL, max_segment_len)
  xs = (embed(cfg, params, prompt_table_UP), embed(cfg, params, tokens_SL))
  x_UPD, x_SLD = _layers(cfg, params, xs, ctx_p, ctx_c, None, policies)
  first_SL = jnp.concatenate([jnp.ones_like(segment_SL[:, :1], bool), segment_SL[:, 1:] != segment_SL[:, :-1]], 1)
  last_SLD = jnp.take(x_UPD[:, -1], jnp.maximum(entry_SL, 0), axis=0)
  prev_SLD = jnp.concatenate([jnp.zeros_like(x_SLD[:, :1]), x_SLD[:, :-1]], axis=1)
  h = jnp.where(first_SL[..., None], last_SLD, prev_SLD)
  return rms_norm(h, params["final_norm_D"], cfg.rms_norm_eps)
