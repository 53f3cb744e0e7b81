"""The split step updates exactly as the one-function step does (that clipping does not undo its remat is checked
through the clip command, tests/experiments/test_bench.py)."""

import builders
import jax
import numpy as np
import optax
import pytest
from tolerance import assert_close, assert_trees_close

from hilore_jax import model, sharding
from hilore_jax.loop import engine
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig

CFG = builders.tiny_model(vocab_size=61, hidden_size=32, intermediate_size=87, num_hidden_layers=3)
B, P, N = 4, 7, 121


def _batch(rng=np.random.default_rng(0)):
  return builders.update_batch(rng, P, N, 61, rng.integers(N // 2, N + 1, B))


def _state(optimizer, mesh):
  params = builders.params(CFG, init_std=0.1)
  return engine.init_state(mesh, optimizer, jax.eval_shape(lambda: params), lambda sh: jax.device_put(params, sh))


@pytest.mark.slow
def test_split_step_updates_exactly_as_the_one_function_step():
  mesh = sharding.make_mesh()
  # eps=1e-3 keeps Adam's first step near-linear in the gradient. With 1e-8 it is lr * sign(g) for every clipped
  # gradient, so float32 noise from two programs fusing differently on another CPU (26 steps of a leaf's largest
  # gradient, say) would move the state by ~750 steps of its largest value; with 1e-3, by ~1
  opt = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(3e-3, eps=1e-3, weight_decay=0.01))
  spec = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(CFG.num_hidden_layers, model.FULL_REMAT))
  batch = _batch()
  state, shardings = _state(opt, mesh)
  fused_state, fused_m = jax.jit(lambda s, b: train_step.train_step(s, b, spec, opt))(state, batch)
  state, _ = _state(opt, mesh)
  split_state, split_m = engine.Stepper(mesh, opt, state, shardings)(spec, state, batch)
  assert float(split_m["grad_norm"]) > 0.05  # the clip is active
  # bit-identical on the machines measured. Steps of the state's largest value (the norms' 1.0): the biases start
  # at zero, so their own scale is the update's. Weight decay alone moves the state by ~250 such steps: a dropped
  # term or a second clip fails at 32
  assert_trees_close(split_state, fused_state, ulps=32, scale="tree")
  for k in set(fused_m) - {train_step.TOKEN_LOGP}:  # the loss is a mean of terms of either sign: steps of the
    # terms' scale (~1), not of the mean
    assert_close(float(split_m[k]), float(fused_m[k]), ulps=64, scale=max(1.0, abs(float(fused_m[k]))))
  # the per-token log-probs the next pass's exposure reads: the forward's, identical in both programs
  np.testing.assert_array_equal(np.asarray(split_m[train_step.TOKEN_LOGP]), np.asarray(fused_m[train_step.TOKEN_LOGP]))
  assert int(split_state["step"]) == 1


@pytest.mark.slow
def test_token_logp_output_is_the_forward_in_every_microbatch_split():
  spec1 = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(CFG.num_hidden_layers, model.FULL_REMAT))
  spec2 = train_step.StepSpec(CFG, GRPOConfig(), spec1.policies, microbatches=2)
  batch = _batch()
  want = train_step.completion_logprobs(CFG, _state(optax.sgd(0.1), sharding.make_mesh())[0]["params"], batch)[0]
  for spec in (spec1, spec2):
    params = _state(optax.sgd(0.1), sharding.make_mesh())[0]["params"]
    _, m = jax.jit(lambda p, b: train_step.gradient_step(p, b, spec))(params, batch)
    assert m[train_step.TOKEN_LOGP].shape == batch.tokens.shape
    np.testing.assert_allclose(np.asarray(m[train_step.TOKEN_LOGP]), np.asarray(want), rtol=1e-5, atol=1e-5)
