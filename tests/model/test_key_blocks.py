"""The blockwise kernel's key-block schedules (model/key_blocks.py): the band's layout and visits cover every key a
packed query sees; blockwise attention over the band equals the segment-masked xla kernel (forward and gradients,
with a prompt table and without, segments straddling blocks and one at the bound), visits only the band, keeps
segments apart; segments that do not fit the bound are an error (concrete) or NaN (traced), never a wrong value."""

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_util import scan_lengths
from tolerance import rel_err

from hilore_jax import model
from hilore_jax.model import key_blocks
from hilore_jax.model.attention import Segments, attention_context, attention_probs, blockwise_attention, segment_mask

N, K, H = 6, 2, 8
MAX_LEN = 11
# two buffer rows of segments at most MAX_LEN long (one exactly), straddling blocks of 4 or 5, then padding
LENS = [[11, 3, 7, 9, 1, 10, 6], [5, 11, 8, 2, 11, 4]]
T = 53


def _segments(table: int):
  """(segment [B, T], query prefix [B, T], key segment [B, table + T], key mask [B, table + T]) of LENS after a
  table of `table` // 3 prompts of 3 positions (each prompt's first a left pad), or none."""
  seg = np.zeros((len(LENS), T), np.int32)
  for b, lens in enumerate(LENS):
    seg[b, :sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
  if not table:
    return seg, seg, seg, seg > 0
  U = table // 3
  entry = np.where(seg > 0, (seg - 1) % U, -1)
  table_ids = np.broadcast_to(-1 - np.repeat(np.arange(U), 3), (len(LENS), table))
  table_mask = np.broadcast_to(np.tile([False, True, True], U), (len(LENS), table))
  return (seg, -1 - entry, np.concatenate([table_ids, seg], 1).astype(np.int32),
          np.concatenate([table_mask, seg > 0], 1))


def _inputs(table: int, seed: int = 0):
  seg, prefix, kseg, km = _segments(table)
  S = table + T
  kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k, v = (jax.random.normal(kq, (len(LENS), T, N, H)), jax.random.normal(kk, (len(LENS), S, K, H)),
             jax.random.normal(kv, (len(LENS), S, K, H)))
  w = jax.random.normal(kw, q.shape) * (seg > 0)[..., None, None]  # padding queries see no key: not compared
  arrays = tuple(jnp.asarray(x) for x in (seg, prefix, kseg))
  causal = np.arange(S)[None, :] <= table + np.arange(T)[:, None]
  mask = jnp.asarray(causal[None] & km[:, None, :]) & segment_mask(Segments(*arrays))
  return (q, k, v), w, jnp.asarray(km), arrays, mask


def test_layout_round_trips_and_the_band_covers_every_visible_key():
  for table in (0, 9, 12):
    seg, prefix, kseg, km = _segments(table)
    sch = key_blocks.schedule(T, table + T, 5, 7, MAX_LEN)
    assert sch.band and sch.bk == 5 and sch.window == 2
    x = np.arange(2 * (table + T) * 3).reshape(2, table + T, 3)
    np.testing.assert_array_equal(sch.unlayout(sch.layout(x)), x)
    slots = sch.slots()
    np.testing.assert_array_equal(np.asarray(sch.layout(np.arange(table + T)[None], -1))[:, 0],
                                  np.where(slots == np.iinfo(np.int32).max, -1, slots))
    # every (query, key) pair the mask allows lies in a block the query's block visits
    causal = np.arange(table + T)[None, :] <= table + np.arange(T)[:, None]
    sees = causal[None] & km[:, None, :] & np.asarray(segment_mask(Segments(seg, prefix, kseg)))
    for i, blocks in enumerate(sch.visits()):
      covered = np.zeros(table + T, bool)
      covered[[s for s in slots[blocks].ravel() if s < table + T]] = True
      assert not (sees[:, i * 5:(i + 1) * 5] & ~covered).any(), i
    assert sch.visits().shape[1] < key_blocks.schedule(T, table + T, 5, 7).nk  # fewer than dense


def test_spans_by_hand():
  seg = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 0, 1, 2, 2, 2], [2, 2, 1, 1, 3, 3, 3]])
  valid = seg > 0
  longest, ascending = key_blocks.spans(seg, valid, 7)
  assert int(longest) == 4 and not bool(ascending)  # row 1's segment 1 spans its pad; row 2's ids descend
  longest, ascending = key_blocks.spans(seg[:1], valid[:1], 7)
  assert (int(longest), bool(ascending)) == (3, True)
  assert not bool(key_blocks.outside_band(seg[:1], valid[:1], 7, 3))
  assert bool(key_blocks.outside_band(seg[:1], valid[:1], 7, 2))


@pytest.mark.parametrize("table,blocks", [pytest.param(0, (5, 5), marks=pytest.mark.slow), (9, (4, 8)),  # quick: one
                                         pytest.param(12, (5, 3), marks=pytest.mark.slow)])
def test_the_band_matches_the_xla_kernel_forward_and_gradients(table, blocks):
  qkv, w, km, arrays, mask = _inputs(table)
  seen = np.asarray(w[..., 0, 0] != 0)
  band = Segments(*arrays, MAX_LEN)
  assert key_blocks.schedule(T, table + T, *blocks, MAX_LEN).band
  ref = lambda q, k, v: attention_context(attention_probs(q, k, mask), v)
  blk = lambda q, k, v: blockwise_attention(q, k, v, km, table, *blocks, band)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
  want, want_grads = ref(*qkv), jax.grad(loss(ref), argnums=(0, 1, 2))(*qkv)
  for f in (blk, jax.jit(blk)):
    assert rel_err(np.asarray(f(*qkv))[seen], np.asarray(want)[seen]) <= 1e-5
    for name, g, g_want in zip("qkv", jax.grad(loss(f), argnums=(0, 1, 2))(*qkv), want_grads):
      assert rel_err(g, g_want) <= 1e-5, name
  # the band is what ran: every query block's key loop, forward and backward, is the band's length, not dense's
  sch, dense = key_blocks.schedule(T, table + T, *blocks, MAX_LEN), key_blocks.schedule(T, table + T, *blocks)
  lengths = scan_lengths(jax.make_jaxpr(jax.grad(loss(blk), argnums=(0, 1, 2)))(*qkv).jaxpr)
  assert lengths == [sch.nq, sch.visits().shape[1]] * 2 and sch.visits().shape[1] < dense.nk, lengths


def test_band_segments_never_attend_across_each_other():
  # one segment's keys and values changed: every other query's output is bit for bit the same, its own is not
  table = 9
  qkv, _, km, arrays, _ = _inputs(table)
  q, k, v = qkv
  seg = np.asarray(arrays[0])
  victim = np.concatenate([np.zeros(table, bool), seg[0] == 4])[None, :, None, None] & (np.arange(2) == 0)[:, None,
                                                                                                           None, None]
  k2, v2 = jnp.where(victim, k + 1.0, k), jnp.where(victim, -v, v)
  f = jax.jit(lambda k, v: blockwise_attention(q, k, v, km, table, 4, 4, Segments(*arrays, MAX_LEN)))
  a, b = np.asarray(f(k, v)), np.asarray(f(k2, v2))
  own = np.zeros(seg.shape, bool)
  own[0] = seg[0] == 4
  np.testing.assert_array_equal(a[~own], b[~own])
  assert np.abs(a[own] - b[own]).max() > 1e-2


def test_segments_longer_than_the_bound_are_an_error_or_nan():
  table = 9
  qkv, _, km, arrays, _ = _inputs(table)
  # traced (inside a jitted step): the kernel cannot raise, so its output is NaN, never a silently wrong value
  out = jax.jit(lambda *a: blockwise_attention(*a, km, table, 4, 4, Segments(*arrays, MAX_LEN - 1)))(*qkv)
  assert bool(jnp.isnan(out).all())
  # concrete: the model's packed entry points name the length and the setting
  cfg = builders.tiny_model(attention="blockwise", attention_block_q=4, attention_block_k=4)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  seg = np.asarray(arrays[0][:1])
  ids, pos = np.ones_like(seg), np.zeros_like(seg)
  with pytest.raises(ValueError, match=r"a packed segment of 11 positions is longer than max_segment_len=10: raise "
                                       r"max_segment_len to 11 or more"):
    model.hidden_states(cfg, params, ids, seg > 0, positions_BT=pos, segment_ids_BT=seg, max_segment_len=10)
  with pytest.raises(ValueError, match="max_segment_len=10"):
    model.packed_shared_hidden_states(cfg, params, np.ones((1, 3), np.int32), np.ones((1, 3), np.int32), ids, pos,
                                      seg, np.where(seg > 0, 0, -1), max_segment_len=10)
  with pytest.raises(ValueError, match="ascending ids"):
    model.hidden_states(cfg, params, ids, seg > 0, positions_BT=pos, segment_ids_BT=seg[:, ::-1].copy(),
                        max_segment_len=MAX_LEN)
