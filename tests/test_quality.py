import numpy as np
import pytest

from hilore_jax import cli
from hilore_jax.bench import quality, stats
from hilore_jax.errors import ConfigError


def test_arms_parse_and_override_the_config():
  arm = quality.Arm.parse("int4:memory.policy=hilore,memory.lowp_format=int4")
  assert arm == quality.Arm("int4", ("memory.policy=hilore", "memory.lowp_format=int4"))
  assert quality.Arm.parse("base:").overrides == ()
  with pytest.raises(ConfigError, match="name:key.path=value"):
    quality.Arm.parse("no-colon")
  cfg = cli.load_config(None, ["model.hidden_size=40", "train.steps=7"])
  c = quality.arm_config(cfg, arm, seed=11, run_dir="/tmp/x")
  assert (c.memory.lowp_format, c.seed, c.out_dir, c.train.steps) == ("int4", 11, "/tmp/x", 7)
  assert c.model.shape_config().hidden_size == 40 and c.eval.at_start and not c.checkpoint.export_hf


def test_bootstrap_ci_brackets_the_mean_and_shrinks_with_n():
  rng = np.random.default_rng(0)
  small, big = rng.normal(1.0, 1.0, 8), rng.normal(1.0, 1.0, 800)
  lo, hi = stats.bootstrap_ci(small)
  assert lo < small.mean() < hi
  lo2, hi2 = stats.bootstrap_ci(big)
  assert hi2 - lo2 < (hi - lo) / 5 and lo2 < 1.0 < hi2
  assert np.isnan(stats.bootstrap_ci([3.0])[0])
  np.testing.assert_allclose(stats.paired_gain_pct([1.0, 2.0], [1.1, 2.0]), [10.0, 0.0])


def test_report_shows_paired_differences():
  s = lambda m: {"mean": m, "std": 0.0, "ci_low": m - 0.01, "ci_high": m + 0.01, "n": 3}
  result = {"base": "gc", "seeds": 3, "per_arm": {"gc": {"accuracy": s(0.5), "completion_len": s(4.0)},
                                                  "hilore": {"accuracy": s(0.52), "completion_len": s(4.1)}},
            "paired": {"hilore": {"accuracy_pp": s(2.0)}}}
  md = quality.report(result, 4)
  assert "| gc | 50.0% [49.0, 51.0] | — | 4.00 | — |" in md
  assert "| hilore | 52.0% [51.0, 53.0] | — | 4.10 | 2.0 [2.0, 2.0] |" in md
