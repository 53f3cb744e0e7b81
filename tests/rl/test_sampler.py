import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close, max_abs

from hilore_jax import model
from hilore_jax.rl import sampler, sampling
from hilore_jax.rl.config import SamplingConfig

EOS, PAD = 1, 0


@pytest.fixture
def setup(tiny_cfg):
  return tiny_cfg, model.init_params(tiny_cfg, jax.random.PRNGKey(3), init_std=0.4)


# the whole forward as one program per length (op by op, each of its ops compiled again at every length)
_forward = jax.jit(model.forward, static_argnums=0)


def _greedy_by_recompute(cfg, params, prompt, n):
  seq = list(prompt)
  out = []
  for _ in range(n):
    tok = int(jnp.argmax(_forward(cfg, params, jnp.array([seq]))[0, -1]))
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
