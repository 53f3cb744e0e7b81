"""Risk calibration: measured unit and set errors, the risk model, the budget delta, and its cost at depth."""

import dataclasses
import warnings

import jax
import numpy as np
import pytest

from hilore_jax import model
from hilore_jax.loop import step_hooks
from hilore_jax.model import decoder
from hilore_jax.capacity import synthetic
from experiments.bench import unit_risk
from hilore_jax.memory import calibrate, calibration, riskfit
from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import UpdateBatch


def test_risk_metrics_by_hand():
  err = np.array([0.1, 0.5, 0.2, 0.9, 0.05, 0.3, 0.7, 0.15, 0.4, 0.6])
  perfect = riskfit.risk_metrics(err * 3, err)
  assert perfect == {"spearman": pytest.approx(1.0), "top10_recall": 1.0, "auroc": 1.0}
  worst = riskfit.risk_metrics(-err, err)
  assert worst["spearman"] == pytest.approx(-1.0) and worst["top10_recall"] == 0.0 and worst["auroc"] == 0.0
  assert np.isnan(riskfit.risk_metrics(np.ones(10), err)["spearman"])  # a constant score ranks nothing


@pytest.fixture
def grpo_setup(tiny_cfg):
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0), init_std=0.3)
  rng = np.random.default_rng(0)
  B, P, N = 8, 5, 4
  # two groups of four: the second has zero advantage (all rewards equal)
  batch = UpdateBatch(rng.integers(3, 31, (B, P)).astype(np.int32), np.ones((B, P), np.int32),
                      rng.integers(3, 31, (B, N)).astype(np.int32), np.ones((B, N), np.int32),
                      np.array([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], np.float32))
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT))
  return step_hooks.memory_hooks(None, spec), p, batch


@pytest.mark.slow
def test_measured_errors_and_held_out_score_quality(tiny_cfg):
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0), init_std=0.3)
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(beta=0.02), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True, use_ref_logp=True)
  hooks = step_hooks.memory_hooks(None, spec)
  rng = np.random.default_rng(0)
  batches = [synthetic.grpo_batch(tiny_cfg, p, rng, 8, 5, 7, group=4, zero_adv_frac=0.5) for _ in range(4)]
  units = calibration.lowp_units(tiny_cfg.num_hidden_layers)
  err = calibration.measure_unit_errors(hooks, p, batches[0], units, group_size=8)
  assert err.shape == (len(units),) and np.all(err > 0) and np.all(err < 0.05)
  rows = unit_risk.risk_report(hooks, p, batches[:2], batches[2:], units, group_size=8)
  print(unit_risk.risk_table(rows))
  assert set(rows) >= {"run-time score", "without susceptibility", "baseline: static type/layer",
                       "baseline: advantage only"}
  assert rows["run-time score"]["spearman"] > 0.8 and rows["run-time score"]["auroc"] > 0.8
  # the fitted susceptibility carries the per-unit differences: without it the ranking is much worse
  assert rows["without susceptibility"]["spearman"] < rows["run-time score"]["spearman"] - 0.2


@pytest.mark.slow
def test_probe_measures_what_the_policy_runs(grpo_setup):
  # the run-time mix of the probe program gives the same error as compiling the real L policy; a set's error is
  # not the root sum of squares of its units' (codes reach earlier layers' input gradients too)
  hooks, p, batch = grpo_setup
  units = calibration.lowp_units(3)
  idx = [units.index((0, model.LAYER_INPUT)), units.index((1, model.ATTN_PROBS)), units.index((2, model.MLP_GATE))]
  one = calibration.measure_unit_errors(hooks, p, batch, units, group_size=8)
  assert one.shape == (len(units),) and np.all(one > 0)
  for i in idx:
    real = calibration.gradient_error(hooks, p, batch, calibration.lowp_policies(3, [units[i]], 8))
    assert one[i] == pytest.approx(real, rel=1e-3), units[i]
  (probe_set,) = calibration.set_errors(hooks, p, batch, units, [idx], group_size=8)
  real_set = calibration.gradient_error(hooks, p, batch, calibration.lowp_policies(3, [units[i] for i in idx], 8))
  assert probe_set == pytest.approx(real_set, rel=1e-3)
  assert probe_set <= one[idx].sum() * (1 + 1e-6)  # the triangle inequality: the linear model's bound


def test_coherence_and_set_fit_by_hand():
  unit_err = np.array([[0.1, 0.2, 0.3]])
  sets = [[0, 1], [1, 2], [0, 1, 2]]
  measured = np.array([[0.25, 0.4, 0.45]])  # ratios to the sums .3, .5, .6: 0.833, 0.8, 0.75
  assert riskfit.fit_coherence(unit_err, sets, measured) == pytest.approx(0.25 / 0.3)
  fit = riskfit.set_fit(unit_err[0], sets, measured[0], 0.25 / 0.3)
  assert fit["linear_covered"] == 1.0 and fit["sets"] == 3
  # root sums of squares .224, .361, .374: all under the measured errors
  assert fit["orthogonal_covered"] == 0.0
  assert fit["linear_spearman"] == pytest.approx(1.0)  # predicted .25, .417, .5 rank as measured
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a constant side has no rank correlation: NaN, and no scipy warning
    flat = riskfit.set_fit(unit_err[0], sets, np.full(3, 0.4), 0.25 / 0.3)
  assert np.isnan(flat["linear_spearman"]) and np.isnan(flat["orthogonal_spearman"])
  assert riskfit.random_sets(10, 3, np.random.default_rng(0))[-1] == list(range(10))


@pytest.mark.slow
def test_zero_advantage_rows_carry_no_exposure(grpo_setup):
  hooks, p, batch = grpo_setup
  units = calibration.lowp_units(3)
  # the zero-advantage group twice: the whole batch's shape, so the three exposures share their (eager) ops' compiles
  only_zero = jax.tree.map(lambda v: np.concatenate([v[4:], v[4:]]), batch)
  assert not np.asarray(only_zero.adv).any()
  assert float(np.abs(np.asarray(calibration.raw_exposure(hooks, p, only_zero, units))).max()) == 0.0
  # with the update-mask/advantage terms ablated the same rows look exposed
  ablated = calibration.raw_exposure(hooks, p, only_zero, units, ExposureSwitches(ratio_clip=False, kl=False))
  assert float(np.abs(np.asarray(ablated)).max()) == 0.0  # advantage is still zero there
  assert float(np.asarray(calibration.raw_exposure(hooks, p, batch, units)).min()) > 0


@pytest.mark.slow
def test_calibrated_delta_meets_tolerance(grpo_setup):
  hooks, p, batch = grpo_setup
  units = calibration.lowp_units(3)
  err = calibration.measure_unit_errors(hooks, p, batch, units, group_size=8)
  tolerance = float(np.sort(err)[3])  # tight enough that not every unit fits
  delta, measured = calibrate.calibrate_delta(hooks, [p], [batch], units, err, tolerance, group_size=8)
  assert 0 < delta <= tolerance and 0 < measured <= tolerance
  # all of them would break the tolerance
  assert calibration.gradient_error(hooks, p, batch, calibration.lowp_policies(3, units, 8)) > tolerance


def test_layers_probed_and_interpolated_by_hand():
  assert calibration.probed_layers(30, 0) is None and calibration.probed_layers(3, 4) is None
  assert calibration.probed_layers(30, 3) == [0, 14, 29] and calibration.probed_layers(7, 2) == [0, 6]
  units = [(layer, kind) for layer in range(5) for kind in ("q", "v")]
  measured = {(0, "q"): 1e-4, (4, "q"): 1e-2, (0, "v"): 2e-3, (4, "v"): 2e-3}
  err = dict(zip(units, calibration.interpolate_layers(units, measured)))
  assert err[(0, "q")] == 1e-4 and err[(4, "q")] == 1e-2  # measured units keep their values
  assert err[(2, "q")] == pytest.approx(1e-3) and err[(1, "q")] == pytest.approx(1e-4 * 10 ** 0.5)  # log-linear
  assert all(err[(layer, "v")] == pytest.approx(2e-3) for layer in range(5))


@pytest.mark.slow
def test_depth_sampled_calibration_measures_fewer_units_on_fewer_rows(grpo_setup):
  hooks, p, batch = grpo_setup
  units = calibration.lowp_units(3)
  calls = []
  # probes with some unit L (the reference is the probe program with a zero mix)
  counting = dataclasses.replace(hooks, probe_gradient=lambda params, b, mix, *a: (
      calls.append(b.rows) if np.asarray(mix).any() else None) or hooks.probe_gradient(params, b, mix, *a))
  full = calibration.measure_unit_errors(counting, p, batch, units, group_size=8)
  assert len(calls) == len(units)
  calls.clear()
  layers = calibration.probed_layers(3, 2)
  sampled = calibration.measure_unit_errors(counting, p, batch, units, group_size=8, layers=layers)
  assert len(calls) == 2 * len(units) // 3  # two of three layers, whatever the depth
  for i, (layer, _) in enumerate(units):
    if layer in layers:
      assert sampled[i] == pytest.approx(full[i], rel=1e-6)
  sub = calibration.calibration_rows(batch, 5)
  assert sub.rows == 5 and calibration.calibration_rows(batch, 0) is batch
  calls.clear()
  calibration.measure_unit_errors(counting, p, sub, units, group_size=8, layers=layers)
  assert set(calls) == {5}
  # decomposed: the weight-read units of every layer (the unprobed one too) from one probe, exact, not interpolated
  calls.clear()
  split = calibration.measure_unit_errors(counting, p, batch, units, group_size=8, layers=layers, decompose=True)
  weight_read = [i for i, (_, kind) in enumerate(units) if kind in decoder.WEIGHT_READS]
  assert len(calls) == 2 * (len(units) - len(weight_read)) // 3 + 1
  np.testing.assert_allclose(split[weight_read], full[weight_read], rtol=1e-5)
  assert any(units[i][0] not in layers for i in weight_read)


@pytest.mark.slow
def test_token_errors_are_what_the_l_unit_decodes(grpo_setup):
  """Defect 2: calibration quantised after flattening a token's trailing axes, while the L unit's code groups along
  the tensor's own last axis (q's head size 6 here against groups of 8; the probabilities' key axis): each token's
  error must be the one the L unit's decoded code carries. Defect 3: at the prompt's positions too."""
  from hilore_jax.model import lowp

  hooks, p, batch = grpo_setup
  units = [(0, model.Q), (1, model.ATTN_PROBS), (2, model.ATTN_CTX), (0, model.MLP_GATE), (1, model.K)]
  err = np.asarray(calibration.token_errors(hooks, p, batch, units, group_size=8))
  assert err.shape == (len(units), batch.rows, batch.prompt_len - 1 + batch.completion_len)
  taps = hooks.unit_tensors(p, batch)
  for u, (layer, kind) in enumerate(units):
    x = taps[layer][kind]
    keep = lowp.keep_of(kind, x, "int8", 8)
    x_hat = lowp._decode(lowp._encode(x, keep), keep, None)
    want = np.linalg.norm(np.asarray(x_hat - x, np.float64).reshape(*x.shape[:2], -1), axis=-1)
    np.testing.assert_allclose(err[u], want, rtol=1e-4, atol=1e-9, err_msg=kind)
  assert np.all(err[:, :, :batch.prompt_len - 1].sum(-1) > 0)  # the prompt's activations carry errors too


@pytest.mark.slow
def test_exact_gradient_and_probes_run_at_one_precision(grpo_setup):
  """Defect 4: the exact gradient ran at highest matmul precision, the probes at the default (TF32 on a GPU, whose
  floor would count as unit error): every measured gradient runs at calibration.PRECISION, and a probe with no
  unit L is the exact gradient to float32 rounding."""
  hooks, p, batch = grpo_setup
  seen = []
  record = lambda f: lambda *a: seen.append(jax.config.jax_default_matmul_precision) or f(*a)
  h = dataclasses.replace(hooks, gradient=record(hooks.gradient), probe_gradient=record(hooks.probe_gradient))
  units = calibration.lowp_units(3)
  exact = calibration.exact_gradient(h, p, batch)
  calibration.set_errors(h, p, batch, units, [[0]], group_size=8, exact=exact)
  calibration.gradient_error(h, p, batch, calibration.lowp_policies(3, units[:1], 8), exact)
  assert seen == [calibration.PRECISION] * 3
  (none_l,) = calibration.set_errors(hooks, p, batch, units, [[]], group_size=8, exact=exact)
  assert none_l < 1e-5  # float32 rounding (reordered sums); an int8 unit is ~1e-3


def test_reference_is_the_probe_program_with_a_zero_mix(grpo_setup):
  """Defect (c): the reference ran full checkpointing, the probes no remat plus the mix (two programs whose float
  noise counts as unit error); the reference is now the probe with every mix 0, so a probe with no unit L differs
  from it by exactly 0."""
  hooks, p, batch = grpo_setup
  calls = []
  record = lambda name, f: lambda *a: calls.append((name, a[2:])) or f(*a)
  h = dataclasses.replace(hooks, gradient=record("gradient", hooks.gradient),
                          probe_gradient=record("probe", hooks.probe_gradient))
  units = calibration.lowp_units(3)
  ref = calibration.reference(h, calibration.UpdateContext(p), batch, fmt="int8", group_size=8)
  (name, (mix, fmt, group)), = calls
  assert name == "probe" and (fmt, group) == ("int8", 8) and not np.asarray(mix).any()
  with calibration.measuring():
    zero = hooks.probe_gradient(p, batch, calibration.probe_mix(3, units, []), "int8", 8)
  for a, b in zip(jax.tree_util.tree_leaves(ref.grad), jax.tree_util.tree_leaves(zero)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert calibration.set_errors(hooks, p, batch, units, [[]], group_size=8, exact=ref)[0] == 0.0
  assert calibration.set_errors(hooks, p, batch, units, [[0]], group_size=8, exact=ref)[0] > 1e-5  # one unit L


def test_one_probe_decomposes_every_weight_read_unit_as_its_own_probe_would(tiny_cfg):
  # units read only by their projections' weight gradients: one probe with all of them L gives each one's error
  # (on its own weights) as one probe per unit does, under every metric, on two minibatches
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(1), init_std=0.3)
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(beta=0.02), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True, use_ref_logp=True)
  hooks = step_hooks.memory_hooks(None, spec, max_grad_norm=1e-3)  # clipped != relative: the clip binds
  rng = np.random.default_rng(3)
  units = [u for u in calibration.lowp_units(tiny_cfg.num_hidden_layers) if u[1] in decoder.WEIGHT_READS]
  assert len({k for _, k in units}) == 4
  metrics = ("relative", "clipped")
  for _ in range(2):
    batch = synthetic.grpo_batch(tiny_cfg, p, rng, 8, 5, 7, group=4, zero_adv_frac=0.25)
    exact = calibration.exact_gradient(hooks, p, batch, group_size=8)
    one_each = calibration.measure_unit_errors(hooks, p, batch, units, 8, exact=exact, metrics=metrics)
    once = calibration.decomposed_unit_errors(hooks, p, batch, units, 8, exact=exact, metrics=metrics)
    assert np.all(one_each > 0)
    np.testing.assert_allclose(once, one_each, rtol=1e-5)  # the same weights' gradients: equal here bitwise
  # with all of them L the probe's total error is not a sum of its parts' (they meet in the norm), so the
  # decomposition is not the set's error; and a unit read by the attention's backward has no such shortcut
  (both,) = calibration.set_errors(hooks, p, batch, units, [range(len(units))], 8, exact=exact, combine=False)
  assert both < np.sum(once[:, 0]) and both > np.max(once[:, 0])
  assert both == pytest.approx(np.sqrt(np.sum(np.square(once[:, 0]))), rel=1e-4)  # side by side: root sum of squares
  with pytest.raises(ValueError, match="measure them with one probe each"):
    calibration.decomposed_unit_errors(hooks, p, batch, [(0, model.ATTN_PROBS)], 8, exact=exact)


def test_sets_of_weight_read_units_take_one_probe_and_equal_their_own_probes(tiny_cfg):
  # a set of weight-read units' error is its units' side by side: one decomposed probe gives every set's error as
  # one probe per set does, under both norm metrics; a set holding any other unit is probed as before
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(2), init_std=0.3)
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(beta=0.02), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True, use_ref_logp=True)
  hooks = step_hooks.memory_hooks(None, spec, max_grad_norm=1e-3)
  calls = []
  probe = hooks.probe_gradient
  hooks = dataclasses.replace(hooks, probe_gradient=lambda *a: calls.append(1) or probe(*a))
  units = calibration.lowp_units(tiny_cfg.num_hidden_layers, tuple(decoder.WEIGHT_READS))
  rng = np.random.default_rng(5)
  batch = synthetic.grpo_batch(tiny_cfg, p, rng, 8, 5, 7, group=4, zero_adv_frac=0.25)
  ref = calibration.reference(hooks, calibration.UpdateContext(p), batch, "clipped", group_size=8)
  sets = [list(rng.choice(len(units), size=k, replace=False)) for k in (1, 2, 3, 5, len(units))]
  metrics = ("relative", "clipped")
  calls.clear()
  combined = calibration.set_errors(hooks, p, batch, units, sets, 8, exact=ref, metrics=metrics)
  assert len(calls) == 1
  probed = calibration.set_errors(hooks, p, batch, units, sets, 8, exact=ref, metrics=metrics, combine=False)
  assert len(calls) == 1 + len(sets) and np.all(probed > 0)
  np.testing.assert_allclose(combined, probed, rtol=1e-4)
  per = calibration.decomposed_unit_errors(hooks, p, batch, units, 8, exact=ref, metrics=metrics)
  np.testing.assert_allclose(calibration.set_error_of(per, sets), probed, rtol=1e-4)
  np.testing.assert_allclose(calibration.set_error_of(per, [[3]]), per[[3]])  # one unit: its own error
  mixed = units + [(0, model.Q)]
  calls.clear()
  calibration.set_errors(hooks, p, batch, mixed, [[0, len(units)], [1]], 8, exact=ref)
  assert len(calls) == 2  # q's error reaches the attention's backward: probed, set by set
  # the risk budget's search reads its sets' errors off the measured unit errors: no probe, the same delta
  err = calibration.measure_unit_errors(hooks, p, batch, units, 8, exact=ref, decompose=True)[None]
  risk_U = err[0] * rng.uniform(0.5, 2.0, len(units))
  calls.clear()
  fast = calibrate.calibrate_delta(hooks, [p], [batch], units, risk_U, 0.5 * err.sum(), 8, exact=[ref], unit_err=err)
  assert not calls
  slow = calibrate.calibrate_delta(hooks, [p], [batch], units, risk_U, 0.5 * err.sum(), 8, exact=[ref])
  assert calls and fast[0] == slow[0] and fast[1] == pytest.approx(slow[1], rel=1e-4) and fast[1] > 0


@pytest.mark.parametrize("microbatches", [1, 2])
def test_one_instrumented_backward_gives_the_gradient_and_every_weight_read_units_error(tiny_cfg, microbatches):
  # the reference's own backward carries an error channel per weight-read unit: its gradient is the probe's at zero
  # mix and each unit's error is the decomposed probe's, with no probe run (over microbatches the channels add as
  # the gradients do); without the channels the reference holds no errors and a probe is needed
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(4), init_std=0.3)
  spec = train_step.StepSpec(tiny_cfg, GRPOConfig(beta=0.02), model.uniform(tiny_cfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True, use_ref_logp=True, microbatches=microbatches)
  hooks = step_hooks.memory_hooks(None, spec, max_grad_norm=1e-3)
  calls = []
  probe = hooks.probe_gradient
  hooks = dataclasses.replace(hooks, probe_gradient=lambda *a: calls.append(1) or probe(*a))
  units = calibration.lowp_units(tiny_cfg.num_hidden_layers, tuple(decoder.WEIGHT_READS))
  batch = synthetic.grpo_batch(tiny_cfg, p, np.random.default_rng(6), 8, 5, 7, group=4, zero_adv_frac=0.25)
  ctx, metrics = calibration.UpdateContext(p), ("relative", "clipped")
  plain = calibration.reference(hooks, ctx, batch, "clipped", group_size=8)
  assert plain.weight_errors is None and len(calls) == 1
  probed = calibration.decomposed_unit_errors(hooks, p, batch, units, 8, exact=plain, metrics=metrics)
  calls.clear()
  ref = calibration.reference(hooks, ctx, batch, "clipped", group_size=8, weight_errors=True)
  assert ref.weight_errors.shape == (tiny_cfg.num_hidden_layers, len(decoder.WEIGHT_READS))
  assert ref.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)  # two programs: float32 summation order
  once = calibration.decomposed_unit_errors(hooks, p, batch, units, 8, exact=ref, metrics=metrics)
  sets = calibration.set_errors(hooks, p, batch, units, [[0, 3], list(range(len(units)))], 8, exact=ref)
  assert not calls and np.all(once > 0) and np.all(sets > 0)
  np.testing.assert_allclose(once, probed, rtol=1e-4)
