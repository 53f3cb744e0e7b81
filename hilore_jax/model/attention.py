"""The attention kernels behind `model.attention`: xla (the softmax probabilities as a tensor of the layer, which
units.TABLE names), dot_product_attention (jax.nn's fused kernel, cuDNN flash attention on GPU) and blockwise
(flash-style attention in plain JAX: scores one block at a time, memory growing with T, not T x S, on any backend).

Packed rows (several sequences end to end in one row, issue 45) add segments: a query sees a key only where the
key's segment is the query's own or its prefix segment (a shared prompt's entry), `segment_mask`. xla and the fused
kernel take it inside their [B, T, S] mask; blockwise also skips every key block that holds none of a query block's
segments, so its FLOPs follow the sum of the segments' squared lengths, not the squared sum."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hilore_jax.model.config import ATTENTION_BLOCK_K as BLOCK_K
from hilore_jax.model.config import ATTENTION_BLOCK_Q as BLOCK_Q


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


class Segments(NamedTuple):
  """Which keys a query may see besides causality: key s is visible to query t iff k_segment[s] is q_segment[t] or
  q_prefix[t] (a packed completion's own row, and its shared prompt's table entry; the same id where there is none).
  Ids are int32; a padding position's key is invalid anyway (the key mask)."""

  q_segment_BT: jax.Array
  q_prefix_BT: jax.Array
  k_segment_BS: jax.Array


def segment_mask(seg: Segments) -> jax.Array:
  """[B, T, S] bool: the key's segment is the query's own or its prefix."""
  k = seg.k_segment_BS[:, None, :]
  return (k == seg.q_segment_BT[:, :, None]) | (k == seg.q_prefix_BT[:, :, None])


def fused_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS) -> jax.Array:
  """jax.nn.dot_product_attention [B, T, N, H]: cuDNN flash attention on GPU, XLA elsewhere; the probabilities
  are never a tensor of the layer (units.table: no attn_probs row under this kernel)."""
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None])


# ----------------------------------------------------------------------------- blockwise (flash-style) attention



def _mask_blocks(key_mask_BS, bk: int):
  """Key mask [B, S] -> [nk, B, bk] bool (padding keys are invalid)."""
  B, S = key_mask_BS.shape
  n = -(-S // bk)
  return jnp.pad(key_mask_BS.astype(bool), [(0, 0), (0, n * bk - S)]).reshape(B, n, bk).transpose(1, 0, 2)


def _q_blocks(q_BTNH, KV: int, bq: int):
  """q [B, T, N, H] -> [nq, B, K, G, bq, H] float32."""
  B, T, N, H = q_BTNH.shape
  n = -(-T // bq)
  q = jnp.pad(q_BTNH.astype(jnp.float32), [(0, 0), (0, n * bq - T), (0, 0), (0, 0)])
  return q.reshape(B, n, bq, KV, N // KV, H).transpose(1, 0, 3, 4, 2, 5)


def _kv_blocks(x_BSKH, bk: int):
  """k or v [B, S, K, H] -> [nk, B, K, bk, H] float32."""
  B, S, KV, H = x_BSKH.shape
  n = -(-S // bk)
  x = jnp.pad(x_BSKH.astype(jnp.float32), [(0, 0), (0, n * bk - S), (0, 0), (0, 0)])
  return x.reshape(B, n, bk, KV, H).transpose(1, 0, 3, 2, 4)


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


def _unblock_kv(x_nBKsH, S: int):
  """[nk, B, K, bk, H] -> [B, S, K, H]."""
  n, B, KV, bk, H = x_nBKsH.shape
  return x_nBKsH.transpose(1, 0, 3, 2, 4).reshape(B, n * bk, KV, H)[:, :S]


def _block_mask(key_mask_nBs, query_offset, i, j, bq: int, bk: int):
  """[B, 1, 1, bq, bk]: key j*bk+s is a valid key at or before query i*bq+t's slot (query_offset + its index)."""
  q_slot = query_offset + i * bq + jnp.arange(bq)
  k_slot = j * bk + jnp.arange(bk)
  causal = k_slot[None, :] <= q_slot[:, None]
  return causal[None, None, None] & key_mask_nBs[j][:, None, None, None, :]


def _visible(query_offset, i, j, bq: int, bk: int, seg_blocks=None):
  """Whether block (i, j) has any causally visible key (blocks wholly above the diagonal are skipped) and, with
  segments, a key of one of the query block's segments (another segment's blocks are skipped too)."""
  causal = j * bk <= query_offset + i * bq + bq - 1
  if seg_blocks is None:
    return causal
  _, _, _, (k_lo, k_hi, q_lo, q_hi, p_lo, p_hi) = seg_blocks
  meets = lambda lo, hi: (k_lo[j] <= hi[i]) & (k_hi[j] >= lo[i])  # the id ranges overlap
  return causal & (meets(q_lo, q_hi) | meets(p_lo, p_hi))


def _segment_blocks(segments: Segments | None, key_mask_nBs, bq: int, bk: int):
  """(query segment [nq, B, bq], query prefix [nq, B, bq], key segment [nk, B, bk] blocks, and the id range of each
  block: key blocks' over their valid keys, query blocks' over all rows) or None without segments. Segments are
  contiguous in a packed row, so these ranges skip nearly every block no query of the block can see."""
  if segments is None:
    return None
  nk, nq = key_mask_nBs.shape[0], -(-segments.q_segment_BT.shape[1] // bq)
  ks_n = jnp.pad(segments.k_segment_BS.astype(jnp.int32), [(0, 0), (0, nk * bk - segments.k_segment_BS.shape[1])])
  ks_n = ks_n.reshape(ks_n.shape[0], nk, bk).transpose(1, 0, 2)
  big = jnp.iinfo(jnp.int32).max
  k_lo = jnp.min(jnp.where(key_mask_nBs, ks_n, big), axis=(1, 2))
  k_hi = jnp.max(jnp.where(key_mask_nBs, ks_n, -big), axis=(1, 2))
  # padded query slots past T repeat the last query's ids, so they widen no range (their rows are cut anyway)
  blocks = lambda x_BT: jnp.pad(x_BT.astype(jnp.int32), [(0, 0), (0, nq * bq - x_BT.shape[1])], mode="edge").reshape(
      x_BT.shape[0], nq, bq).transpose(1, 0, 2)
  qs_n, qp_n = blocks(segments.q_segment_BT), blocks(segments.q_prefix_BT)
  ranges = (k_lo, k_hi, qs_n.min(axis=(1, 2)), qs_n.max(axis=(1, 2)), qp_n.min(axis=(1, 2)), qp_n.max(axis=(1, 2)))
  return qs_n, qp_n, ks_n, ranges


def _segment_block_mask(seg_blocks, i, j):
  """[B, 1, 1, bq, bk]: key j*bk+s's segment is query i*bq+t's own or its prefix."""
  qs_n, qp_n, ks_n, _ = seg_blocks
  k = ks_n[j][:, None, :]
  return ((k == qs_n[i][:, :, None]) | (k == qp_n[i][:, :, None]))[:, None, None]


def _block_sizes(T: int, S: int, block_q: int, block_k: int) -> tuple[int, int]:
  return min(block_q, T), min(block_k, S)


def _key_blocks(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, segments, block_q: int, block_k: int):
  """What forward and backward both start from: (block sizes, softmax scale, key, value and key-mask blocks, the
  segments' blocks or None)."""
  bq, bk = _block_sizes(q_BTNH.shape[1], k_BSKH.shape[1], block_q, block_k)
  scale = 1.0 / math.sqrt(q_BTNH.shape[-1])
  km_n = _mask_blocks(key_mask_BS, bk)
  return (bq, bk, scale, _kv_blocks(k_BSKH, bk), _kv_blocks(v_BSKH, bk), km_n,
          _segment_blocks(segments, km_n, bq, bk))


def _full_block_mask(km_n, query_offset, seg_blocks, i, j, bq: int, bk: int):
  mask = _block_mask(km_n, query_offset, i, j, bq, bk)
  return mask if seg_blocks is None else mask & _segment_block_mask(seg_blocks, i, j)


def _blockwise_fwd_impl(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, block_q, block_k):
  """(out [B, T, N, H] in q's dtype, logsumexp [B, K, G, T] float32; -inf where a row sees no key)."""
  B, T, N, _ = q_BTNH.shape
  KV = k_BSKH.shape[2]
  bq, bk, scale, k_n, v_n, km_n, sb = _key_blocks(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, segments, block_q, block_k)
  q_n = _q_blocks(q_BTNH, KV, bq) * scale
  nk = k_n.shape[0]

  def q_block(i, q_BKGqH):
    def k_block(carry, j):
      def update(carry):
        m, l, acc = carry
        s = jnp.einsum("bkgqh,bksh->bkgqs", q_BKGqH, k_n[j])
        mask = _full_block_mask(km_n, query_offset, sb, i, j, bq, bk)
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet: exp() of -inf, not of nan
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + jnp.einsum("bkgqs,bksh->bkgqh",
                                                                                         p, v_n[j])

      return jax.lax.cond(_visible(query_offset, i, j, bq, bk, sb), update, lambda c: c, carry), None

    shape = q_BKGqH.shape[:-1]
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(q_BKGqH.shape,
                                                                                             jnp.float32))
    (m, l, acc), _ = jax.lax.scan(k_block, init, jnp.arange(nk))
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]  # a row that sees no key (left padding) gives zeros
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, lse

  out_n, lse_n = jax.lax.map(lambda a: q_block(*a), (jnp.arange(q_n.shape[0]), q_n))
  lse_BKGT = lse_n.transpose(1, 2, 3, 0, 4).reshape(B, KV, N // KV, -1)[..., :T]
  return _unblock_q(out_n, T).astype(q_BTNH.dtype), lse_BKGT


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
  scan over key blocks yields dk, dv per block and accumulates dq, an inner scan runs over query blocks."""
  q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, segments, out_BTNH, lse_BKGT = res
  B, T, N, H = q_BTNH.shape
  S, KV = k_BSKH.shape[1], k_BSKH.shape[2]
  bq, bk, scale, k_n, v_n, km_n, sb = _key_blocks(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, segments, block_q, block_k)
  q_n = _q_blocks(q_BTNH, KV, bq)
  do_n = _q_blocks(dout_BTNH, KV, bq)
  # D = rowsum(dout * out): the softmax derivative's row term, without the probabilities
  d_n = jnp.sum(do_n * _q_blocks(out_BTNH, KV, bq), axis=-1)
  lse_n = _row_blocks(jnp.where(jnp.isfinite(lse_BKGT), lse_BKGT, 0.0), bq)
  nq = q_n.shape[0]

  def k_block(dq_n, j):
    def q_block(carry, i):
      def update(carry):
        dk, dv = carry
        s = jnp.einsum("bkgqh,bksh->bkgqs", q_n[i], k_n[j]) * scale
        mask = _full_block_mask(km_n, query_offset, sb, i, j, bq, bk)
        p = jnp.where(mask, jnp.exp(s - lse_n[i][..., None]), 0.0)
        dp = jnp.einsum("bkgqh,bksh->bkgqs", do_n[i], v_n[j])
        ds = p * (dp - d_n[i][..., None]) * scale
        dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, k_n[j])
        return (dk + jnp.einsum("bkgqs,bkgqh->bksh", ds, q_n[i]), dv + jnp.einsum("bkgqs,bkgqh->bksh", p, do_n[i])), \
            dq_i

      def skip(carry):
        return carry, jnp.zeros(q_n.shape[1:], jnp.float32)

      return jax.lax.cond(_visible(query_offset, i, j, bq, bk, sb), update, skip, carry)

    zeros = jnp.zeros(k_n.shape[1:], jnp.float32)
    (dk, dv), dq_parts = jax.lax.scan(q_block, (zeros, zeros), jnp.arange(nq))
    return dq_n + dq_parts, (dk, dv)

  dq_n, (dk_n, dv_n) = jax.lax.scan(k_block, jnp.zeros(q_n.shape, jnp.float32), jnp.arange(k_n.shape[0]))
  return (_unblock_q(dq_n, T).astype(q_BTNH.dtype), _unblock_kv(dk_n, S).astype(k_BSKH.dtype),
          _unblock_kv(dv_n, S).astype(v_BSKH.dtype), None, None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset=0, block_q: int = BLOCK_Q,
                        block_k: int = BLOCK_K, segments: Segments | None = None) -> jax.Array:
  """Causal grouped-query attention [B, T, N, H] over key blocks with an online softmax (flash attention): query t
  sits at key slot query_offset + t and sees the valid keys (key_mask_BS) at or before it (with segments, only those
  of its own or prefix segment; key blocks of other segments are skipped); scores live one [B, K, G, block_q,
  block_k] block at a time and backward recomputes them, so memory grows with T, not T x S. Float32 accumulation,
  output in q's dtype; a query that sees no key gives zeros."""
  return _blockwise(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, jnp.asarray(query_offset, jnp.int32), segments, block_q,
                    block_k)


def visible_blocks(T: int, key_mask_BS, query_offset=0, segments: Segments | None = None, block_q: int = BLOCK_Q,
                   block_k: int = BLOCK_K) -> jax.Array:
  """[nq, nk] bool: the (query block, key block) pairs blockwise_attention computes for T queries over these keys
  (the rest it skips); their count times a block's FLOPs is its attention's FLOPs."""
  S = key_mask_BS.shape[1]
  bq, bk = _block_sizes(T, S, block_q, block_k)
  sb = _segment_blocks(segments, _mask_blocks(key_mask_BS, bk), bq, bk)
  i, j = jnp.meshgrid(jnp.arange(-(-T // bq)), jnp.arange(-(-S // bk)), indexing="ij")
  return _visible(jnp.asarray(query_offset, jnp.int32), i, j, bq, bk, sb)


@functools.lru_cache(maxsize=None)
def blockwise_kernel(block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
  """blockwise_attention at fixed block sizes as fn(q, k, v, key mask, query offset[, q segment, q prefix, k
  segment]), one hashable function per pair (lowp.apply takes it as static, its arrays positional)."""

  def kernel(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset=0, *segments):
    return blockwise_attention(q_BTNH, k_BSKH, v_BSKH, key_mask_BS, query_offset, block_q, block_k,
                               Segments(*segments) if segments else None)

  return kernel
