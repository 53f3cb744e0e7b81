"""Run-time risk predictors: their token weights, their scores from a batch, and how they are compared."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from hilore_jax import model
from hilore_jax.loop import step_hooks
from hilore_jax.memory import predictors
from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import UpdateBatch


def test_weights_by_hand():
  w = jnp.array([[0.2, 0.4]])
  logp = jnp.log(jnp.array([[0.5, 0.99]]))
  np.testing.assert_allclose(predictors.weights("exposure_v1", w, logp), w)
  np.testing.assert_allclose(predictors.weights("cotangent", w, logp), [[0.1, 0.004]], rtol=1e-4)
  with pytest.raises(ValueError, match="predictor must be one of"):
    predictors.weights("nope", w, logp)


def test_compare_chooses_the_best_within_unit_ranking():
  rng = np.random.default_rng(0)
  err = rng.uniform(size=(12, 3)) * np.array([1.0, 100.0, 1e4])  # units on very different scales
  scores = {"reversed": -err, "perfect": 3 * err + 1, "noise": rng.uniform(size=(12, 3))}
  rows, best = predictors.compare(scores, err, n_boot=200)
  assert best == "perfect"
  assert rows["perfect"]["within_unit_rho_median"] == pytest.approx(1.0)
  assert rows["perfect"]["ci_low"] == pytest.approx(1.0)
  assert rows["reversed"]["within_unit_rho_median"] == pytest.approx(-1.0)
  assert rows["perfect"]["units_defined"] == 3
  # a constant unit has no ranking; a predictor with none defined is never chosen over one with a figure
  rows, best = predictors.compare({"flat": np.ones((12, 3)), "perfect": err}, err, n_boot=10)
  assert best == "perfect" and np.isnan(rows["flat"]["within_unit_rho_median"])
  assert predictors.fit_grad_scale([2.0, 8.0, 0.0, 5.0], [1.0, 2.0, 3.0, 0.0]) == pytest.approx(3.0)


@pytest.fixture
def scorer(tiny_cfg):
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True)
  return predictors.Scorer(step_hooks.memory_hooks(None, spec))


def _batch(old_logp):
  B, P, N = 2, 3, 4
  return UpdateBatch(np.ones((B, P), np.int32), np.ones((B, P), np.int32), np.ones((B, N), np.int32),
                     np.ones((B, N), np.int32), np.array([1.0, -1.0], np.float32), np.asarray(old_logp, np.float32),
                     np.zeros(B, np.int32))


def test_scores_from_the_batch_alone(scorer):
  U = 2
  inputs = predictors.ScoreInputs(np.ones((U, 2)), np.array([[1.0] * 4, [2.0] * 4]), np.array([1.0, 0.5]))
  confident, unsure = _batch(np.full((2, 4), -1e-4)), _batch(np.full((2, 4), np.log(0.5)))
  v1 = ExposureSwitches()
  cot = dataclasses.replace(v1, predictor="cotangent")
  norm = predictors.Normalisation()
  s_v1 = scorer([confident, unsure], inputs, v1, norm)
  # the same |w| (ratio 1 on the old policy): exposure_v1 cannot tell the two apart
  np.testing.assert_allclose(s_v1[0], s_v1[1], rtol=1e-5)
  # the softmax cotangent can where confidence varies within the batch: unit 0's error sits at the last position,
  # whose token is confident in one batch (its weight is then ~0 against the others')
  lp = np.full((2, 4), np.log(0.5))
  lp[:, 3] = -1e-4
  peaked = inputs._replace(profile=np.array([[1.0, 1.0, 1.0, 8.0]] * 2))
  s_cot = scorer([_batch(lp), unsure], peaked, cot, norm)
  assert s_cot[0, 0] < 0.5 * s_cot[1, 0]
  s_pk = scorer([_batch(lp), unsure], peaked, v1, norm)
  np.testing.assert_allclose(s_pk[0], s_pk[1], rtol=1e-5)
  # by hand: |w| = 1/8 per token (token-mean over 8 tokens), prompt positions 0 and 1 get
  # sum_j w_j / (3 + j) = (1/3 + 1/4 + 1/5 + 1/6) / 8 each; flat unit profiles, the scale sum |w| = 1
  pw = (1 / 3 + 1 / 4 + 1 / 5 + 1 / 6) / 8
  want0 = np.sqrt(2 * (2 * pw**2 + 4 / 64))
  np.testing.assert_allclose(s_v1[0], [want0, 0.5 * np.sqrt(2 * (2 * pw**2 + 4 * 4 / 64))], rtol=1e-5)
  no_prompt = scorer([unsure], inputs, dataclasses.replace(v1, prompt=False), norm)
  np.testing.assert_allclose(no_prompt[0, 0], np.sqrt(8 / 64), rtol=1e-5)
  # incoherent: the scale is sqrt(sum w^2) = sqrt(8 / 64) instead of 1, so this flat unit scores its profile, 1
  incoherent = scorer([unsure], inputs, dataclasses.replace(v1, prompt=False, coherence="incoherent"), norm)
  np.testing.assert_allclose(incoherent[0, 0], 1.0, rtol=1e-5)
  np.testing.assert_allclose(scorer.l1([unsure], dataclasses.replace(v1, coherence="incoherent")), [np.sqrt(8 / 64)],
                             rtol=1e-6)
  # the clipped normalisation: under the clip the score is against c, not the batch's gradient scale
  clipped = scorer([unsure], inputs._replace(grad_scale=0.5), v1, predictors.Normalisation("clipped", 2.0))
  np.testing.assert_allclose(clipped[0], s_v1[1] / 2.0, rtol=1e-5)


def test_forward_predictor_reads_the_forwards_errors(scorer):
  U = 1
  inputs = predictors.ScoreInputs(np.ones((U, 2)), np.ones((U, 4)), np.ones(U))
  b = _batch(np.full((2, 4), np.log(0.5)))
  fwd = ExposureSwitches(predictor="cotangent_forward")
  norm = predictors.Normalisation()
  flat = np.ones((U, 2, 6), np.float32)  # the profile, seen by the forward: the same score
  np.testing.assert_allclose(scorer([b], inputs, fwd, norm, token_err=[flat]), scorer([b], inputs, fwd, norm),
                             rtol=1e-6)
  np.testing.assert_allclose(scorer([b], inputs, fwd, norm, token_err=[2 * flat]),
                             2 * scorer([b], inputs, fwd, norm), rtol=1e-6)
  np.testing.assert_allclose(scorer.l1([b], fwd), [0.5])  # sum of |w| (1 - p) = 8 * 1/8 * 0.5
