"""Predicted-KL step control in the compiled update program: prediction vs realized KL, the cap, the metrics,
honest peak bytes, and the plain program when the control is off."""

import dataclasses
import functools

import builders
import jax
import numpy as np
import optax
import pytest

from hilore_jax import model, sharding
from hilore_jax.loop import engine
from hilore_jax.optim.config import KLControlConfig
from hilore_jax.rl import kl_control, train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import UpdateBatch

CFG = builders.tiny_model(vocab_size=61, tie_word_embeddings=False)
B, P, N = 4, 5, 7
TEMPERATURE = 0.7
SPEC = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(CFG.num_hidden_layers, model.FULL_REMAT),
                           temperature=TEMPERATURE)
OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.01))


@functools.lru_cache(maxsize=1)
def _host():
  """Params and a ragged minibatch (left-padded prompts, right-padded completions) as numpy."""
  rng = np.random.default_rng(0)
  # init_params' structure with numpy values (its threefry draws take seconds to compile); norms are ones
  shapes = jax.eval_shape(lambda: model.init_params(CFG, jax.random.PRNGKey(0)))
  params = jax.tree.map(lambda s: np.ones(s.shape, np.float32) if len(s.shape) == 1
                        else (0.2 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
  prompt_mask = np.ones((B, P), np.int32)
  prompt_mask[1, :2] = 0
  mask = (np.arange(N)[None] < np.array([7, 3, 5, 6])[:, None]).astype(np.int32)
  batch = UpdateBatch((rng.integers(1, 61, (B, P)) * prompt_mask).astype(np.int32), prompt_mask,
                      (rng.integers(1, 61, (B, N)) * mask).astype(np.int32), mask,
                      rng.normal(size=B).astype(np.float32))
  return params, batch


@functools.lru_cache(maxsize=None)
def _run(target: float):
  """(params before, params after, metrics, compiled Step) of one update with kl_control.target = target."""
  params, batch = _host()
  mesh = sharding.make_mesh()
  state, shardings = engine.init_state(mesh, OPT, jax.eval_shape(lambda: params), lambda sh: jax.device_put(params, sh))
  stepper = engine.Stepper(mesh, OPT, state, shardings, KLControlConfig(target, chunk=3))
  step = stepper.get(SPEC, batch)
  state, metrics = step(state, batch)
  return params, jax.device_get(state["params"]), jax.device_get(metrics), step


def _exact_kl(p0, p1, batch) -> float:
  """Mean KL(softmax(z0 / T) || softmax(z1 / T)) over completion tokens in float64, from full logits."""
  ids, mask = train_step.sequence_inputs(batch)
  forward = jax.jit(lambda p: model.forward(CFG, p, ids, mask))
  logits = [np.asarray(forward(p), np.float64)[:, P - 1:P + N - 1] / TEMPERATURE for p in (p0, p1)]
  logq0, logq1 = (z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
                  for z in logits)
  kl_BN = (np.exp(logq0) * (logq0 - logq1)).sum(-1)
  return float((kl_BN * batch.mask).sum() / batch.mask.sum())


def _delta(a, b):
  return jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y, np.float64), a, b)


@pytest.mark.slow
def test_prediction_matches_realized_and_the_scale_caps_it():
  p0, free, m_free, step = _run(1e9)  # a target never reached: scale 1, the plain update
  _, plain, m_plain, plain_step = _run(0.0)
  assert step.kl_control and not plain_step.kl_control
  predicted, realized = float(m_free["kl_control/predicted"]), float(m_free["kl_control/realized"])
  assert float(m_free["kl_control/scale"]) == 1.0
  jax.tree.map(np.testing.assert_array_equal, free, plain)  # s = 1 changes nothing
  assert set(m_plain) | {"kl_control/predicted", "kl_control/scale", "kl_control/realized"} == set(m_free)
  # an independent float64 KL from full logits at the sampling temperature, over the completion positions
  assert realized == pytest.approx(_exact_kl(p0, free, _host()[1]), rel=1e-3)
  assert 1e-4 < realized < 3e-2, realized  # a real step, in the regime where the second order should hold
  assert predicted == pytest.approx(realized, rel=0.1)  # measured: 5% low at a realized KL of 2e-3
  target = realized / 4
  _, capped, m_cap, _ = _run(target)
  s = float(m_cap["kl_control/scale"])
  assert float(m_cap["kl_control/predicted"]) == pytest.approx(predicted, rel=1e-5)  # same proposal
  assert s == pytest.approx(np.sqrt(target / predicted), rel=1e-5) and s < 0.6
  assert float(m_cap["kl_control/realized"]) == pytest.approx(target, rel=0.1)
  # the applied update is s times the proposed one (the optimizer's output, weight decay included)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, s * b, atol=1e-6), _delta(capped, p0), _delta(free, p0))


@pytest.mark.slow
def test_control_off_is_the_plain_update_program_bit_for_bit():
  params, batch = _host()
  _, after, metrics, step = _run(0.0)
  assert not step.kl_control and "kl_control/scale" not in metrics
  assert engine.Stepper(sharding.make_mesh(), OPT, None, None).kl is None  # no kl_control section: off as well
  mesh = sharding.make_mesh()
  state, _ = engine.init_state(mesh, OPT, jax.eval_shape(lambda: params), lambda sh: jax.device_put(params, sh))
  grads, _ = jax.jit(lambda p, b: train_step.gradient_step(p, b, SPEC))(state["params"], batch)
  before = jax.jit(lambda s, g: train_step.update_step(s, g, OPT))(state, grads)[0]["params"]  # today's program
  jax.tree.map(np.testing.assert_array_equal, after, jax.device_get(before))


@pytest.mark.slow
def test_peak_bytes_count_the_kl_forward():
  *_, plain = _run(0.0)
  *_, step = _run(1e9)
  # the KL's forward + JVP holds at least the hidden states and their tangents of one slice: [B, N, D] float32 x 2
  assert step.update_temp_bytes >= plain.update_temp_bytes + 2 * 4 * B * N * CFG.hidden_size
  assert step.peak_bytes == max(step.grad_temp_bytes, step.update_temp_bytes) + step.grad_bytes
  assert step.grad_temp_bytes == plain.grad_temp_bytes  # the gradient program is untouched


@pytest.mark.slow
def test_microbatched_kl_is_the_token_weighted_mean():
  params, batch = _host()
  rng = np.random.default_rng(1)
  update = jax.tree.map(lambda x: (0.02 * rng.standard_normal(x.shape)).astype(np.float32), params)

  def kl(b, microbatches):
    spec = dataclasses.replace(SPEC, microbatches=microbatches)
    fn = jax.jit(lambda p, u, b: train_step.minibatch_kl(kl_control.predicted_kl, spec, p, u, b, 3))
    return float(fn(params, update, b))

  halves = [kl(jax.tree.map(lambda v: v[i:i + 2], batch), 1) for i in (0, 2)]
  weighted = (10 * halves[0] + 11 * halves[1]) / 21  # 7 + 3 and 5 + 6 completion tokens
  assert abs(np.mean(halves) / weighted - 1) > 1e-3  # an unweighted mean of the slices would be caught
  assert kl(batch, 2) == pytest.approx(weighted, rel=1e-5)
  assert kl(batch, 1) == pytest.approx(weighted, rel=1e-5)
