"""Calibration's measurement and fit (memory/calibrate.py): errors measured on fewer rows scaled to the minibatch,
and one calibration minibatch's widened score maximum."""

import dataclasses

import jax
import numpy as np
import pytest

from hilore_jax import model
from hilore_jax.capacity import synthetic
from hilore_jax.loop import step_hooks
from hilore_jax.memory import calibrate, calibration
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig


def _calib_setup(tiny_cfg):
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0), init_std=0.3)
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True)
  hooks = step_hooks.memory_hooks(None, spec)
  rng = np.random.default_rng(3)  # both groups of both minibatches have mixed rewards
  batches = [synthetic.grpo_batch(tiny_cfg, p, rng, 8, 5, 7, group=4, zero_adv_frac=0.0) for _ in range(2)]
  return hooks, p, batches


# calibration on whole minibatches with 2 sets each: the scaling test's unscaled case, the fit's measurement
WHOLE = MemoryConfig(policy="hilore", group_size=8, calib_sets=2)


@pytest.fixture(scope="module")
def whole():
  """(the tiny config (3 layers), hooks, params, both minibatches, their calibration under WHOLE)."""
  import builders

  cfg = builders.tiny_model(num_hidden_layers=3, tie_word_embeddings=False)  # conftest's tiny_cfg, for the module
  hooks, p, batches = _calib_setup(cfg)
  units = calibration.lowp_units(cfg.num_hidden_layers)
  return cfg, hooks, p, batches, calibrate.measure(hooks, WHOLE, units, batches, [calibration.UpdateContext(p)] * 2)


@pytest.mark.slow
def test_calibration_on_fewer_rows_is_scaled_to_the_minibatch(whole):
  """Defect (d): errors measured on calib_rows rows were applied to whole minibatches as they were; they are now
  scaled by sqrt(b / B) ||g_b|| / ||g_B|| (rows_factor), here checked against norms taken in numpy."""
  tiny_cfg, hooks, p, batches, m_all = whole
  units = calibration.lowp_units(tiny_cfg.num_hidden_layers)
  mc = dataclasses.replace(WHOLE, calib_rows=4)
  ctx = [calibration.UpdateContext(p)] * 2
  m = calibrate.measure(hooks, mc, units, batches, ctx)
  leaves = lambda t: [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]
  gnorm = lambda b: np.sqrt(sum((x ** 2).sum() for x in leaves(
      hooks.gradient(p, b, model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT)))))
  for k, b in enumerate(batches):
    sub = calibration.calibration_rows(b, 4)
    want = np.sqrt(4 / 8) * gnorm(sub) / gnorm(b)
    assert m.row_scale[k] == pytest.approx(want, rel=1e-4) and abs(want - 1) > 0.01
    raw = calibration.measure_unit_errors(hooks, p, sub, units, 8)  # unscaled, on the 4 rows
    np.testing.assert_allclose(m.err[k], raw * want, rtol=1e-4)
  # the whole minibatches: nothing to scale
  assert WHOLE.calib_rows == 0 and list(m_all.row_scale) == [1.0, 1.0]


@pytest.mark.slow
def test_one_calibration_minibatch_warns_and_widens_score_max(whole, caplog):
  """Defect (d): with one calibration minibatch each unit's largest score is one sample; it is widened by
  SINGLE_BATCH_MARGIN, with a warning, and left as measured with two."""
  tiny_cfg, hooks, _, _, m = whole
  units, mc = calibration.lowp_units(tiny_cfg.num_hidden_layers), WHOLE
  one = dataclasses.replace(m, batches=m.batches[:1], contexts=m.contexts[:1], refs=m.refs[:1], err=m.err[:1],
                            set_err=m.set_err[:1], token_err=m.token_err[:1], row_scale=m.row_scale[:1])
  with caplog.at_level("WARNING"):
    cal = calibrate.fit(hooks, mc, units, one, one.err, 1.0)  # scores = errors: susceptibility 1
  assert any("single sample" in r.getMessage() for r in caplog.records)
  assert calibrate.SINGLE_BATCH_MARGIN == 2.0
  np.testing.assert_allclose(cal.score_max, 2.0 * m.err[0], rtol=1e-9)
  np.testing.assert_allclose(cal.static_risk, 2.0 * m.err[0], rtol=1e-9)  # hilore's static risk alike
  caplog.clear()
  with caplog.at_level("WARNING"):
    cal2 = calibrate.fit(hooks, mc, units, m, m.err, 1.0)
  assert not any("single sample" in r.getMessage() for r in caplog.records)
  np.testing.assert_allclose(cal2.score_max, m.err.max(0), rtol=1e-9)
  np.testing.assert_allclose(cal2.static_risk, np.quantile(m.err, 0.9, axis=0), rtol=1e-9)
