"""The evaluation's paired gain between two evaluations of the same examples (Wilson: tests/test_stats.py)."""

import pytest

from hilore_jax import stats
from hilore_jax.loop import evaluation


def test_paired_gain_interval_is_the_bootstrap_of_per_example_differences():
  lo, hi = evaluation.paired_gain_ci("0011", "0111")  # differences 0, 1, 0, 0
  assert [lo, hi] == pytest.approx([100 * v for v in stats.bootstrap_ci([0, 1, 0, 0])])
  assert lo == 0.0 and 50.0 <= hi <= 75.0  # resampled means of one 1 in four: 0, 0.25, 0.5, 0.75 (1.0 at 0.4%)
  # the same examples solved before and after: no uncertainty left, unlike two unpaired proportions
  assert evaluation.paired_gain_ci("0101", "0101") == [0.0, 0.0]
  with pytest.raises(ValueError, match="differ in length"):
    evaluation.paired_gain_ci("01", "011")
