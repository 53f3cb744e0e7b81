"""Rows packed end to end (rl/packing.py, model segments): the packer holds every row once, first fit decreasing
over a few buffer lengths; packed log-probs, loss and gradient equal the unpacked minibatch's (float32, relative
1e-5) under every loss aggregation, both kernels, a shared prompt on and off, partial groups, replayed rows and a
mixed remat plan; no segment sees another's tokens; blockwise skips other segments' key blocks; one compiled
program per buffer length; a row longer than the buffer is a one-line error."""

import dataclasses
import sys

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_util import scan_lengths
from tolerance import assert_close

from hilore_jax import model
from hilore_jax.errors import ConfigError
from hilore_jax.model import key_blocks
from hilore_jax.model.attention import Segments, visible_blocks
from hilore_jax.rl import grpo, packing, prompt_share, token_budget, train_step
from hilore_jax.rl.update_batch import UpdateBatch

sys.path.insert(0, __file__.rsplit("/rl/", 1)[0] + "/loop")
import packed_util  # noqa: E402  (the token budget's shared check: packed == unpacked, stepper)

CFG = builders.tiny_model(attention_block_q=4, attention_block_k=8)
P, N = 5, 13
# rows in order: prompts 0, 1, 2 (group 2 partial: two rows), a row of zero length (a short minibatch's padding),
# two replayed rows (prompt 3, and one of prompt 0's)
ORDER = np.array([0, 1, 0, 2, 1, 0, 2, 1, 3, 0])
LENGTHS = np.array([13, 2, 0, 7, 1, 13, 4, 9, 6, 11])
REPLAYED = np.array([0, 0, 0, 0, 0, 0, 0, 0, 1, 1], np.int32)


def _batch(seed: int = 0) -> UpdateBatch:
  rng = np.random.default_rng(seed)
  fresh = (1 - REPLAYED) * (np.arange(len(ORDER)) % 3 == 0)  # a fresh row's old log-prob is its own (unread)
  return builders.update_batch(rng, P, N, 31, LENGTHS, order=ORDER, prompt_lens=rng.integers(1, P + 1, ORDER.max() + 1),
                               old_logp=True, ref_logp=True, on_policy=fresh, replayed=REPLAYED)


def _plan(batch, shared: bool, budget: int = 28, shards: int = 1):
  keys = prompt_share.prompt_keys(batch) if shared else None
  return packing.plan(batch.mask, batch.prompt_mask, packing.sizes(budget, 3), shards, keys, 4)


def _params():
  return builders.params(CFG, 3)


def test_the_packer_holds_every_row_once_end_to_end():
  batch = _batch()
  plen = batch.prompt_mask.sum(1)
  for shared in (False, True):
    bufs = _plan(batch, shared)
    rows = np.concatenate([b.rows for b in bufs])
    assert sorted(rows.tolist()) == np.flatnonzero(LENGTHS > 0).tolist()  # every row with a token, exactly once
    assert {b.shape[1] for b in bufs} <= set(packing.sizes(28, 3))
    for b in bufs:
      for s in range(b.shape[0]):
        seg, row, col, pos = b.segment[s], b.row[s], b.column[s], b.position[s]
        real = seg > 0
        assert np.all(np.diff(seg[real]) >= 0) and np.array_equal(real, np.arange(len(real)) < real.sum())
        for k in np.unique(seg[real]):
          at = seg == k
          r = row[at][0]
          assert np.all(row[at] == r)
          # its real tokens in order: the completion (and its prompt when unshared); positions as unpacked
          first = P if shared else P - plen[r]
          np.testing.assert_array_equal(col[at], np.arange(first, P + LENGTHS[r]))
          np.testing.assert_array_equal(pos[at], col[at] - (P - plen[r]))
        assert np.all(row[~real] == len(ORDER))
      if shared:  # the table holds each of the buffer's distinct prompts once; every row finds its own
        for r in b.rows:
          np.testing.assert_array_equal(batch.prompt_ids[b.table[b.index[r]]], batch.prompt_ids[r])
        assert len(b.table) == prompt_share.table_size(4, len(ORDER))


def test_first_fit_decreasing_then_the_smallest_lengths_that_hold_the_rest():
  # 3 rows of 60 + 40 fill one buffer of 100 twice over... by hand: 60, 40 | 60, 40 | 60 then 30 + 5 in 50
  sizes = np.array([60, 40, 60, 40, 60, 30, 5])
  bufs = packing.pack_lengths(sizes, (100, 50, 25))
  assert [(n, sorted(sizes[i].tolist())) for n, i in bufs] == [(100, [40, 60]), (100, [40, 60]), (100, [5, 30, 60])]
  # a rest of 55 below the largest buffer: 50 + 25 (75 positions) rather than 100
  bufs = packing.pack_lengths(np.array([30, 20, 5]), (100, 50, 25))
  assert [(n, sorted(np.array([30, 20, 5])[i].tolist())) for n, i in bufs] == [(50, [20, 30]), (25, [5])]
  # never more positions than first fit decreasing into the largest buffer alone
  rng = np.random.default_rng(2)
  for _ in range(50):
    sizes = rng.integers(1, 101, rng.integers(1, 40))
    ladder = packing.pack_lengths(sizes, (100, 50, 25))
    single = packing.pack_lengths(sizes, (100,))
    assert sorted(i for _, items in ladder for i in items) == list(range(len(sizes)))
    assert all(sizes[items].sum() <= n for n, items in ladder)
    assert sum(n for n, _ in ladder) <= sum(n for n, _ in single)


def test_a_granule_gives_every_multiple_and_one_rest_buffer():
  # by hand: multiples of 30 below 100, and 100 itself; the ladder without a granule
  assert packing.sizes(100, 3, granule=30) == (100, 90, 60, 30)
  assert packing.sizes(100, 3) == (100, 56, 32)  # ceil(100 / 2^k) up to a multiple of 8 from 64 on
  # a rest of 55: one buffer of 60 on the granule, where the ladder takes 50 + 25 (two buffers, two tables)
  sizes = np.array([30, 20, 5])
  assert [n for n, _ in packing.pack_lengths(sizes, packing.sizes(100, 3, granule=30))] == [60]
  # a table of 10 positions per buffer: 50 + 10 + 25 + 10 = 95 against 100 + 10 = 110, so still split; at 20 a buffer
  # (50 + 25 + 40 = 115 against 120) still split; at 30 (135 against 130) one buffer of 100
  for overhead, want in ((10, [50, 25]), (20, [50, 25]), (30, [100])):
    assert [n for n, _ in packing.pack_lengths(sizes, (100, 50, 25), overhead)] == want, overhead


def test_buffers_are_kept_only_where_they_save_enough_positions():
  # by hand: 54 of 60 positions is exactly the 10% saving; 55 is less; 0 packs even where buffers compute more
  assert packing.worth_packing(54, 60, 0.1) and not packing.worth_packing(55, 60, 0.1)
  assert packing.worth_packing(61, 60, 0.0) and not packing.worth_packing(60, 60, 0.05)
  # every row at the cap: 4 rows of 6 in one buffer of 24 and its 2-prompt table (24 + 2 x 5) against 4 rows x 6
  # padded with the same table (24 + 10): nothing saved, the padded rows run; ragged rows 6, 1, 1, 1 fill 9 of the
  # buffer of 12 (12 + 10 = 22 of the padded 34: 35% saved), so the buffer runs
  pmask, keys = np.ones((4, P), np.int32), np.array([0, 0, 1, 1])
  caps = token_budget.bucket_caps(6, 3)
  for lengths, want in (([6, 6, 6, 6], token_budget.Micro), ([6, 1, 1, 1], packing.Buffer)):
    mask = (np.arange(6)[None] < np.array(lengths)[:, None]).astype(np.int32)
    buffers = packing.plan(mask, pmask, packing.sizes(24, 3), 1, keys, 2)
    padded = token_budget.share(token_budget.plan(mask.sum(1), 0, caps, 24, 4), keys, 2)
    chosen = packing.choose(buffers, padded, P, 0.1)
    assert {type(m) for m in chosen} == {want}, chosen
    assert packing.choose(buffers, padded, P, 0.0) is buffers  # 0: always packed
  assert [b.computed_positions(P) for b in buffers] == [12 + 2 * P]
  assert [m.computed_positions(P) for m in padded] == [4 * 6 + 2 * P]


def test_a_row_longer_than_the_buffer_is_a_one_line_error():
  batch = _batch()
  longest = int((batch.mask.sum(1) + batch.prompt_mask.sum(1)).max())  # unshared: prompt and completion
  assert longest > 13
  with pytest.raises(ConfigError, match=rf"^a row of {longest} tokens does not fit a packed buffer of 13 positions: "
                                        r"raise train.max_tokens_per_microbatch \(now 26, split over 2 devices\) to "
                                        rf"{2 * longest} or more$"):
    packing.plan(batch.mask, batch.prompt_mask, packing.sizes(13, 2), 2)
  packing.plan(batch.mask, batch.prompt_mask, packing.sizes(13, 2), 2, prompt_share.prompt_keys(batch))  # shared
  bad = batch.replace(mask=batch.mask[:, ::-1].copy())  # left-padded completions: not what packing reads
  with pytest.raises(ValueError, match="masks without holes"):
    packing.plan(bad.mask, bad.prompt_mask, (24,))


# each kernel with a shared prompt and without, under token-mean; the loss aggregations weigh the same per-row
# log-probs whatever the layout, so the other two run on the layout that has the most to get wrong (blockwise, a
# shared prompt). The quick tier (-m "not slow") runs each kernel once and each sharing once.
def _case(agg: str, attention: str, shared: bool, quick: bool):
  return pytest.param(agg, attention, shared, id=f"{agg}-{attention}-{'shared' if shared else 'unshared'}",
                      marks=() if quick else pytest.mark.slow)


LAYOUTS = [_case(grpo.LOSS_AGGS[0], "xla", False, True), _case(grpo.LOSS_AGGS[0], "xla", True, False),
           _case(grpo.LOSS_AGGS[0], "blockwise", False, False), _case(grpo.LOSS_AGGS[0], "blockwise", True, True),
           *(_case(agg, "blockwise", True, False) for agg in grpo.LOSS_AGGS[1:])]


@pytest.mark.parametrize("loss_agg,attention,shared", LAYOUTS)
def test_packed_loss_gradient_and_logprobs_equal_the_unpacked_minibatch(loss_agg, attention, shared):
  # partial groups, replayed rows (one of a prompt in the batch, one of another), on- and off-policy rows, a row
  # without tokens; the minibatch's own table (shared) is not what a buffer reads: its own is
  params, batch = _params(), _batch()
  minibatch = prompt_share.share_prompts(batch) if shared else batch
  keys = prompt_share.prompt_keys(batch) if shared else None
  bufs = packing.plan(batch.mask, batch.prompt_mask, (44, 22), 1, keys, 4)
  assert len(bufs) > 1 and len({b.shape for b in bufs}) > 1  # several buffers of more than one length
  assert all((b.table is not None) == shared for b in bufs)
  spec = packed_util.spec(CFG.replace(attention=attention), loss_agg, N)
  packed_util.assert_packed_equals_unpacked(params, batch, minibatch, bufs, spec)


@pytest.mark.parametrize("attention,shared", [  # the quick tier: each kernel once, each sharing once
    pytest.param("xla", False, id="xla-unshared"), pytest.param("xla", True, id="xla-shared", marks=pytest.mark.slow),
    pytest.param("blockwise", False, id="blockwise-unshared", marks=pytest.mark.slow),
    pytest.param("blockwise", True, id="blockwise-shared")])
def test_the_packed_logprob_pass_equals_the_unpacked_one(attention, shared):
  # the old / reference log-prob forward, written back to the minibatch's rows (0 where no token counts)
  from hilore_jax.loop import packed_step

  params, batch = _params(), _batch()
  minibatch = prompt_share.share_prompts(batch) if shared else batch
  spec = packed_util.spec(CFG.replace(attention=attention), "token-mean", N)
  st = packed_util.stepper(params)
  got = packed_step.PackedStepper(st).logprobs(spec, params, minibatch, _plan(batch, shared, budget=40))
  mask = batch.mask > 0
  assert_close(np.where(mask, got, 0), np.where(mask, st.logprobs(spec, params, batch), 0), 84)
  assert np.all(np.asarray(got)[~mask] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_a_mixed_remat_plan_packs_exactly(attention):
  # layers unrolled, each under its own policy (the scan is the other tests'), shared prompt
  params, batch = _params(), _batch()
  spec = packed_util.spec(CFG.replace(attention=attention), "seq-mean-token-mean", N)
  spec = dataclasses.replace(spec, policies=(model.NO_REMAT, model.FULL_REMAT))
  packed_util.assert_packed_equals_unpacked(params, batch, prompt_share.share_prompts(batch), _plan(batch, True), spec)


def _packed_logp(cfg, params, batch, buf):
  return jax.jit(lambda p, b, i: train_step.completion_logprobs(cfg, p, packing.gather(b, i))[0])(
      params, batch, buf.arrays())


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_segments_never_attend_across_each_other(attention, shared):
  # one buffer holding every row; another row's tokens (prompt and completion) changed: every other row's log-probs
  # are bit for bit the same, its own are not. Attention over the whole buffer row would fail this
  cfg = CFG.replace(attention=attention)
  params, batch = _params(), _batch()
  keys = prompt_share.prompt_keys(batch) if shared else None
  buf = packing.plan(batch.mask, batch.prompt_mask, (128,), 1, keys, 4)
  assert len(buf) == 1 and len(buf[0].rows) == np.sum(LENGTHS > 0)
  victim = 5  # prompt 0, in the middle of the buffer; its prompt-mates keep their prompt when shared
  ids, toks = batch.prompt_ids.copy(), batch.tokens.copy()
  toks[victim] = np.where(batch.mask[victim] > 0, (toks[victim] + 7) % 30 + 1, 0)
  if not shared:
    ids[victim] = np.where(batch.prompt_mask[victim] > 0, (ids[victim] + 3) % 30 + 1, 0)
  a = np.asarray(_packed_logp(cfg, params, batch, buf[0]))
  b = np.asarray(_packed_logp(cfg, params, batch.replace(prompt_ids=ids, tokens=toks), buf[0]))
  others = np.arange(len(ORDER)) != victim
  np.testing.assert_array_equal(a[others], b[others])
  assert np.abs(a[victim] - b[victim]).max() > 1e-3


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared"])
def test_the_packed_blockwise_pass_visits_only_the_band(shared):
  # a packed segment is at most the batch's completion (with its prompt, unshared): blockwise's key loop runs over
  # the table's blocks and the band of ceil((bound - 1) / block) + 1 buffer blocks, not every key block
  cfg = CFG.replace(attention="blockwise")
  params, batch = _params(), _batch()
  keys = prompt_share.prompt_keys(batch) if shared else None
  (buf,) = packing.plan(batch.mask, batch.prompt_mask, (128,), 1, keys, 4)
  L, table = buf.shape[1], 4 * P if shared else 0
  band = key_blocks.schedule(L, table + L, 4, 8, N if shared else P + N)
  dense = key_blocks.schedule(L, table + L, 4, 8)
  lengths = scan_lengths(jax.make_jaxpr(lambda p, b, i: train_step.completion_logprobs(cfg, p, packing.gather(b, i)))(
      params, batch, buf.arrays()).jaxpr)
  assert band.band and lengths.count(band.visits().shape[1]) >= 1 and dense.nk not in lengths, lengths


def test_segment_ids_run_each_sequence_as_if_alone():
  # the model over a packed row [1, T] with segment ids and restarting positions = each sequence run on its own
  params = _params()
  rng = np.random.default_rng(4)
  lens = [4, 9, 1, 6]
  seqs = [rng.integers(1, 31, n).astype(np.int32) for n in lens]
  seg = np.concatenate([np.full(n, k + 1) for k, n in enumerate(lens)] + [np.zeros(3, int)])[None].astype(np.int32)
  pos = np.concatenate([np.arange(n) for n in lens] + [np.zeros(3, int)])[None].astype(np.int32)
  ids = np.concatenate(seqs + [np.zeros(3, np.int32)])[None]
  alone = np.stack([np.pad(x, (0, max(lens) - len(x))) for x in seqs])  # right-padded: causal, so exact
  alone_mask = (np.arange(max(lens))[None] < np.array(lens)[:, None]).astype(np.int32)
  for attention in ("xla", "blockwise"):
    cfg = CFG.replace(attention=attention)
    h = model.hidden_states(cfg, params, ids, seg > 0, positions_BT=pos, segment_ids_BT=seg)
    want = model.hidden_states(cfg, params, alone, alone_mask)
    t = 0
    for k, n in enumerate(lens):
      assert_close(h[0, t:t + n], want[k, :n], 64)
      t += n


def test_blockwise_skips_the_key_blocks_of_other_segments():
  # attention FLOPs follow the sum of the segments' squared lengths, not the squared sum: the blocks computed over
  # a row of 5 segments (1,024 positions, 32 x 32 blocks) are exactly those where some query sees a key of its own
  # segment, counted here by brute force, against the same row attended causally as one sequence
  T, lens, blk = 1024, [100, 200, 150, 300, 274], 32
  seg_T = np.concatenate([np.full(n, k + 1) for k, n in enumerate(lens)])
  seg = jnp.asarray(seg_T[None], jnp.int32)
  keys = jnp.ones((1, T), bool)
  packed = np.asarray(visible_blocks(T, keys, 0, Segments(seg, seg, seg), blk, blk))
  sees = (seg_T[:, None] == seg_T[None, :]) & np.tri(T, dtype=bool)
  np.testing.assert_array_equal(packed, sees.reshape(T // blk, blk, T // blk, blk).any(axis=(1, 3)))
  causal = int(visible_blocks(T, keys, 0, None, blk, blk).sum())
  assert causal == 528 and packed.sum() / causal < 0.3
  assert packed.sum() < sum(n * n for n in lens) / 2 / blk**2 + 2 * T / blk  # each triangle plus its edge blocks


def test_one_compiled_program_per_buffer_length():
  # minibatches of other length mixes reuse the programs of the buffer lengths they use
  from hilore_jax.loop import packed_step

  params = _params()
  spec = packed_util.spec(CFG, "token-mean", N)
  st, state = packed_util.stepper(params, with_state=True)
  packer = packed_step.PackedStepper(st)
  used = set()
  for seed in (0, 1, 2, 3):
    rng = np.random.default_rng(seed)
    b = _batch(seed)
    b = b.replace(mask=(np.arange(N)[None] < rng.integers(0, N + 1, len(ORDER))[:, None]).astype(np.int32))
    bufs = _plan(b, True)
    used |= {buf.shape[1] for buf in bufs}
    state, _, _ = packer.step(spec, state, jax.device_put(b), bufs)
  assert st.compile_count == len(used) and len(used) > 1, (st.compile_count, packer.shapes)
