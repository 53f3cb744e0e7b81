"""The risk metrics: the error an L set puts into the gradient, the clipped gradient and the optimizer's update."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hilore_jax.memory import risk


def test_relative_and_clipped_by_hand():
  exact = {"a": jnp.array([3.0, 4.0])}  # ||g|| = 5
  g = {"a": jnp.array([3.0, 4.0 + 0.5])}  # ||dg|| = 0.5
  ref = risk.Reference(exact, 5.0, "clipped", max_grad_norm=10.0)
  assert ref.errors(g) == pytest.approx({"relative": 0.1, "clipped": 0.05})  # under the clip: against c
  assert ref.error(g) == pytest.approx(0.05)
  big = risk.Reference(exact, 5.0, "clipped", max_grad_norm=1.0)
  assert big.error(g) == pytest.approx(0.1)  # clipped: against ||g|| itself
  assert risk.Reference(exact, 5.0, "clipped").error(g) == pytest.approx(0.1)  # no clip: the relative error
  assert risk.as_reference(exact).metric == "relative" and risk.as_reference(ref) is ref
  with pytest.raises(ValueError, match="needs the optimizer"):
    risk.Reference(exact, 5.0, "update")


def test_static_clip_scales_each_units_static_risk_by_the_clip_share_by_hand():
  # the clipped error is the relative one times min(1, ||g|| / c): static_clip applies that to the static risk with
  # the forward-only estimate g_hat (issue 47)
  static = np.array([0.02, 0.5, 0.0])
  np.testing.assert_allclose(risk.static_clip(static, 0.25, 1.0), [0.005, 0.125, 0.0])
  np.testing.assert_allclose(risk.static_clip(static, 3.0, 1.0), static)  # over the clip: the static risk itself
  np.testing.assert_allclose(risk.static_clip(static, [0.5, 2.0], 1.0), [static / 2, static])  # [M, U]
  np.testing.assert_allclose(risk.static_clip(static, 0.1, 0.0), static)  # no clip: nothing divides it away
  assert risk.clip_scale(-1.0, 1.0) == 0.0  # a norm is never negative
  # equal to the clipped metric's own ratio where g_hat is the exact ||g||: dg 0.5 under ||g|| 0.25, c 1
  assert risk.clipped(0.5, 0.25, 1.0) == pytest.approx(risk.relative(0.5, 0.25) * float(risk.clip_scale(0.25, 1.0)))


def test_update_error_of_clipped_sgd_and_adam_by_hand():
  params = {"a": jnp.zeros(2)}
  exact, g = {"a": jnp.array([3.0, -4.0])}, {"a": jnp.array([-1.0, -4.0])}
  # clip at 1 then sgd(0.1): u = -0.1 g / ||g||; ||g|| = 5, ||g_L|| = sqrt(17)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
  want = np.linalg.norm(np.array([-1, -4]) / 17 ** 0.5 - np.array([3, -4]) / 5)  # ||u|| = 0.1
  ref = risk.Reference(exact, 5.0, "update", 1.0, opt.update, opt.init(params), params)
  assert ref.error(g) == pytest.approx(want, rel=1e-5)
  # Adam's first step from a fresh state is lr * sign(g): only the flipped sign counts, |2| / sqrt(2)
  adam = optax.adam(1e-3, eps=1e-12)
  ref = risk.Reference(exact, 5.0, "update", 0.0, adam.update, adam.init(params), params)
  assert ref.error(g) == pytest.approx(2 ** 0.5, rel=1e-5)
  assert ref.error({"a": jnp.array([1.0, -9.0])}) == pytest.approx(0.0, abs=1e-6)
  assert set(ref.errors(g)) == {"relative", "clipped", "update"}


def test_spread_removed_by_hand():
  # p10 / p90 of [1, 10, 100, 1000, 10000] interpolate to 4.6 and 6400 (numpy's linear quantiles)
  norms = [1.0, 10.0, 100.0, 1000.0, 10000.0]
  lo, hi = np.quantile(norms, [0.1, 0.9])
  out = risk.spread_removed(norms, [1.0, 2.0, 3.0, 4.0, 5.0])
  assert out["log10_spread_p10_p90"] == pytest.approx(np.log10(hi / lo))
  assert out["max_over_min"] == pytest.approx(1e4) and out["max_over_min_bounded"] == pytest.approx(5.0)
  b = np.log10(np.quantile([1, 2, 3, 4, 5], 0.9) / np.quantile([1, 2, 3, 4, 5], 0.1))
  assert out["spread_removed_share"] == pytest.approx(1 - b / np.log10(hi / lo))
  assert np.isnan(risk.log_spread([0.0, 3.0]))  # one positive norm: no spread
