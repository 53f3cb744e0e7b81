
import jax
import numpy as np
import pytest

from hilore_jax import engine, model, train_step
from hilore_jax.bench import synthetic
from hilore_jax.config import ExposureSwitches, GRPOConfig
from hilore_jax.memory import calibration


def test_risk_metrics_by_hand():
  err = np.array([0.1, 0.5, 0.2, 0.9, 0.05, 0.3, 0.7, 0.15, 0.4, 0.6])
  perfect = calibration.risk_metrics(err * 3, err)
  assert perfect == {"spearman": pytest.approx(1.0), "top10_recall": 1.0, "auroc": 1.0}
  worst = calibration.risk_metrics(-err, err)
  assert worst["spearman"] == pytest.approx(-1.0) and worst["top10_recall"] == 0.0 and worst["auroc"] == 0.0
  assert np.isnan(calibration.risk_metrics(np.ones(10), err)["spearman"])  # a constant score ranks nothing


@pytest.fixture
def grpo_setup(tiny_cfg):
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0), init_std=0.3)
  rng = np.random.default_rng(0)
  B, P, N = 8, 5, 4
  batch = {"prompt_ids": rng.integers(3, 31, (B, P)).astype(np.int32), "prompt_mask": np.ones((B, P), np.int32),
           "tokens": rng.integers(3, 31, (B, N)).astype(np.int32), "mask": np.ones((B, N), np.int32),
           # two groups of four: the second has zero advantage (all rewards equal)
           "adv": np.array([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], np.float32)}
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT))
  return engine.memory_hooks(None, spec), p, batch


def test_measured_errors_and_held_out_score_quality(tiny_cfg):
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0), init_std=0.3)
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(beta=0.02), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True, use_ref_logp=True)
  hooks = engine.memory_hooks(None, spec)
  rng = np.random.default_rng(0)
  batches = [synthetic.grpo_batch(tiny_cfg, p, rng, 8, 5, 7, group=4, zero_adv_frac=0.5) for _ in range(4)]
  units = calibration.lowp_units(tiny_cfg.num_hidden_layers)
  err = calibration.measure_unit_errors(hooks, p, batches[0], units, group_size=8)
  assert err.shape == (len(units),) and np.all(err > 0) and np.all(err < 0.05)
  rows = calibration.risk_report(hooks, p, batches[:2], batches[2:], units, group_size=8)
  print(calibration.risk_table(rows))
  assert set(rows) >= {"full", "without susceptibility", "baseline: static type/layer", "baseline: advantage only"}
  assert rows["full"]["spearman"] > 0.8 and rows["full"]["auroc"] > 0.8
  # the fitted susceptibility carries the per-unit differences: without it the ranking is much worse
  assert rows["without susceptibility"]["spearman"] < rows["full"]["spearman"] - 0.2


def test_one_pass_unit_errors_equal_single_unit_runs(grpo_setup):
  # every unit L at once: each unit's rounding error sits alone in its own weights' gradient
  hooks, p, batch = grpo_setup
  units = calibration.lowp_units(3)
  one_pass = calibration.measure_unit_errors(hooks, p, batch, units, group_size=8)
  for i in (0, 5, len(units) - 1):
    alone = calibration.gradient_error(hooks, p, batch, calibration.lowp_policies(3, [units[i]], 8))
    assert one_pass[i] == pytest.approx(alone, rel=1e-3), units[i]
  # and a set's error is the root sum of squares of its units'
  pair = [units[0], units[5]]
  both = calibration.gradient_error(hooks, p, batch, calibration.lowp_policies(3, pair, 8))
  assert both == pytest.approx(float(np.hypot(one_pass[0], one_pass[5])), rel=1e-3)


def test_zero_advantage_rows_carry_no_exposure(grpo_setup):
  hooks, p, batch = grpo_setup
  units = calibration.lowp_units(3)
  only_zero = {k: v[4:] for k, v in batch.items()}
  assert float(np.abs(np.asarray(calibration.raw_exposure(hooks, p, only_zero, units))).max()) == 0.0
  # with the update-mask/advantage terms ablated the same rows look exposed
  ablated = calibration.raw_exposure(hooks, p, only_zero, units, ExposureSwitches(ratio_clip=False, kl=False))
  assert float(np.abs(np.asarray(ablated)).max()) == 0.0  # advantage is still zero there
  assert float(np.asarray(calibration.raw_exposure(hooks, p, batch, units)).min()) > 0


def test_calibrated_delta_meets_tolerance(grpo_setup):
  hooks, p, batch = grpo_setup
  units = calibration.lowp_units(3)
  err = calibration.measure_unit_errors(hooks, p, batch, units, group_size=8)
  tolerance = float(np.sort(err)[3])  # tight enough that not every unit fits
  delta, measured = calibration.calibrate_delta(hooks, p, [batch], units, err, err, tolerance, group_size=8)
  assert 0 < delta <= tolerance ** 2 and 0 < measured <= tolerance
  # the chosen set really is several units (squared risks add), and all of them would break the tolerance
  assert calibration.gradient_error(hooks, p, batch, calibration.lowp_policies(3, units, 8)) > tolerance
