"""The decode engine at length (issue 49): greedy and sampled tokens as today's sampler's, rows that leave when they
finish, the cache's length buckets, attention over the filled chunks only, sampling without a sort, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_sampler
from tolerance import assert_close

from hilore_jax import model
from hilore_jax.rl import sampler, sampling
from hilore_jax.rl.config import DecodeConfig, SamplingConfig

EOS, PAD = 1, 0


SMALL = DecodeConfig(segment=3, cache_bucket=4, attention_chunk=5)
RAGGED_IDS = np.array([[0, 3, 4, 5, 6, 7, 8], [9, 10, 0, 0, 0, 0, 0], [11, 12, 13, 14, 0, 0, 0],
                       [20, 21, 22, 0, 0, 0, 0], [0, 0, 0, 0, 0, 23, 24]])
RAGGED_MASK = (RAGGED_IDS > 0).astype(np.int32)


@pytest.fixture
def calm_setup():
  """A model whose logits stay within a few units: log-probs compare at 1e-5 absolute."""
  cfg = model.ModelConfig(vocab_size=37, hidden_size=24, intermediate_size=37, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
  return cfg, model.init_params(cfg, jax.random.PRNGKey(5), init_std=0.15)


def _live_stops(cfg, params, ids, mask, sc, N):
  """A stop id the free greedy run draws mid-way in some rows (so rows finish at different steps)."""
  free = reference_sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), sc, (EOS,), PAD)
  toks = np.asarray(free["tokens"])
  return (EOS, int(toks[1, N // 3]))


@pytest.mark.parametrize("decode,G", [pytest.param(DecodeConfig(), 1, id="1-defaults"),  # quick: two of the four
                                      pytest.param(SMALL, 1, id="1-small_buckets", marks=pytest.mark.slow),
                                      pytest.param(DecodeConfig(), 3, id="3-defaults", marks=pytest.mark.slow),
                                      pytest.param(SMALL, 3, id="3-small_buckets")])
def test_greedy_tokens_are_todays(calm_setup, decode, G):
  cfg, params = calm_setup
  N = 17
  sc = SamplingConfig(N, greedy=True)
  stops = _live_stops(cfg, params, RAGGED_IDS, RAGGED_MASK, sc, N)
  want = reference_sampler.generate(cfg, params, RAGGED_IDS, RAGGED_MASK, jax.random.PRNGKey(0), sc, stops, PAD,
                                    num_generations=G)
  out = sampler.generate(cfg, params, RAGGED_IDS, RAGGED_MASK, jax.random.PRNGKey(0), sc, stops, PAD,
                         num_generations=G, decode=decode)
  for k in ("prompt_ids", "prompt_mask", "tokens", "mask"):
    np.testing.assert_array_equal(out[k], np.asarray(want[k]), err_msg=k)
  np.testing.assert_allclose(out["logprobs"], want["logprobs"], rtol=0, atol=1e-5)
  lengths = out["mask"].sum(1)
  assert lengths.min() < N and lengths.max() == N  # rows really stopped at different steps
  if decode == SMALL:  # the run really crossed buckets: the cache grew and (single rows finish apart) the batch shrank
    assert len({s.cache_len for s in out["trace"]}) > 1
    assert G > 1 or len({len(s.rows) for s in out["trace"]}) > 1


def _each_row_alone(cfg, params, ids, mask, sc, stops, keys, G):
  """Every completion row sampled in a batch of its own, from its own key."""
  rows = [sampler.generate(cfg, params, ids[r // G:r // G + 1], mask[r // G:r // G + 1], None, sc, stops, PAD,
                           decode=DecodeConfig(segment=4), row_keys=keys[r:r + 1]) for r in range(len(keys))]
  return {k: np.concatenate([r[k] for r in rows]) for k in ("tokens", "logprobs", "mask")}


@pytest.mark.slow
def test_a_rows_tokens_depend_on_its_key_alone(calm_setup):
  # rows sampled together (compacted as they finish, buckets crossed), in another order, and each alone draw the
  # same tokens from the same keys; a key shared by the batch (split by position, as before) would not
  cfg, params = calm_setup
  G, N = 3, 13
  sc = SamplingConfig(N, temperature=1.5, top_k=20, top_p=0.95)
  keys = jax.random.split(jax.random.PRNGKey(11), len(RAGGED_IDS) * G)
  stops = (EOS, 2, 5)
  together = sampler.generate(cfg, params, RAGGED_IDS, RAGGED_MASK, None, sc, stops, PAD, num_generations=G,
                              decode=SMALL, row_keys=keys)
  alone = _each_row_alone(cfg, params, RAGGED_IDS, RAGGED_MASK, sc, stops, keys, G)
  order = np.array([4, 2, 0, 3, 1])
  rows = (order[:, None] * G + np.arange(G)).reshape(-1)
  shuffled = sampler.generate(cfg, params, RAGGED_IDS[order], RAGGED_MASK[order], None, sc, stops, PAD,
                              num_generations=G, row_keys=keys[rows])
  for other, sel in ((alone, slice(None)), (shuffled, np.argsort(rows))):
    np.testing.assert_array_equal(together["tokens"], other["tokens"][sel])
    np.testing.assert_array_equal(together["mask"], other["mask"][sel])
    np.testing.assert_allclose(together["logprobs"], other["logprobs"][sel], rtol=0, atol=1e-5)
  assert len({tuple(r) for r in together["tokens"][:G]}) > 1  # a group's rows really sample
  assert len({len(s.rows) for s in together["trace"]}) > 1  # and the batch was compacted on the way


def _finished_rows_decoded(out) -> set[tuple[int, int]]:
  """(segment start, row) for every row a segment decoded although it had finished before that segment began."""
  ends = out["mask"].sum(1)  # a row that finished drew its last token at index ends - 1
  return {(s.start, r) for s in out["trace"] for r in s.rows
          if r >= 0 and ends[r] < out["mask"].shape[1] and ends[r] <= s.start - 1}


@pytest.mark.parametrize("compact", [True, False])
def test_finished_rows_leave_the_batch(calm_setup, compact):
  cfg, params = calm_setup
  N = 15
  sc = SamplingConfig(N, greedy=True)
  stops = _live_stops(cfg, params, RAGGED_IDS, RAGGED_MASK, sc, N)
  decode = DecodeConfig(segment=2, compact=compact)
  out = sampler.generate(cfg, params, RAGGED_IDS, RAGGED_MASK, None, sc, stops, PAD, decode=decode,
                         row_keys=jax.random.split(jax.random.PRNGKey(0), 5))
  decoded = _finished_rows_decoded(out)
  ends = out["mask"].sum(1)
  assert ends.min() < N - 4  # some row stopped early enough to leave
  if not compact:  # the check sees finished rows decoded where they stay in the batch
    assert decoded
    return
  assert not decoded
  for s in out["trace"]:  # each segment ran in the smallest row bucket that holds the rows live at its start
    live = sum(1 for r in range(5) if ends[r] == N or ends[r] > s.start - 1)
    assert len(s.rows) == min(b for b in sampler.row_buckets(5) if b >= live)
    assert sorted(r for r in s.rows if r >= 0) == [r for r in range(5) if ends[r] == N or ends[r] > s.start - 1]


def test_row_and_cache_buckets():
  assert sampler.row_buckets(32) == [32, 24, 16, 12, 8, 6, 4, 3, 2, 1]
  assert sampler.row_buckets(15) == [15, 12, 8, 6, 4, 3, 2, 1] and sampler.row_buckets(1) == [1]
  d = DecodeConfig(cache_bucket=128, attention_chunk=128)
  assert sampler.cache_lengths(96, 256, d) == [256, 384]  # 96 + 128, 96 + 256, in whole chunks
  assert sampler.cache_lengths(96, 1024, d) == [256, 384, 640, 1152]
  assert sampler.cache_lengths(8, 5, d) == [16] and sampler.attention_chunk(8, 5, d) == 16  # tiny: one short chunk


# ----------------------------------------------------------------------------- the decode step


def test_attention_reads_only_the_filled_chunks(tiny_cfg):
  # NaN in every cache slot past the filled chunks: a decode step that read them would return NaN
  cfg = tiny_cfg
  params = sampler.decode_params(cfg, model.init_params(cfg, jax.random.PRNGKey(2), init_std=0.3))
  P, S, chunk = 6, 40, 8
  ids = jnp.array([[3, 4, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12], [0, 0, 0, 0, 13, 14]])
  mask = (ids > 0).astype(jnp.int32)
  _, (k, v) = sampler.prefill(cfg, params, ids, mask)
  grow = lambda x, fill: jnp.pad(x, [(0, 0), (0, 0), (0, S - P), (0, 0), (0, 0)], constant_values=fill)
  plen = mask.sum(-1)
  step = jax.jit(lambda cache, slot, n: model.decode_step(cfg, params, jnp.array([5, 6, 7]), plen + slot - P, cache,
                                                         slot, P - plen, chunk, n), static_argnums=2)
  for slot in (P, 2 * chunk - 1, 2 * chunk + 3):  # the filled slots end inside chunk 0, at chunk 1's end, in chunk 2
    n = sampler.filled_chunks(P, slot - P, 1, slot - P + 1, chunk)  # the sampler's count for the one token at slot
    filled_end = n * chunk
    assert filled_end == -(-(slot + 1) // chunk) * chunk
    clean = step((grow(k, 0.0), grow(v, 0.0)), slot, n)[0]
    poison = lambda x: grow(x, 0.0).at[:, :, filled_end:].set(jnp.nan)
    dirty = step((poison(k), poison(v)), slot, n)[0]
    assert np.isfinite(np.asarray(clean)).all()
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_decode_step_is_the_full_forward(tiny_cfg):
  # one token at a time through decode_step gives the logits of the full forward pass at those positions
  cfg = tiny_cfg
  raw = model.init_params(cfg, jax.random.PRNGKey(2), init_std=0.3)
  params = sampler.decode_params(cfg, raw)
  seq = jnp.array([[0, 0, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]])
  P, S, chunk = 4, 12, 5
  mask = jnp.concatenate([(seq[:, :P] > 0), jnp.ones((2, seq.shape[1] - P), bool)], 1).astype(jnp.int32)
  want = model.forward(cfg, raw, seq, mask)
  _, cache = sampler.prefill(cfg, params, seq[:, :P], mask[:, :P])
  cache = tuple(jnp.pad(x, [(0, 0), (0, 0), (0, S - P), (0, 0), (0, 0)]) for x in cache)
  plen = mask[:, :P].sum(-1)
  step = jax.jit(lambda tok, cache, slot, n: model.decode_step(cfg, params, tok, plen + slot - P, cache, slot,
                                                               P - plen, chunk, n), static_argnums=3)
  for t in range(seq.shape[1] - P):
    logits, cache = step(seq[:, P + t], cache, P + t, -(-(P + t + 1) // chunk))
    assert_close(logits, want[:, P + t], ulps=64)


def test_the_decode_loop_never_copies_the_cache(tiny_cfg):
  # the layers write their slot into the stacked cache in place: the segment program's temporaries stay far below
  # one cache buffer (a layer scan returning a new stacked cache, as the prefill's forward_cached does, holds one)
  cfg = tiny_cfg.replace(num_hidden_layers=4)
  dp = jax.eval_shape(lambda: sampler.decode_params(cfg, model.init_params(cfg, jax.random.PRNGKey(0))))
  R, S = 16, 512
  kv = jax.ShapeDtypeStruct((cfg.num_hidden_layers, R, S, cfg.num_key_value_heads, cfg.head_size), jnp.float32)
  r = lambda dt: jax.ShapeDtypeStruct((R,), dt)
  state = sampler.DecodeState(kv, kv, r(jnp.int32), r(bool), r(jnp.int32), jax.ShapeDtypeStruct((R, 2), jnp.uint32))
  compiled = sampler.decode_segment.lower(cfg, SamplingConfig(64), dp, state, 0, 63, jnp.array([EOS]), 8, 64, 7,
                                          PAD).compile()
  cache_bytes = kv.size * 4
  assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes / 4, compiled.memory_analysis()


# ----------------------------------------------------------------------------- the draw


def test_top_k_and_top_p_are_the_sorted_ones_without_a_sort():
  rng = np.random.default_rng(0)
  for V in (7, 301):
    x = jnp.asarray(rng.normal(size=(6, V)) * 3, jnp.float32).at[:, 1].set(2.5).at[:, 2].set(2.5)  # ties
    for sc in (SamplingConfig(top_k=3), SamplingConfig(top_k=V - 1), SamplingConfig(top_p=0.5),
               SamplingConfig(top_k=min(9, V - 1), top_p=0.9, temperature=0.7)):
      got, want = sampling.process_logits(x, sc), reference_sampler.process_logits(x, sc)
      np.testing.assert_array_equal(np.asarray(got) > -1e30, np.asarray(want) > -1e30, err_msg=str((V, sc)))
      np.testing.assert_array_equal(np.where(want > -1e30, got, 0), np.where(want > -1e30, want, 0))
  sc = SamplingConfig(top_k=50, top_p=0.9)
  hlo = jax.jit(lambda l, k: sampling.pick(l, k, 3, sc)).lower(jnp.zeros((4, 4099)), jnp.zeros((4, 2), jnp.uint32))
  assert " sort(" not in hlo.compile().as_text()  # XLA:CPU's lax.top_k sorts the whole vocabulary


def test_inverse_cdf_draws_the_distribution():
  p = jnp.asarray([0.0, 0.5, 0.0, 0.3, 0.2] + [0.0] * 300, jnp.float32)  # zeros around and in a second block
  n = 40000
  u = jax.random.uniform(jax.random.PRNGKey(0), (n,))
  toks = np.asarray(jax.jit(sampling.inverse_cdf)(jnp.tile(p, (n, 1)), u))
  freq = np.bincount(toks, minlength=p.shape[0]) / n
  np.testing.assert_allclose(freq[[1, 3, 4]], [0.5, 0.3, 0.2], atol=0.01)
  assert freq.sum() == freq[[1, 3, 4]].sum()  # never a zero-probability token
  # u at its ends, and mass only in the last block past zeros
  q = jnp.zeros((3, 600)).at[:, 599].set(1.0)
  np.testing.assert_array_equal(sampling.inverse_cdf(q, jnp.array([0.0, 0.5, 1 - 2 ** -24])), [599, 599, 599])


def test_bfloat16_decode(calm_setup):
  cfg, params = calm_setup
  sc = SamplingConfig(6, greedy=True)
  f32 = sampler.generate(cfg, params, RAGGED_IDS, RAGGED_MASK, None, sc, (EOS,), PAD,
                         row_keys=jax.random.split(jax.random.PRNGKey(0), 5))
  bf16 = sampler.generate(cfg, params, RAGGED_IDS, RAGGED_MASK, None, sc, (EOS,), PAD,
                          decode=DecodeConfig(dtype="bfloat16"), row_keys=jax.random.split(jax.random.PRNGKey(0), 5))
  state = jax.eval_shape(lambda: _abstract_state(cfg.replace(dtype="bfloat16"), params))
  assert state.k.dtype == jnp.bfloat16  # the cache (and the compute) in bf16
  assert bf16["logprobs"].dtype == np.float32 and np.isfinite(bf16["logprobs"]).all()
  first = bf16["tokens"][:, 0] == f32["tokens"][:, 0]
  assert first.mean() >= 0.6  # bf16 rounding may flip close calls, not the whole distribution
  np.testing.assert_allclose(bf16["logprobs"][first, 0], f32["logprobs"][first, 0], atol=0.05)


def _abstract_state(cfg, params):
  dp = sampler.decode_params(cfg, params)
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  return sampler.start(cfg, SamplingConfig(4), dp, RAGGED_IDS, RAGGED_MASK, keys, jnp.array([EOS]), 1, 16)[0]


def test_bad_decode_settings():
  for kw, key in ((dict(dtype="float16"), "rollout.dtype"), (dict(segment=0), "rollout.decode_segment"),
                  (dict(cache_bucket=0), "rollout.cache_bucket"),
                  (dict(attention_chunk=-1), "rollout.attention_chunk")):
    with pytest.raises(ValueError, match=key):
      DecodeConfig(**kw)
  with pytest.raises(ValueError, match="row_keys holds 2 keys for 3"):
    sampler.generate(None, None, np.zeros((3, 2), np.int32), np.ones((3, 2), np.int32), None, SamplingConfig(2), EOS,
                     PAD, row_keys=jnp.zeros((2, 2), jnp.uint32))
