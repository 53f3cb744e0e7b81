"""Predicted-KL step control: hand-computed and numpy references, chunking, masking, a tiny model."""

import functools

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hilore_jax import model
from hilore_jax.rl import kl_control


def test_hand_computed_two_token_vocabulary():
  """z = 0 (p = 1/2, 1/2), dz = (a, -a): predicted = Var/2 = a^2/2, exact KL = log cosh a."""
  a = 0.3
  h = jnp.ones((1, 1, 1))
  params, update = {"w": jnp.zeros((1, 2))}, {"w": jnp.array([[a, -a]])}
  args = (lambda p: h, lambda p: p["w"], params, update, jnp.ones((1, 1)))
  assert float(kl_control.predicted_kl(*args)) == pytest.approx(a * a / 2, rel=1e-6)
  assert float(kl_control.realized_kl(*args)) == pytest.approx(np.log(np.cosh(a)), rel=1e-5)


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _linear_case(seed=0, B=2, T=5, D=3, V=7):
  """hidden = tanh(x A), head W: both change; numpy float64 references with dh = (1 - tanh^2) * (x dA)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, T, D))
  params = {"a": rng.standard_normal((D, D)), "w": rng.standard_normal((D, V))}
  update = {k: 0.01 * rng.standard_normal(v.shape) for k, v in params.items()}
  mask = np.ones((B, T))
  mask[0, 3:] = 0
  mask[1, 0] = 0
  h = np.tanh(x @ params["a"])
  dh = (1 - h * h) * (x @ update["a"])
  z, dz = h @ params["w"], dh @ params["w"] + h @ update["w"]
  p = _softmax(z)
  pred_BT = 0.5 * ((p * dz * dz).sum(-1) - (p * dz).sum(-1) ** 2)
  h1 = np.tanh(x @ (params["a"] + update["a"]))
  p1 = _softmax(h1 @ (params["w"] + update["w"]))
  kl_BT = (p * (np.log(p) - np.log(p1))).sum(-1)
  f32 = lambda t: jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), t)
  fns = (lambda q: jnp.tanh(jnp.asarray(x, jnp.float32) @ q["a"]), lambda q: q["w"])
  return fns, f32(params), f32(update), mask, pred_BT, kl_BT


@pytest.mark.parametrize("chunk", [5, 2, 128])  # unchunked, odd remainder, chunk > T
def test_linear_model_against_numpy_and_chunking(chunk):
  (hidden_fn, head_fn), params, update, mask, pred_BT, kl_BT = _linear_case()
  mean = lambda x: (x * mask).sum() / mask.sum()
  pk = jax.jit(lambda p, u, m: kl_control.predicted_kl(hidden_fn, head_fn, p, u, m, chunk))
  rk = jax.jit(lambda p, u, m: kl_control.realized_kl(hidden_fn, head_fn, p, u, m, chunk))
  assert float(pk(params, update, mask)) == pytest.approx(mean(pred_BT), rel=1e-4)
  assert float(rk(params, update, mask)) == pytest.approx(mean(kl_BT), rel=1e-3)
  # per token too: chunked == unchunked, position by position
  h, dh = jax.jvp(hidden_fn, (params,), (update,))
  np.testing.assert_allclose(kl_control.token_predicted_kl(h, dh, params["w"], update["w"], chunk), pred_BT,
                             rtol=1e-4)


def test_masked_tokens_do_not_count():
  (hidden_fn, head_fn), params, update, mask, _, _ = _linear_case()
  # same hidden states at params, but a far larger change along the update where mask == 0
  gain = jnp.asarray(300.0 * (1 - mask)[..., None], jnp.float32)
  noisy = lambda p: hidden_fn(p) * (1 + gain * jnp.sum(p["a"] - params["a"]))
  for fn in (kl_control.predicted_kl, kl_control.realized_kl):
    clean, dirty = fn(hidden_fn, head_fn, params, update, mask), fn(noisy, head_fn, params, update, mask)
    assert float(dirty) == pytest.approx(float(clean), rel=1e-5)
    assert float(fn(noisy, head_fn, params, update, np.ones_like(mask))) > 10 * float(clean)  # they would count


def test_no_full_vocab_logits_in_the_program():
  B, T, D, V = 2, 64, 8, 1009
  params = {"w": jnp.ones((D, V))}
  h = jnp.ones((B, T, D))
  for fn in (kl_control.predicted_kl, kl_control.realized_kl):
    lower = lambda chunk: jax.jit(lambda p: fn(lambda q: h * jnp.sum(q["w"]), lambda q: q["w"], p, p,
                                               jnp.ones((B, T)), chunk)).lower(params).as_text()
    assert f"{B}x{T}x{V}" not in lower(16)
    assert f"{B}x{T}x{V}" in lower(T)  # the check can see full logits when they exist


def test_control_scale_hand_values():
  assert float(kl_control.control_scale(4.0, 1.0)) == pytest.approx(0.5)
  assert float(kl_control.control_scale(0.02, 0.005)) == pytest.approx(0.5)
  assert float(kl_control.control_scale(0.5, 1.0)) == 1.0  # already under the target
  assert float(kl_control.control_scale(4.0, 0.0)) == 1.0  # target 0: control off
  assert float(kl_control.control_scale(4.0, -1.0)) == 1.0
  assert float(jax.jit(kl_control.control_scale)(9.0, 1.0)) == pytest.approx(1 / 3)


@functools.lru_cache(maxsize=1)
def _tiny_model():
  cfg = builders.tiny_model(tie_word_embeddings=False)
  # init_params' structure with numpy values (its threefry draws take seconds to compile): std 0.2 makes the
  # distributions peaked enough that the KL is not trivial; 1-D leaves (norms) are ones as init_params makes them
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.PRNGKey(0)))
  params = jax.tree.map(lambda s: np.ones(s.shape, np.float32) if len(s.shape) == 1
                        else (0.2 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
  B, P, N = 3, 4, 7
  ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P + N)), jnp.int32)
  mask = np.ones((B, P + N), np.int32)
  mask[0, :2] = 0  # left-padded prompt
  mask[1, P + 5:] = 0  # right-padded completions
  mask[2, P + 3:] = 0
  mask = jnp.asarray(mask)
  hidden_fn = lambda p: model.hidden_states(cfg, p, ids, mask)[:, P - 1:P + N - 1]  # positions predicting completions
  head_fn = lambda p: model.lm_head_weight(cfg, p)
  leaves, treedef = jax.tree.flatten(params)
  update = treedef.unflatten([(0.2 * (np.std(x) + 0.05) * rng.standard_normal(x.shape)).astype(np.float32)
                              for x in leaves])  # every leaf moves, relative to its own size
  pk = jax.jit(lambda p, u, m: kl_control.predicted_kl(hidden_fn, head_fn, p, u, m, chunk=3))
  rk = jax.jit(lambda p, u, m: kl_control.realized_kl(hidden_fn, head_fn, p, u, m, chunk=3))
  su = jax.jit(lambda p, u, m, t: kl_control.scaled_update(hidden_fn, head_fn, p, u, m, t, chunk=3))
  return params, update, mask[:, P:], pk, rk, su


@jax.jit
def _times(tree, s):
  return jax.tree.map(lambda x: x * s, tree)


@pytest.mark.slow
def test_tiny_model_prediction_matches_realized_and_is_second_order():
  params, update, mask, pk, rk, _ = _tiny_model()
  errors = []
  for step in (0.25, 0.0625, 0.015625, 0.00390625):  # realized KL ~1.6e-2 down to ~4e-6 nats per token
    predicted, realized = float(pk(params, _times(update, step), mask)), float(rk(params, _times(update, step), mask))
    assert realized > 1e-6  # far above float32 noise (d = z1 - z0 is formed once, KL via log1p / expm1)
    errors.append(abs(predicted / realized - 1))
  assert errors[0] < 0.1, errors  # 10% at a KL of ~0.016 nats per token
  assert all(b < a / 1.5 for a, b in zip(errors, errors[1:])), errors
  assert errors[-1] < errors[-2] / 3, errors  # relative error O(step): the prediction is exact to second order
  # quadratic in the step size exactly (one JVP is linear in the update)
  assert float(pk(params, _times(update, 0.5), mask)) == pytest.approx(float(pk(params, update, mask)) / 4, rel=1e-5)


@pytest.mark.slow
def test_scaled_update_caps_kl_at_target():
  params, update, mask, pk, rk, su = _tiny_model()
  update = _times(update, 0.25)
  predicted = float(pk(params, update, mask))
  target = predicted / 3
  scaled, metrics = su(params, update, mask, target)
  s = float(metrics["kl_control/scale"])
  # the unscaled update's prediction (the scaled one's is 3x smaller), from a second program: a difference of two
  # sums, so more than a few float32 steps may separate them on another CPU
  assert float(metrics["kl_control/predicted"]) == pytest.approx(predicted, rel=1e-4)
  assert s == pytest.approx(np.sqrt(1 / 3), rel=1e-5)
  np.testing.assert_allclose(scaled["layers"][1]["mlp"]["wup_DF"], s * update["layers"][1]["mlp"]["wup_DF"],
                             rtol=1e-6)
  assert float(pk(params, scaled, mask)) == pytest.approx(target, rel=1e-4)
  assert float(rk(params, scaled, mask)) == pytest.approx(target, rel=0.1)
  for off in (2 * predicted, 0.0):  # under the target, or control off: the update is untouched
    same, metrics = su(params, update, mask, off)
    assert float(metrics["kl_control/scale"]) == 1.0
    np.testing.assert_array_equal(same["embed_VD"], update["embed_VD"])
