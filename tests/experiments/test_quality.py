import numpy as np
import pytest

from hilore_jax import cli
from hilore_jax import stats
from experiments.quality import run as quality
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
  assert "| gc | 50.0% [49.0, 51.0] | — | 4.00 | — | — | — | — | — |" in md
  assert "| hilore | 52.0% [51.0, 53.0] | — | 4.10 | — | — | 2.0 [2.0, 2.0] | — | — |" in md


def test_joint_score_is_accuracy_per_token_relative_to_the_base():
  runs = {"base": [{"accuracy": 0.4, "greedy_len": 4.0}, {"accuracy": 0.0, "greedy_len": 5.0}],
          "short": [{"accuracy": 0.4, "greedy_len": 2.0}, {"accuracy": 0.2, "greedy_len": 4.0}],
          "long": [{"accuracy": 0.44, "greedy_len": 4.4}, {"accuracy": 0.1, "greedy_len": 5.0}]}
  j = quality.joint_scores(runs, "base")
  np.testing.assert_allclose(j["base"], [0.4, 0.0])  # the base arm's score is its accuracy
  np.testing.assert_allclose(j["short"], [0.8, 0.25])  # as accurate with half the tokens: twice the score
  np.testing.assert_allclose(j["long"], [0.4, 0.1])  # 10% more accurate with 10% more tokens: the same


def test_run_tables_existing_runs_with_paired_joint_scores(tmp_path):
  """quality.run on finished run directories (it trains only missing pairs): the table, JSON and PNG."""
  import json

  cfg = cli.load_config(None, ["train.steps=3", "eval.pass_k=2"])
  arms = (quality.Arm("a", ()), quality.Arm("b", ("replay.enabled=true",)))
  acc = {"a": [0.5, 0.25], "b": [0.5, 0.5]}
  glen = {"a": [4.0, 4.0], "b": [2.0, 4.0]}
  for arm in ("a", "b"):
    for s in range(2):
      d = tmp_path / f"{arm}_seed{s}"
      d.mkdir()
      after = {"eval/accuracy": acc[arm][s], "eval/pass@2": 0.75, "eval/completion_len": glen[arm][s]}
      (d / "summary.json").write_text(json.dumps({"eval_before": {"eval/accuracy": 0.1}, "eval_after": after}))
      (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward/mean": 0.1 * i,
                                                           "completion_len/mean": 4.0}) + "\n" for i in range(3)))
  result = quality.run(cfg, 2, str(tmp_path), arms, progress=lambda s: None)
  # b: seed 0 as accurate with half the tokens (joint 1.0 vs 0.5), seed 1 +25 points at the same length
  np.testing.assert_allclose(result["per_arm"]["b"]["per_seed_joint"], [1.0, 0.5])
  assert result["paired"]["b"]["joint_pp"]["mean"] == pytest.approx(37.5)
  assert result["paired"]["b"]["accuracy_pp"]["mean"] == pytest.approx(12.5)
  assert result["paired"]["b"]["pass_k_pp"]["mean"] == pytest.approx(0.0)
  md = (tmp_path / "quality.md").read_text()
  assert "| b | 50.0% [50.0, 50.0] | 75.0% [75.0, 75.0] | 4.00 | 3.00 | 75.0% [50.0, 100.0] |" in md
  assert (tmp_path / "quality.png").stat().st_size > 0
