import jax.numpy as jnp
import numpy as np

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
  w = jnp.array([[1.0, 0.0], [0.5, 0.5]])  # sum of squares 1.5
  err = jnp.array([[[2.0, 9.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
  s = jnp.array([1.0, 5.0, 0.1])
  # unit 0: sqrt((1*4 + .25*1 + .25*1) / 1.5) = sqrt(3); the token with w = 0 does not count
  np.testing.assert_allclose(exposure.unit_exposure(w, err, s), [3 ** 0.5, 0.0, 0.1], rtol=1e-6)
  np.testing.assert_allclose(exposure.unit_exposure(w, err, s, ExposureSwitches(activation=False)),
                             [1.0, 5.0, 0.1], rtol=1e-6)
  np.testing.assert_allclose(exposure.unit_exposure(w, err, s, ExposureSwitches(susceptibility=False)),
                             [3 ** 0.5, 0.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(exposure.unit_exposure(w * 7, err, s), exposure.unit_exposure(w, err, s), rtol=1e-6)
  assert float(exposure.unit_exposure(w * 0, err, s).max()) == 0.0


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
