"""The evaluation's intervals: Wilson across examples, the paired gain between two evaluations of the same examples."""

import numpy as np
import pytest

from hilore_jax import stats
from hilore_jax.loop import evaluation


def test_wilson_interval_matches_hand_computed_values():
  # 5 of 10, z = 1.96: centre 0.5, half 1.96 * sqrt(0.025 + 0.009604) / 1.38416 = 0.26341
  np.testing.assert_allclose(stats.wilson_ci(5, 10), [0.5 - 0.26341, 0.5 + 0.26341], atol=1e-5)
  lo, hi = stats.wilson_ci(0, 10)  # 0 of 10: [0, z^2 / (n + z^2)] = [0, 0.27754]
  assert lo == 0.0 and hi == pytest.approx(0.27754, abs=1e-5)


def test_paired_gain_interval_is_the_bootstrap_of_per_example_differences():
  lo, hi = evaluation.paired_gain_ci("0011", "0111")  # differences 0, 1, 0, 0
  assert [lo, hi] == pytest.approx([100 * v for v in stats.bootstrap_ci([0, 1, 0, 0])])
  assert lo == 0.0 and 50.0 <= hi <= 75.0  # resampled means of one 1 in four: 0, 0.25, 0.5, 0.75 (1.0 at 0.4%)
  # the same examples solved before and after: no uncertainty left, unlike two unpaired proportions
  assert evaluation.paired_gain_ci("0101", "0101") == [0.0, 0.0]
  with pytest.raises(ValueError, match="differ in length"):
    evaluation.paired_gain_ci("01", "011")
