"""The statistics every report shares (hilore_jax/stats.py): intervals checked against hand-computed values."""

import numpy as np
import pytest

from hilore_jax import stats


def test_wilson_interval_matches_hand_computed_values():
  # 5 of 10, z = 1.96: centre 0.5, half 1.96 * sqrt(0.025 + 0.009604) / 1.38416 = 0.26341
  np.testing.assert_allclose(stats.wilson_ci(5, 10), [0.5 - 0.26341, 0.5 + 0.26341], atol=1e-5)
  lo, hi = stats.wilson_ci(0, 10)  # 0 of 10: [0, z^2 / (n + z^2)] = [0, 0.27754]
  assert lo == 0.0 and hi == pytest.approx(0.27754, abs=1e-5)
