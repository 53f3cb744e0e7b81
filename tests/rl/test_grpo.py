import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hilore_jax.rl import grpo
from hilore_jax.rl.config import GRPOConfig as LossConfig


def test_grpo_advantages_by_hand():
  r = jnp.array([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
  # group 0: mean 1/3, unbiased std sqrt(1/3)
  s = np.sqrt(1 / 3)
  np.testing.assert_allclose(grpo.advantages("grpo", r, "group")[0],
                             [(2 / 3) / (s + 1e-4), (-1 / 3) / (s + 1e-4), (-1 / 3) / (s + 1e-4)], rtol=1e-6)
  np.testing.assert_allclose(grpo.advantages("grpo", r, "group")[1], 0.0)
  np.testing.assert_allclose(grpo.advantages("grpo", r, "none")[0], [2 / 3, -1 / 3, -1 / 3], rtol=1e-6)
  batch_std = np.std([1, 0, 0, 2, 2, 2], ddof=1)
  np.testing.assert_allclose(grpo.advantages("grpo", r, "batch")[0], np.array([2, -1, -1]) / 3 / (batch_std + 1e-4),
                             rtol=1e-6)


def test_rloo_and_dr_grpo_by_hand():
  r = jnp.array([[1.0, 0.0, 0.0, 1.0]])
  # leave-one-out means: (0+0+1)/3, (1+0+1)/3, ...
  np.testing.assert_allclose(grpo.advantages("rloo", r, "none"), [[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3]],
                             rtol=1e-6)
  np.testing.assert_allclose(grpo.advantages("dr_grpo", r, "group"), [[0.5, -0.5, -0.5, 0.5]])
  assert grpo.zero_std_groups(jnp.array([[1.0, 1.0], [0.0, 1.0]])).tolist() == [True, False]


def test_clipping_by_hand():
  lc = LossConfig(eps_low=0.2, eps_high=0.28)
  logp = jnp.log(jnp.array([[1.5, 0.5, 1.1, 0.7]]))
  old = jnp.zeros((1, 4))
  adv = jnp.array([1.0])
  loss, clipped = grpo.policy_loss(logp, old, adv[:, None], lc)
  # A > 0: ratio 1.5 clipped to 1.28; 0.5 stays (min picks the smaller); 1.1 inside; 0.7 stays
  np.testing.assert_allclose(loss, [[-1.28, -0.5, -1.1, -0.7]], rtol=1e-6)
  assert clipped.tolist() == [[True, False, False, False]]
  loss, clipped = grpo.policy_loss(logp, old, -adv[:, None], lc)
  # A < 0: ratio 0.5 clipped to 0.8, 0.7 clipped to 0.8; 1.5 stays
  np.testing.assert_allclose(loss, [[1.5, 0.8, 1.1, 0.8]], rtol=1e-6)
  assert clipped.tolist() == [[False, True, False, True]]


def test_dual_clip_by_hand():
  lc = LossConfig(eps_low=0.2, eps_high=0.2, dual_clip=3.0)
  logp = jnp.log(jnp.array([[5.0, 2.0]]))
  loss, clipped = grpo.policy_loss(logp, jnp.zeros((1, 2)), jnp.array([[-1.0]]), lc)
  np.testing.assert_allclose(loss, [[3.0, 2.0]], rtol=1e-6)  # 5 capped at c*|A| = 3
  assert clipped.tolist() == [[True, False]]


def test_kl_estimators_by_hand():
  logp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
  log_r = np.log(0.5)
  np.testing.assert_allclose(grpo.kl_estimate(logp, ref, "k1"), [-log_r], rtol=1e-6)
  np.testing.assert_allclose(grpo.kl_estimate(logp, ref, "k2"), [0.5 * log_r**2], rtol=1e-6)
  np.testing.assert_allclose(grpo.kl_estimate(logp, ref, "k3"), [0.5 - 1 - log_r], rtol=1e-6)


def test_aggregations_by_hand():
  per = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0]])
  old = jnp.zeros_like(per)
  adv = jnp.array([-1.0, -1.0])
  logp = jnp.log(per)  # with old = 0 and A = -1, the unclipped loss is the ratio = per (eps large)
  for agg, want in [("token-mean", 10 / 4), ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),
                    ("seq-mean-token-sum-norm", 10 / (2 * 5))]:
    lc = LossConfig(loss_agg=agg, eps_low=0.99, eps_high=10.0, max_completion_len=5)
    loss, _ = grpo.grpo_loss(jnp.where(mask > 0, logp, 0.0), old, old, adv, mask, lc)
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_microbatched_normalisers_equal_full_batch():
  rng = np.random.RandomState(0)
  logp = jnp.asarray(rng.randn(6, 5) * 0.1 - 1)
  old = logp + jnp.asarray(rng.randn(6, 5) * 0.3)
  ref = logp + jnp.asarray(rng.randn(6, 5) * 0.3)
  adv = jnp.asarray(rng.randn(6))
  mask = jnp.asarray(rng.rand(6, 5) > 0.3)
  for agg in grpo.LOSS_AGGS:
    lc = LossConfig(loss_agg=agg, beta=0.1, max_completion_len=5)
    full, _ = grpo.grpo_loss(logp, old, ref, adv, mask, lc)
    ns, nt = grpo.normalisers(mask)
    parts = [grpo.grpo_loss(logp[i:i + 2], old[i:i + 2], ref[i:i + 2], adv[i:i + 2], mask[i:i + 2], lc, ns, nt)[0]
             for i in range(0, 6, 2)]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-6)


@pytest.mark.parametrize("agg,beta,est,dual", list(itertools.product(
    grpo.LOSS_AGGS, [0.0, 0.05], grpo.KL_ESTIMATORS, [None, 2.5]))[::2])
def test_loss_coefficients_equal_autodiff(agg, beta, est, dual):
  rng = np.random.RandomState(1)
  B, T = 5, 7
  old = jnp.asarray(rng.randn(B, T) * 0.2 - 2)
  logp = old + jnp.asarray(rng.randn(B, T) * 0.4)  # some ratios far outside the clip range
  ref = old + jnp.asarray(rng.randn(B, T) * 0.3)
  adv = jnp.asarray(np.array([1.3, -0.7, 0.0, 2.0, -1.5]))
  mask = jnp.asarray(rng.rand(B, T) > 0.25)
  lc = LossConfig(loss_agg=agg, eps_low=0.2, eps_high=0.28, dual_clip=dual, beta=beta, kl_estimator=est,
                  max_completion_len=T)
  auto = jax.grad(lambda lp: grpo.grpo_loss(lp, old, ref, adv, mask, lc)[0])(logp)
  w = jax.jit(grpo.loss_coefficients, static_argnums=5)(logp, old, ref, adv, mask, lc)
  np.testing.assert_allclose(w, auto, rtol=1e-5, atol=1e-8)
  assert np.all(np.asarray(w)[2][np.asarray(mask[2])] == 0) or beta > 0  # zero advantage: no pg signal
  _, clipped = grpo.policy_loss(logp, old, adv[:, None], lc)
  if beta == 0:
    assert np.all(np.asarray(w)[np.asarray(clipped)] == 0)
    assert np.any(np.asarray(clipped) & np.asarray(mask))


def test_bad_names():
  with pytest.raises(ValueError, match="grpo.loss_agg must be one of"):
    LossConfig(loss_agg="sum")
  with pytest.raises(ValueError, match="grpo.advantage must be one of"):
    LossConfig(advantage="ppo")
  with pytest.raises(ValueError, match="grpo.std_scale must be one of"):
    LossConfig(std_scale="row")
  with pytest.raises(ValueError, match="std_scale must be one of"):  # the numerics refuse it too
    grpo.advantages("grpo", jnp.zeros((1, 2)), "row")


@pytest.mark.parametrize("key,value,message", [
    ("eps_low", 0.0, r"grpo.eps_low must be in \(0.0, 1.0\), got 0.0"),
    ("eps_low", 1.0, r"grpo.eps_low must be in \(0.0, 1.0\), got 1.0"),
    ("eps_high", 0.0, r"grpo.eps_high must be > 0, got 0.0"),
])
def test_zero_or_full_clip_range_names_the_key(key, value, message):
  with pytest.raises(ValueError, match=message):
    LossConfig(**{key: value})


@pytest.mark.parametrize("beta,est", [(0.0, "k3"), (0.1, "k3"), (0.1, "k2")])
def test_masked_inf_and_huge_values_never_reach_loss_or_gradient(beta, est):
  rng = np.random.RandomState(2)
  B, T = 3, 5
  old = jnp.asarray(rng.randn(B, T) * 0.2 - 2)
  logp = old + jnp.asarray(rng.randn(B, T) * 0.1)
  ref = old + jnp.asarray(rng.randn(B, T) * 0.1)
  adv = jnp.array([1.0, -2.0, 0.5])
  mask = jnp.asarray(np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]))
  pad = mask == 0
  # what padding can hold: a pad token's -inf log-prob, a ratio exp(1e4) that overflows, a nan reference
  bad_logp = jnp.where(pad, -jnp.inf, logp).at[0, 4].set(1e4)
  bad_old = jnp.where(pad, -1e4, old).at[2, 1].set(-jnp.inf)
  bad_ref = jnp.where(pad, jnp.nan, ref)
  lc = LossConfig(beta=beta, kl_estimator=est, eps_low=0.2, eps_high=0.28)

  def loss(lp, o, r):
    return grpo.grpo_loss(lp, o, r, adv, mask, lc)[0]

  clean, clean_grad = jax.value_and_grad(loss)(logp, old, ref)
  got, got_grad = jax.jit(jax.value_and_grad(loss))(bad_logp, bad_old, bad_ref)
  np.testing.assert_allclose(got, clean, rtol=1e-6)
  np.testing.assert_allclose(got_grad, clean_grad, rtol=1e-6)
  assert np.all(np.asarray(got_grad)[np.asarray(pad)] == 0.0)
  _, stats = grpo.grpo_loss(bad_logp, bad_old, bad_ref, adv, mask, lc)
  _, clean_stats = grpo.grpo_loss(logp, old, ref, adv, mask, lc)
  for k in clean_stats:
    np.testing.assert_allclose(stats[k], clean_stats[k], rtol=1e-6)
  w = grpo.loss_coefficients(bad_logp, bad_old, bad_ref, adv, mask, lc)
  np.testing.assert_allclose(w, grpo.loss_coefficients(logp, old, ref, adv, mask, lc), rtol=1e-6)


@pytest.mark.slow
def test_kl_clamp_by_hand():
  # defect 7: a token whose probability collapsed against the reference (1e-3 vs 0.5: log r = log 500 = 6.21) has
  # k3 gradient 1 - r = -499; clamping log r at 2 bounds the term (e^2 - 3) and gives that token no KL gradient
  logp, ref = jnp.log(jnp.array([0.5, 1e-3])), jnp.log(jnp.array([0.25, 0.5]))
  np.testing.assert_allclose(grpo.kl_grad(logp, ref, "k3"), [0.5, -499.0], rtol=1e-4)
  np.testing.assert_allclose(grpo.kl_estimate(logp, ref, "k3", clamp=2.0), [0.5 - 1 - np.log(0.5), np.e**2 - 3],
                             rtol=1e-5)
  np.testing.assert_allclose(grpo.kl_grad(logp, ref, "k3", clamp=2.0), [0.5, 0.0], rtol=1e-5)
  auto = jax.grad(lambda lp: grpo.kl_estimate(lp, ref, "k3", clamp=2.0).sum())(logp)
  np.testing.assert_allclose(auto, [0.5, 0.0], rtol=1e-5)
  # in the loss: off by default (unchanged), and the loss coefficients follow autodiff with it on
  mask, adv, old = jnp.ones((1, 2)), jnp.zeros(1), logp[None]
  on = LossConfig(beta=0.1, kl_clamp=2.0)
  w = grpo.loss_coefficients(logp[None], old, ref[None], adv, mask, on)
  np.testing.assert_allclose(w, [[0.1 * 0.5 / 2, 0.0]], rtol=1e-5)  # token-mean over 2 tokens
  g = jax.grad(lambda lp: grpo.grpo_loss(lp, old, ref[None], adv, mask, on)[0])(logp[None])
  np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-9)
  off = grpo.loss_coefficients(logp[None], old, ref[None], adv, mask, LossConfig(beta=0.1))
  np.testing.assert_allclose(off, [[0.1 * 0.5 / 2, 0.1 * -499 / 2]], rtol=1e-4)
  with pytest.raises(ValueError, match="kl_clamp bounds the k3"):
    LossConfig(beta=0.1, kl_estimator="k1", kl_clamp=2.0)
  with pytest.raises(ValueError, match="grpo.kl_clamp must be > 0"):
    LossConfig(kl_clamp=0.0)
