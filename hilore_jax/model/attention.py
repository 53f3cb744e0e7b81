"""The attention kernels behind `model.attention`: xla (the softmax probabilities as a tensor of the layer, which
units.TABLE names), dot_product_attention (jax.nn's fused kernel, cuDNN flash attention on GPU) and blockwise
(flash-style attention in plain JAX: scores one block at a time, memory growing with T, not T x S, on any backend).

Packed rows (several sequences end to end in one row, issue 45) add segments: a query sees a key only where the
key's segment is the query's own or its prefix segment (a shared prompt's entry), `segment_mask`. xla and the fused
kernel take it inside their [B, T, S] mask; blockwise also skips every key block that holds none of a query block's
segments, so its FLOPs follow the sum of the segments' squared lengths, not the squared sum, and with the segments'
bound (`Segments.max_len`) visits only the band of key blocks they can lie in (model/key_blocks.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hilore_jax.model.config import ATTENTION_BLOCK_K as BLOCK_K
from hilore_jax.model.config import ATTENTION_BLOCK_Q as BLOCK_Q
from hilore_jax.model.key_blocks import Schedule, outside_band, schedule


def attention_scores(q_BTNH, k_BSKH) -> jax.Array:
  """Grouped-query scores [B, K, G, T, S], accumulated in float32 whatever the compute dtype (bf16 sums over H
  lose the scores' small differences)."""
  B, T, N, H = q_BTNH.shape
  KV = k_BSKH.shape[2]
  q = q_BTNH.reshape(B, T, KV, N // KV, H)
  return jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH, preferred_element_type=jnp.float32) / math.sqrt(H)


def attention_probs(q_BTNH, k_BSKH, mask_BTS) -> jax.Array:
  """Grouped-query softmax probabilities [B, K, G, T, S], computed in float32, returned in q's dtype."""
  scores = jnp.where(mask_BTS[:, None, None], attention_scores(q_BTNH, k_BSKH), jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=-1).astype(q_BTNH.dtype)


def attention_context(probs_BKGTS, v_BSKH) -> jax.Array:
  """Probability-weighted values [B, T, N, H]."""
  B, KV, G, T, _ = probs_BKGTS.shape
  ctx = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
  return ctx.reshape(B, T, KV * G, ctx.shape[-1])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_segment_BT", "q_prefix_BT", "k_segment_BS"],
                   meta_fields=["max_len"])
@dataclasses.dataclass(frozen=True, eq=False)
class Segments:
  """Which keys a query may see besides causality: key s is visible to query t iff k_segment[s] is q_segment[t] or
  q_prefix[t] (a packed completion's own row, and its shared prompt's table entry; the same id where there is none).
  Ids are int32; a padding position's key is invalid anyway (the key mask). max_len (static), where given: no
  segment of the last T keys (the buffer; the keys before it are a table) is longer, its ids ascend along the row
  (model/key_blocks.py `check`), and blockwise visits only the band of key blocks that bound allows."""

  q_segment_BT: jax.Array
  q_prefix_BT: jax.Array
  k_segment_BS: jax.Array
  max_len: int | None = None

  def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    return self.q_segment_BT, self.q_prefix_BT, self.k_segment_BS


def segment_mask(seg: Segments) -> jax.Array:
  """[B, T, S] bool: the key's segment is the query's own or its prefix."""
  k = seg.k_segment_BS[:, None, :]
  return (k == seg.q_segment_BT[:, :, None]) | (k == seg.q_prefix_BT[:, :, None])


def fused_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS) -> jax.Array:
  """jax.nn.dot_product_attention [B, T, N, H]: cuDNN flash attention on GPU, XLA elsewhere; the probabilities
  are never a tensor of the layer (units.table: no attn_probs row under this kernel)."""
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None])


# ----------------------------------------------------------------------------- blockwise (flash-style) attention


class _Blocks(NamedTuple):
  """What forward and backward both start from: the key blocks' schedule (model/key_blocks.py), the softmax scale,
  the keys laid out in blocks (k, v [nk, B, K, bk, H] float32, key mask [nk, B, bk], slots [nk, bk] and each block's
  first slot [nk]), the key blocks each query block visits [nq, nc], and the segments' blocks or None."""

  sch: Schedule
  scale: float
  k_n: jax.Array
  v_n: jax.Array
  km_n: jax.Array
  slot_n: jax.Array
  slot_lo: jax.Array
  visits: jax.Array
  seg: tuple | None


def _q_blocks(x_BTNH, KV: int, bq: int):
  """q (or dout, out) [B, T, N, H] -> [nq, B, K, G, bq, H] float32."""
  B, T, N, H = x_BTNH.shape
  n = -(-T // bq)
  x = jnp.pad(x_BTNH.astype(jnp.float32), [(0, 0), (0, n * bq - T), (0, 0), (0, 0)])
  return x.reshape(B, n, bq, KV, N // KV, H).transpose(1, 0, 3, 4, 2, 5)


def _row_blocks(x_BKGT, bq: int):
  """Per-row statistics [B, K, G, T] -> [nq, B, K, G, bq]."""
  B, KV, G, T = x_BKGT.shape
  n = -(-T // bq)
  x = jnp.pad(x_BKGT, [(0, 0), (0, 0), (0, 0), (0, n * bq - T)])
  return x.reshape(B, KV, G, n, bq).transpose(3, 0, 1, 2, 4)


def _unblock_q(x_nBKGqH, T: int):
  """[nq, B, K, G, bq, H] -> [B, T, N, H]."""
  n, B, KV, G, bq, H = x_nBKGqH.shape
  return x_nBKGqH.transpose(1, 0, 4, 2, 3, 5).reshape(B, n * bq, KV * G, H)[:, :T]


def _segment_blocks(segments: Segments, sch: Schedule, km_n):
  """(query segment [nq, B, bq], query prefix [nq, B, bq], key segment [nk, B, bk] blocks, and the id range of each
  block: key blocks' over their valid keys, query blocks' over all rows). Segments are contiguous in a packed row,
  so these ranges skip nearly every block no query of the block can see."""
  ks_n = sch.layout(segments.k_segment_BS.astype(jnp.int32))
  big = jnp.iinfo(jnp.int32).max
  k_lo = jnp.min(jnp.where(km_n, ks_n, big), axis=(1, 2))
  k_hi = jnp.max(jnp.where(km_n, ks_n, -big), axis=(1, 2))
  # padded query slots past T repeat the last query's ids, so they widen no range (their rows are cut anyway)
  blocks = lambda x_BT: jnp.pad(x_BT.astype(jnp.int32), [(0, 0), (0, sch.nq * sch.bq - x_BT.shape[1])],
                                mode="edge").reshape(x_BT.shape[0], sch.nq, sch.bq).transpose(1, 0, 2)
  qs_n, qp_n = blocks(segments.q_segment_BT), blocks(segments.q_prefix_BT)
  ranges = (k_lo, k_hi, qs_n.min(axis=(1, 2)), qs_n.max(axis=(1, 2)), qp_n.min(axis=(1, 2)), qp_n.max(axis=(1, 2)))
  return qs_n, qp_n, ks_n, ranges


def _key_blocks(T: int, k_BSKH, v_BSKH, key_mask_BS, segments, block_q: int, block_k: int, H: int) -> _Blocks:
  """The keys in the blocks of their schedule: the band where segments carry their bound, else every block."""
  sch = schedule(T, k_BSKH.shape[1], block_q, block_k, segments.max_len if segments is not None else None)
  kv = lambda x: sch.layout(x.astype(jnp.float32)).transpose(0, 1, 3, 2, 4)  # [nk, B, K, bk, H]
  km_n = sch.layout(key_mask_BS.astype(bool), False)
  slot_n = sch.slots()
  return _Blocks(sch, 1.0 / math.sqrt(H), kv(k_BSKH), kv(v_BSKH), km_n, jnp.asarray(slot_n),
                 jnp.asarray(slot_n.min(axis=1)), jnp.asarray(sch.visits()),
                 None if segments is None else _segment_blocks(segments, sch, km_n))


def _visible(b: _Blocks, query_offset, i, j):
  """Whether block (i, j) has any causally visible key (blocks wholly above the diagonal, and the band's empty
  blocks, are skipped) and, with segments, a key of one of the query block's segments."""
  causal = b.slot_lo[j] <= query_offset + i * b.sch.bq + b.sch.bq - 1
  if b.seg is None:
    return causal
  k_lo, k_hi, q_lo, q_hi, p_lo, p_hi = b.seg[3]
  meets = lambda lo, hi: (k_lo[j] <= hi[i]) & (k_hi[j] >= lo[i])  # the id ranges overlap
  return causal & (meets(q_lo, q_hi) | meets(p_lo, p_hi))


def _block_mask(b: _Blocks, query_offset, i, j):
  """[B, 1, 1, bq, bk]: key j's s-th is valid, at or before query i*bq+t's slot, and (with segments) of its own or
  prefix segment."""
  q_slot = query_offset + i * b.sch.bq + jnp.arange(b.sch.bq)
  mask = (b.slot_n[j][None, :] <= q_slot[:, None])[None] & b.km_n[j][:, None, :]
  if b.seg is not None:
    qs_n, qp_n, ks_n, _ = b.seg
    k = ks_n[j][:, None, :]
    mask = mask & ((k == qs_n[i][:, :, None]) | (k == qp_n[i][:, :, None]))
  return mask[:, None, None]


def _blockwise_fwd_impl(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, block_q, block_k):
  """(out [B, T, N, H] in q's dtype, logsumexp [B, K, G, T] float32; -inf where a row sees no key). A band whose
  segments do not fit it gives NaN (key_blocks.outside_band): a non-finite loss, not a silently wrong one."""
  B, T, N, H = q_BTNH.shape
  KV = k_BSKH.shape[2]
  b = _key_blocks(T, k_BSKH, v_BSKH, key_mask_BS, segments, block_q, block_k, H)
  q_n = _q_blocks(q_BTNH, KV, b.sch.bq) * b.scale

  def q_block(i, q_BKGqH, visits_c):
    def k_block(carry, j):
      def update(carry):
        m, l, acc = carry
        s = jnp.einsum("bkgqh,bksh->bkgqs", q_BKGqH, b.k_n[j])
        mask = _block_mask(b, query_offset, i, j)
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet: exp() of -inf, not of nan
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + jnp.einsum("bkgqs,bksh->bkgqh",
                                                                                         p, b.v_n[j])

      return jax.lax.cond(_visible(b, query_offset, i, j), update, lambda c: c, carry), None

    shape = q_BKGqH.shape[:-1]
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(q_BKGqH.shape,
                                                                                             jnp.float32))
    (m, l, acc), _ = jax.lax.scan(k_block, init, visits_c)
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]  # a row that sees no key (left padding) gives zeros
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, lse

  out_n, lse_n = jax.lax.map(lambda a: q_block(*a), (jnp.arange(b.sch.nq), q_n, b.visits))
  lse_BKGT = lse_n.transpose(1, 2, 3, 0, 4).reshape(B, KV, N // KV, -1)[..., :T]
  out = _unblock_q(out_n, T)
  if b.sch.band:
    out = jnp.where(outside_band(segments.k_segment_BS, key_mask_BS, T, segments.max_len), jnp.nan, out)
  return out.astype(q_BTNH.dtype), lse_BKGT


# Linearizing an enclosing scan (the decoder's layer scan), JAX hoists out of the loop what the body computes from
# loop-invariant inputs alone (the key mask, the query offset): every block's mask and values selected by it, stacked
# over all query x key blocks, T x S again (measured: 16 x 16 blocks of [B, K, G, 32, 32] at T = 512). As a
# checkpoint the forward is one call that split cannot see into; it keeps only its inputs.
_fwd_opaque = jax.checkpoint(_blockwise_fwd_impl, static_argnums=(6, 7))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _blockwise(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, block_q, block_k):
  return _fwd_opaque(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, block_q, block_k)[0]


def _blockwise_fwd(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, block_q, block_k):
  out, lse = _fwd_opaque(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, block_q, block_k)
  return out, (q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, out, lse)


def _blockwise_bwd(block_q, block_k, res, dout_BTNH):
  """Flash-attention backward: each block's probabilities recomputed from q, k and the row logsumexp; an outer
  scan over query blocks accumulates each one's dq over the key blocks it visits (the forward's schedule) and adds
  their dk, dv into the key blocks' carried sums."""
  q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, out_BTNH, lse_BKGT = res
  B, T, N, H = q_BTNH.shape
  KV = k_BSKH.shape[2]
  b = _key_blocks(T, k_BSKH, v_BSKH, key_mask_BS, segments, block_q, block_k, H)
  q_n = _q_blocks(q_BTNH, KV, b.sch.bq)
  do_n = _q_blocks(dout_BTNH, KV, b.sch.bq)
  # D = rowsum(dout * out): the softmax derivative's row term, without the probabilities
  d_n = jnp.sum(do_n * _q_blocks(out_BTNH, KV, b.sch.bq), axis=-1)
  lse_n = _row_blocks(jnp.where(jnp.isfinite(lse_BKGT), lse_BKGT, 0.0), b.sch.bq)

  def q_block(dkv, xs):
    i, q_i, do_i, d_i, lse_i, visits_c = xs

    def k_block(carry, j):
      def update(carry):
        dq, dk_n, dv_n = carry
        s = jnp.einsum("bkgqh,bksh->bkgqs", q_i, b.k_n[j]) * b.scale
        p = jnp.where(_block_mask(b, query_offset, i, j), jnp.exp(s - lse_i[..., None]), 0.0)
        dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, b.v_n[j])
        ds = p * (dp - d_i[..., None]) * b.scale
        return (dq + jnp.einsum("bkgqs,bksh->bkgqh", ds, b.k_n[j]),
                dk_n.at[j].add(jnp.einsum("bkgqs,bkgqh->bksh", ds, q_i)),
                dv_n.at[j].add(jnp.einsum("bkgqs,bkgqh->bksh", p, do_i)))

      return jax.lax.cond(_visible(b, query_offset, i, j), update, lambda c: c, carry), None

    (dq, *dkv), _ = jax.lax.scan(k_block, (jnp.zeros(q_i.shape, jnp.float32), *dkv), visits_c)
    return tuple(dkv), dq

  zeros = jnp.zeros(b.k_n.shape, jnp.float32)
  (dk_n, dv_n), dq_n = jax.lax.scan(q_block, (zeros, zeros), (jnp.arange(b.sch.nq), q_n, do_n, d_n, lse_n, b.visits))
  unblock_kv = lambda x_n: b.sch.unlayout(x_n.transpose(0, 1, 3, 2, 4))  # [nk, B, K, bk, H] -> [B, S, K, H]
  return (_unblock_q(dq_n, T).astype(q_BTNH.dtype), unblock_kv(dk_n).astype(k_BSKH.dtype),
          unblock_kv(dv_n).astype(v_BSKH.dtype), None, None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset=0, block_q: int = BLOCK_Q,
                        block_k: int = BLOCK_K, segments: Segments | None = None) -> jax.Array:
  """Causal grouped-query attention [B, T, N, H] over key blocks with an online softmax (flash attention): query t
  sits at key slot query_offset + t and sees the valid keys (key_mask_BS) at or before it (with segments, only those
  of its own or prefix segment; key blocks of other segments are skipped, and with segments.max_len only the band's
  blocks are visited); scores live one [B, K, G, block_q, block_k] block at a time and backward recomputes them, so
  memory grows with T, not T x S. Float32 accumulation, output in q's dtype; a query that sees no key gives zeros."""
  return _blockwise(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, jnp.asarray(query_offset, jnp.int32), segments, block_q,
                    block_k)


def visible_blocks(T: int, key_mask_BS, query_offset=0, segments: Segments | None = None, block_q: int = BLOCK_Q,
                   block_k: int = BLOCK_K) -> jax.Array:
  """[nq, nc] bool: which of the key blocks each query block visits (all nk of them, or the band's) blockwise_attention
  computes for T queries over these keys (the rest it skips); their count times a block's FLOPs is its attention's
  FLOPs."""
  S = key_mask_BS.shape[1]
  b = _key_blocks(T, jnp.zeros((1, S, 1, 1)), jnp.zeros((1, S, 1, 1)), key_mask_BS, segments, block_q, block_k, 1)
  i = jnp.broadcast_to(jnp.arange(b.sch.nq)[:, None], b.visits.shape)
  return _visible(b, jnp.asarray(query_offset, jnp.int32), i, b.visits)


@functools.lru_cache(maxsize=None)
def blockwise_kernel(block_q: int = BLOCK_Q, block_k: int = BLOCK_K, max_segment_len: int | None = None):
  """blockwise_attention at fixed block sizes as fn(q, k, v, key mask, query offset[, q segment, q prefix, k
  segment]), one hashable function per (block sizes, segment bound) (lowp.apply takes it as static, its arrays
  positional)."""

  def kernel(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset=0, *segments):
    return blockwise_attention(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, block_q, block_k,
                               Segments(*segments, max_segment_len) if segments else None)

  return kernel
