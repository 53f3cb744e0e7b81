import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_sampler
from tolerance import assert_close, max_abs

from hilore_jax import model
from hilore_jax.rl import sampler, sampling
from hilore_jax.rl.config import DecodeConfig, SamplingConfig

EOS, PAD = 1, 0


@pytest.fixture
def setup(tiny_cfg):
  return tiny_cfg, model.init_params(tiny_cfg, jax.random.PRNGKey(3), init_std=0.4)


def _greedy_by_recompute(cfg, params, prompt, n):
  seq = list(prompt)
  out = []
  for _ in range(n):
    tok = int(jnp.argmax(model.forward(cfg, params, jnp.array([seq]))[0, -1]))
    out.append(tok)
    if tok == EOS:
      break
    seq.append(tok)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("side", ["left", "right"])
def test_greedy_with_cache_equals_full_recompute(setup, side):
  cfg, params = setup
  prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17]]
  P = max(map(len, prompts))
  pad = lambda p: [PAD] * (P - len(p)) + p if side == "left" else p + [PAD] * (P - len(p))
  ids = jnp.array([pad(p) for p in prompts])
  mask = jnp.array([pad([1] * len(p)) for p in prompts])
  sc = SamplingConfig(max_new_tokens=9, greedy=True)
  out = sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), sc, stop_ids=EOS, pad_id=PAD)
  for b, p in enumerate(prompts):
    want = _greedy_by_recompute(cfg, params, p, 9)
    n = int(out["mask"][b].sum())
    assert out["tokens"][b, :n].tolist() == want
    assert out["mask"][b, n:].sum() == 0 and (out["tokens"][b, n:] == PAD).all()
    assert out["prompt_ids"][b, P - len(p):].tolist() == p  # returned left-aligned


@pytest.mark.slow
def test_stops_on_eos_and_logprobs_are_policy_logprobs(setup):
  cfg, params = setup
  # make EOS the argmax after token 20 by boosting its logit through a large lm-head column
  params = jax.tree_util.tree_map(lambda x: x, params)
  params["lm_head_DV"] = params["lm_head_DV"].at[:, EOS].set(params["embed_VD"][20] * 50.0)
  ids = jnp.array([[5, 6, 20], [5, 6, 7]])
  mask = jnp.ones_like(ids)
  out = sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), SamplingConfig(8, greedy=True), EOS, PAD)
  assert out["tokens"][0, 0] == EOS and out["mask"][0].tolist() == [1] + [0] * 7
  # logprob of each kept token equals the full-forward log-softmax at that position
  b = 1
  n = int(out["mask"][b].sum())
  seq = jnp.concatenate([ids[b], out["tokens"][b, :n]])[None]
  logp = jax.nn.log_softmax(model.forward(cfg, params, seq)[0], -1)
  want = logp[2:2 + n][jnp.arange(n), seq[0, 3:3 + n]]
  # log-softmax of logits up to ~190 (the boosted EOS column), where one float32 step is 1.5e-5: the cached
  # decode may round differently from the full forward; a logprob of the wrong token or position is off by O(1)
  assert_close(out["logprobs"][b, :n], want, ulps=64, scale=max_abs(model.forward(cfg, params, seq)))


@pytest.mark.slow
def test_stops_on_any_of_several_stop_ids(setup):
  cfg, params = setup
  ids = jnp.array([[3, 4, 5, 6, 7], [0, 0, 10, 11, 12]])
  mask = jnp.array([[1] * 5, [0, 0, 1, 1, 1]])
  sc = SamplingConfig(7, greedy=True)
  free = sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), sc, (EOS,), PAD)
  assert int(free["mask"][0].sum()) > 3  # row 0 runs past its third token
  stop = int(free["tokens"][0, 2])  # say row 0's third token ends a chat turn
  first = [int(np.flatnonzero(np.asarray(free["tokens"][b]) == stop)[0]) if stop in free["tokens"][b] else 7
           for b in range(2)]
  out = sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), sc, (EOS, stop), PAD)
  for b in range(2):
    n = min(first[b] + 1, int(free["mask"][b].sum()))  # up to and including the first stop id
    assert out["mask"][b].tolist() == [1] * n + [0] * (7 - n)
    assert out["tokens"][b, :n].tolist() == free["tokens"][b, :n].tolist()
    assert (out["tokens"][b, n:] == PAD).all()
  assert first[0] <= 2 and int(out["mask"][0].sum()) <= 3


def _abstract_start(cfg, B, P, S, G=1):
  """The start program (prefill, first draw) lowered on abstract params and prompts."""
  dp = jax.eval_shape(lambda: sampler.decode_params(cfg, model.init_params(cfg, jax.random.PRNGKey(0))))
  ids = jax.ShapeDtypeStruct((B, P), jnp.int32)
  keys = jax.ShapeDtypeStruct((B * G, 2), jnp.uint32)
  return sampler.start.lower(cfg, SamplingConfig(3), dp, ids, ids, keys, jnp.array([EOS]), G, S)


def test_prefill_never_holds_the_prompt_logits():
  # [B, P, V] float32 logits of a real rollout batch (512 x 256 x 151936) would be 80 GB; only the last row is needed
  cfg = model.ModelConfig(vocab_size=4099, hidden_size=24, intermediate_size=37, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2)
  B, P = 8, 33
  compiled = _abstract_start(cfg, B, P, 40).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < B * P * cfg.vocab_size * 4 / 4


def test_top_k_and_top_p_restrict_support():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  k2 = sampling.process_logits(logits, SamplingConfig(top_k=2))
  assert (k2[0, 2:] < -1e30).all() and (k2[0, :2] > -1e30).all()
  p = sampling.process_logits(logits, SamplingConfig(top_p=0.7))  # 0.5 + 0.3 reaches 0.7
  assert (p[0, :2] > -1e30).all() and (p[0, 2:] < -1e30).all()
  t = sampling.process_logits(logits, SamplingConfig(temperature=0.5))
  np.testing.assert_allclose(t, logits * 2.0, rtol=1e-6)


@pytest.mark.slow
def test_sampling_is_seeded_and_respects_top_k(setup):
  cfg, params = setup
  ids = jnp.tile(jnp.array([[3, 4, 5]]), (16, 1))
  mask = jnp.ones_like(ids)
  sc = SamplingConfig(max_new_tokens=5, top_k=1, temperature=0.7)
  a = sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), sc, EOS, PAD)
  g = sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), SamplingConfig(5, greedy=True), EOS, PAD)
  np.testing.assert_array_equal(a["tokens"], g["tokens"])  # top-1 sampling is greedy
  sc = SamplingConfig(max_new_tokens=5, temperature=1.5)
  x = sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(1), sc, EOS, PAD)
  y = sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(1), sc, EOS, PAD)
  np.testing.assert_array_equal(x["tokens"], y["tokens"])
  assert len({tuple(r) for r in np.asarray(x["tokens"])}) > 1  # rows really sample


def test_bad_sampling_config():
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(temperature=0.0)


# 3 prompts of different lengths, padded left, right and right (left_align must handle both), each sampled G=5 times
GROUP_IDS = np.array([[0, 3, 4, 5, 6, 7, 8], [9, 10, 0, 0, 0, 0, 0], [11, 12, 13, 14, 0, 0, 0]])
GROUP_MASK = (GROUP_IDS > 0).astype(np.int32)
G = 5


@pytest.fixture
def group_setup():
  cfg = model.ModelConfig(vocab_size=37, hidden_size=24, intermediate_size=37, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
  return cfg, model.init_params(cfg, jax.random.PRNGKey(3), init_std=0.4)


def _assert_stops_at(out, stops, N):
  """Each row's mask ends at its first stop id (kept) or at N tokens; pad after."""
  for toks, m in zip(np.asarray(out["tokens"]), np.asarray(out["mask"])):
    n = int(m.sum())
    assert m.tolist() == [1] * n + [0] * (N - n)
    hits = np.flatnonzero(np.isin(toks[:n], stops)).tolist()
    assert hits in ([], [n - 1]) and (hits or n == N)
    assert (toks[n:] == PAD).all()


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "temperature1"])
def test_shared_prefill_samples_what_repeated_prompts_sample(group_setup, greedy):
  cfg, params = group_setup
  N = 9
  sc = SamplingConfig(N, greedy=greedy, temperature=1.0)
  rep_ids, rep_mask = np.repeat(GROUP_IDS, G, 0), np.repeat(GROUP_MASK, G, 0)
  free = sampler.generate(cfg, params, rep_ids, rep_mask, jax.random.PRNGKey(7), sc, (EOS,), PAD)
  stops = (EOS, int(free["tokens"][G, 1]))  # say the second prompt's second token ends a chat turn
  ref = sampler.generate(cfg, params, rep_ids, rep_mask, jax.random.PRNGKey(7), sc, stops, PAD)
  out = sampler.generate(cfg, params, GROUP_IDS, GROUP_MASK, jax.random.PRNGKey(7), sc, stops, PAD, num_generations=G)
  for k in ("prompt_ids", "prompt_mask", "tokens", "mask"):
    assert out[k].shape == ref[k].shape == (3 * G, {"tokens": N, "mask": N}.get(k, 7))
    np.testing.assert_array_equal(out[k], ref[k], err_msg=k)
  # the prefill ran on 3 rows rather than 15, which may round its float32 sums differently: log-probs stay close
  assert_close(out["logprobs"], ref["logprobs"], ulps=64)
  _assert_stops_at(out, stops, N)
  assert int(out["mask"][G].sum()) <= 2  # the chosen stop id really cut a row
  if not greedy:  # a group's rows really sample different completions
    assert len({tuple(r) for r in np.asarray(out["tokens"][:G])}) > 1


def test_shared_prefill_runs_on_the_distinct_prompts_only(group_setup):
  # XLA's flop count of the shared start is below the repeated one's by the prefill of the (G-1) * Bp extra rows: it
  # would be equal if the prefill ran on all B rows (the first draw is the same [B, V] work in both). The count takes
  # every loop body once, the layer scan's too, in the start program and in the prefill alone alike
  cfg = group_setup[0]
  params = jax.eval_shape(lambda: sampler.decode_params(cfg, model.init_params(cfg, jax.random.PRNGKey(0))))
  Bp, P = GROUP_IDS.shape
  sds = lambda b: jax.ShapeDtypeStruct((b, P), jnp.int32)
  flops = lambda b, g: _abstract_start(cfg, b, P, P + 4, g).compile().cost_analysis()["flops"]
  prefill = lambda b: jax.jit(sampler.prefill, static_argnums=0).lower(cfg, params, sds(b), sds(b)).compile(
  ).cost_analysis()["flops"]
  saved, want = flops(Bp * G, 1) - flops(Bp, G), prefill(Bp * G) - prefill(Bp)
  assert want > 0 and abs(saved - want) < 0.05 * want, (saved, want)


def test_bad_num_generations(group_setup):
  cfg, params = group_setup
  with pytest.raises(ValueError, match="num_generations"):
    sampler.generate(cfg, params, GROUP_IDS, GROUP_MASK, jax.random.PRNGKey(0), SamplingConfig(2), EOS, PAD,
                     num_generations=0)


# ----------------------------------------------------------------------------- the engine against today's sampler

# small decode settings, so that a few tokens cross segments, cache buckets, attention chunks and row buckets
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


@pytest.mark.parametrize("decode", [DecodeConfig(), SMALL], ids=["defaults", "small_buckets"])
@pytest.mark.parametrize("G", [1, 3])
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
