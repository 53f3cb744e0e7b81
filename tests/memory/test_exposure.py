import jax.numpy as jnp
import numpy as np
import pytest

from hilore_jax.memory import exposure
from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.rl.config import GRPOConfig


def _inputs():
  logp = jnp.log(jnp.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
  old = logp - jnp.array([[0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # one clipped token
  adv = jnp.array([1.0, 0.0, -2.0])  # the middle group has zero advantage
  mask = jnp.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
  return logp, old, logp, adv, mask


def test_token_weights_by_hand():
  logp, old, ref, adv, mask = _inputs()
  lc = GRPOConfig(loss_agg="token-mean", eps_low=0.2, eps_high=0.2)
  w = exposure.token_weights(logp, old, ref, adv, mask, lc)
  # 6 tokens: |A * ratio| / 6 where unclipped; ratio exp(0.5) > 1.2 with A > 0 is clipped -> 0
  np.testing.assert_allclose(w, [[1 / 6, 0.0, 1 / 6], [0, 0, 0], [2 / 6, 0, 0]], rtol=1e-6)
  no_clip = exposure.token_weights(logp, old, ref, adv, mask, lc, ExposureSwitches(ratio_clip=False))
  np.testing.assert_allclose(no_clip, [[1 / 6] * 3, [0, 0, 0], [2 / 6, 0, 0]], rtol=1e-6)
  no_mask = exposure.token_weights(logp, old, ref, adv, mask, lc, ExposureSwitches(update_mask=False))
  np.testing.assert_allclose(no_mask[2], [2 / 9] * 3, rtol=1e-6)  # all 9 positions count


def test_kl_switch():
  logp, old, _, adv, mask = _inputs()
  ref = logp - 0.3
  lc = GRPOConfig(beta=0.5, kl_estimator="k1")
  on = exposure.token_weights(logp, logp, ref, adv * 0, mask, lc)
  off = exposure.token_weights(logp, logp, ref, adv * 0, mask, lc, ExposureSwitches(kl=False))
  np.testing.assert_allclose(on, 0.5 * mask / 6, rtol=1e-6)  # k1's gradient is 1
  assert float(off.sum()) == 0.0


def test_unit_exposure_and_ablations():
  w = jnp.array([[1.0, 0.0], [0.5, 0.5]])  # sum 2, sum of squares 1.5
  err = jnp.array([[[2.0, 9.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
  s = jnp.array([1.0, 5.0, 0.1])
  # unit 0: sqrt(1*4 + .25*1 + .25*1) / 2 = sqrt(4.5) / 2; the token with w = 0 does not count
  np.testing.assert_allclose(exposure.unit_exposure(w, err, s), [4.5 ** 0.5 / 2, 0.0, 0.1 * 1.5 ** 0.5 / 2],
                             rtol=1e-6)
  np.testing.assert_allclose(exposure.unit_exposure(w, err, s, ExposureSwitches(activation=False)),
                             np.array([1.0, 5.0, 0.1]) * 1.5 ** 0.5 / 2, rtol=1e-6)
  np.testing.assert_allclose(exposure.unit_exposure(w, err, s, ExposureSwitches(susceptibility=False)),
                             [4.5 ** 0.5 / 2, 0.0, 1.5 ** 0.5 / 2], rtol=1e-6)
  np.testing.assert_allclose(exposure.unit_exposure(w * 7, err, s), exposure.unit_exposure(w, err, s), rtol=1e-6)
  assert float(exposure.unit_exposure(w * 0, err, s).max()) == 0.0
  np.testing.assert_allclose(exposure.unit_exposure(w, err, s, scale=4.0)[0], 4.5 ** 0.5 / 4, rtol=1e-6)


def test_forward_and_runtime_scores_share_one_normalisation():
  """Defect 6: the score with a forward's per-token errors was divided by ||w||_2, the run-time one (which the
  susceptibility is fitted to) by ||w||_1; with per-token errors equal to the profile they must agree exactly."""
  w = jnp.array([[0.3, 0.0, 0.2], [0.1, 0.4, 0.0]])
  profile = jnp.array([[1.0, 2.0, 3.0], [0.5, 0.5, 4.0]])
  err = jnp.broadcast_to(profile[:, None, :], (2, 2, 3))  # every row shows the profile
  s = jnp.array([2.0, 0.3])
  np.testing.assert_allclose(exposure.unit_exposure(w, err, s), exposure.runtime_scores(w, profile, s), rtol=1e-6)


def test_prompt_weights_by_hand():
  """Defect 3: prompt positions carry the attention cotangent that reaches them (uniform attention)."""
  c = jnp.array([[0.6, 0.3], [0.0, 0.0]])
  prompt_mask = jnp.array([[0, 1, 1, 1], [1, 1, 1, 1]])  # row 0 left-padded: 3 real prompt tokens
  # row 0: completion token 0 sees 3 keys, token 1 sees 4: 0.6 / 3 + 0.3 / 4 = 0.275 on each real prompt position
  # but the last (position 3 predicts token 0: a completion position); row 1 has no weight
  np.testing.assert_allclose(exposure.prompt_weights(c, prompt_mask), [[0, 0.275, 0.275], [0, 0, 0]], rtol=1e-6)
  full = exposure.sequence_weights(c, prompt_mask)
  np.testing.assert_allclose(full, [[0, 0.275, 0.275, 0.6, 0.3], [0, 0, 0, 0, 0]], rtol=1e-6)
  np.testing.assert_allclose(exposure.sequence_weights(c, prompt_mask, prompt=False)[:, :3], 0.0)
  np.testing.assert_array_equal(exposure.position_mask(prompt_mask, jnp.array([[1, 1], [1, 0]])),
                                [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
  # an error only at prompt positions reaches the score
  err = jnp.zeros((1, 2, 5)).at[0, 0, 1].set(2.0)
  np.testing.assert_allclose(exposure.unit_exposure(full, err, jnp.ones(1), scale=0.9), [0.275 * 2 / 0.9],
                             rtol=1e-6)


def test_token_norm_by_hand():
  """Defect (b): the normaliser could only sum token weights as if their gradients added coherently; GRPO's
  zero-mean advantages make them cancel, so their root sum of squares is available by name (coherence)."""
  c = jnp.array([[0.3, -0.4], [0.0, 1.2]])
  assert float(exposure.token_norm(c, "incoherent")) == pytest.approx(1.3)  # sqrt(.09 + .16 + 1.44)
  assert float(exposure.token_norm(c)) == pytest.approx(1.9)  # coherent: the sum, the default
  with pytest.raises(ValueError, match="coherence must be one of"):
    ExposureSwitches(coherence="measured")
  # n equal tokens of a flat profile 0.1: incoherent scores the profile whatever n, coherent falls as 1/sqrt(n)
  prof, s, inc = jnp.full((1, 16), 0.1), jnp.ones(1), ExposureSwitches(coherence="incoherent")
  for n in (4, 16):
    w = jnp.ones((1, n)) / n
    assert float(exposure.runtime_scores(w, prof, s, inc)[0]) == pytest.approx(0.1, rel=1e-5)
    assert float(exposure.runtime_scores(w, prof, s)[0]) == pytest.approx(0.1 / n ** 0.5, rel=1e-5)
    err = jnp.full((1, 1, n), 0.1)  # the forward's score normalises alike
    assert float(exposure.unit_exposure(w, err, s, inc)[0]) == pytest.approx(0.1, rel=1e-5)


def test_softmax_cotangent_and_normaliser_by_hand():
  logp = jnp.log(jnp.array([[0.25, 0.9]]))
  np.testing.assert_allclose(exposure.softmax_cotangent(logp), [[0.75, 0.1]], rtol=1e-5)
  assert float(exposure.softmax_cotangent(jnp.zeros((1, 1)))[0, 0]) == 1.0  # a placeholder: unknown
  assert float(exposure.normaliser(2.0, "relative", 10.0, 1.0)) == 2.0
  assert float(exposure.normaliser(2.0, "clipped", 0.3, 1.0)) == 1.0  # ||g|| ~ 0.6 under the clip
  assert float(exposure.normaliser(2.0, "update", 3.0, 1.0)) == 6.0


def test_fit_length():
  p = jnp.array([[1.0, 2.0, 3.0]])
  np.testing.assert_array_equal(exposure.fit_length(p, 2), [[1, 2]])
  np.testing.assert_array_equal(exposure.fit_length(p, 5), [[1, 2, 3, 3, 3]])
  np.testing.assert_array_equal(exposure.fit_length(p, 2, from_end=True), [[2, 3]])
  np.testing.assert_array_equal(exposure.fit_length(p, 4, from_end=True), [[1, 1, 2, 3]])
  np.testing.assert_array_equal(exposure.fit_length(jnp.zeros((2, 0)), 3), jnp.zeros((2, 3)))


def test_position_profile_by_hand():
  err = jnp.array([[[1.0, 2.0, 0.0], [3.0, 0.0, 5.0]]])
  mask = jnp.array([[1, 1, 0], [1, 0, 0]])  # position 2 holds no token: the unit's overall RMS
  np.testing.assert_allclose(exposure.position_profile(err, mask), [[5 ** 0.5, 2.0, (14 / 3) ** 0.5]], rtol=1e-6)


def test_runtime_scores_by_hand():
  logp, old, ref, adv, mask = _inputs()
  lc = GRPOConfig(loss_agg="token-mean", eps_low=0.2, eps_high=0.2)
  w = exposure.token_weights(logp, old, ref, adv, mask, lc)  # [[1/6, 0 (clipped), 1/6], [0]*3 (zero adv), [2/6, 0, 0]]
  profile = jnp.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
  sus = jnp.array([1.0, 0.5])
  # per position sum w^2: 5/36, 0, 1/36; sum |w| = 4/6
  # unit 0: sqrt(5/36 * 1 + 1/36 * 9) / (4/6) = sqrt(14) / 4; unit 1 (flat): 0.5 * sqrt(6/36) / (4/6) = sqrt(6) / 8
  np.testing.assert_allclose(exposure.runtime_scores(w, profile, sus), [14 ** 0.5 / 4, 6 ** 0.5 / 8], rtol=1e-6)
  # the clipped token sits where unit 0's error is largest: without clipping its score is sqrt(18) / 5
  w_nc = exposure.token_weights(logp, old, ref, adv, mask, lc, ExposureSwitches(ratio_clip=False))
  np.testing.assert_allclose(exposure.runtime_scores(w_nc, profile, sus)[0], 18 ** 0.5 / 5, rtol=1e-6)
  # the zero-advantage row adds nothing; no update at all: every score 0
  assert float(exposure.runtime_scores(w * 0, profile, sus).max()) == 0.0
  flat = exposure.runtime_scores(w, profile, sus, ExposureSwitches(activation=False))
  np.testing.assert_allclose(flat, [6 ** 0.5 / 4, 6 ** 0.5 / 8], rtol=1e-6)
  # a longer batch than the profile reads its last position
  w4 = jnp.pad(w, ((0, 0), (0, 1)))
  np.testing.assert_allclose(exposure.runtime_scores(w4, profile, sus), exposure.runtime_scores(w, profile, sus))
