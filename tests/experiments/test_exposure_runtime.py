"""Run-time exposure per unit and minibatch in the memory manager, the oracle arm, and the exposure bench's
measurements on a set-up manager (tests/experiments/test_exposure_bench.py: the bench's own parts)."""

import dataclasses
import types

import jax
import numpy as np
import optax
import manager_util
import pytest

from hilore_jax import model
from experiments.exposure import run as bench_exposure
from experiments.exposure import risk as exposure_risk, sweep as exposure_sweep
from hilore_jax.memory import MemoryManager, buckets, calibration, predictors, probe
from hilore_jax.memory.config import GateConfig, MemoryConfig
from hilore_jax.model import units as U

B = 8


@pytest.fixture(scope="module")
def setup():
  hooks, params = manager_util.hooks()
  rng = np.random.default_rng(0)
  adv = [1.5, -0.5, -0.5, -0.5, 1.0, -1.0, 1.0, -1.0]
  cal = [manager_util.batch(rng, adv) for _ in range(2)]
  # exposure buckets forced on: these tests are of the buckets, not of the gate (tests/test_gate.py)
  mc = MemoryConfig(policy="hilore", budget_ratio=1.5, group_size=8, calib_batches=2, calib_sets=2,
                    budget_probes=2, buckets=4, gate=GateConfig(mode="always"))
  on = MemoryManager(mc, hooks)
  on.setup(params, cal, 0)
  return hooks, params, on, mc, rng, adv


@pytest.mark.slow
def test_each_minibatch_is_allocated_from_its_own_unit_scores(setup):
  hooks, params, on, mc, rng, adv = setup
  normal = manager_util.batch(rng, adv)
  zero = normal.replace(adv=np.zeros(B, np.float32))  # every group's rewards equal
  # the previous pass moved the log-probs of the rows with A > 0 up by 1: ratio e > 1 + eps clips every one of
  # their tokens (w = 0, beta = 0), exactly as if those rows had no advantage; the other rows keep ratio 1
  up = (normal.adv > 0)[:, None]
  clipped_logp = normal.old_logp + up * normal.mask  # the current log-probs, as the previous pass left them
  no_up = normal.replace(adv=np.where(up[:, 0], 0.0, normal.adv).astype(np.float32))
  scores = on.unit_scores([normal, zero, normal, no_up], logp=[None, None, clipped_logp, None])
  assert scores.shape == (4, 2 * len(U.LOWP_UNITS))
  assert np.all(scores[0] > 0) and np.all(scores[1] == 0)
  np.testing.assert_allclose(scores[2], scores[3], rtol=1e-5)
  assert np.abs(scores[2] / scores[0] - 1).max() > 0.05  # the clip is visible to the score
  allocs = on.allocate([normal, zero, normal], [None, None, clipped_logp])
  assert allocs[1].bucket != allocs[0].bucket  # no exposure at all: its own bucket
  kappa = on.state.calibration.coherence
  np.testing.assert_array_equal(on.bucket_risk(allocs[1].bucket), 0.0)  # nothing can reach the gradient
  assert allocs[1].plan.risk == 0.0
  for a, s in zip(allocs, scores):  # a bucket's risk never understates its minibatch's score
    assert np.all(on.bucket_risk(a.bucket) >= kappa * s * (1 - 1e-9))
  # the same minibatch again: its bucket, no new solve
  before = on.planner_state
  assert on.allocate([normal])[0].bucket == allocs[0].bucket
  assert on.planner_state.buckets is before.buckets and on.planner_state.plans is before.plans

  # a minibatch at or below a fitted bucket's levels in every unit runs that bucket's plan (no new plan or compile);
  # one above it in any unit gets its own
  key = on.state.buckets[allocs[0].bucket]
  n = len(on.state.buckets)
  assert on.bucket_for(tuple(k - 1 for k in key)) == allocs[0].bucket and len(on.state.buckets) == n
  top = max(b[0] for b in on.state.buckets) + 1  # above every bucket in one unit
  assert on.bucket_for((top, *key[1:])) == n and len(on.state.buckets) == n + 1

  # exposure off: one bucket for all, at each unit's calibrated error (its p90 over the calibration minibatches)
  off = MemoryManager(dataclasses.replace(mc, buckets=1), hooks)
  off.setup(params, [normal], 0, calibration_state=on.state.calibration)
  allocs_off = off.allocate([normal, zero, normal], [None, None, clipped_logp])
  assert {a.bucket for a in allocs_off} == {0}
  p90 = np.quantile(np.asarray(on.state.calibration.unit_errors), 0.9, axis=0)
  np.testing.assert_allclose(off.bucket_risk(0), kappa * p90)


@pytest.mark.slow
def test_oracle_allocates_from_measured_errors(setup):
  hooks, params, on, mc, rng, adv = setup
  oracle = MemoryManager(mc, hooks, probe=probe.StudyProbe(oracle=True))
  oracle.setup(params, [manager_util.batch(rng, adv)], 0, calibration_state=on.state.calibration)
  b = manager_util.batch(rng, adv)
  ref = np.asarray(on.state.calibration.predicted_error)
  probe.give_errors(oracle, np.zeros_like(ref))  # measured harmless: every unit may be L at no risk
  a0 = oracle.allocate([b])[0]
  assert set(oracle.state.buckets[a0.bucket]) == {buckets.ZERO} and a0.plan.risk == 0.0
  probe.give_errors(oracle, ref * 1e6)  # measured far over the risk budget: no unit is L
  a1 = oracle.allocate([b])[0]
  assert a1.metrics["alloc/frac_L"] == 0.0 and a1.bucket != a0.bucket


@pytest.mark.slow
def test_the_probe_scores_with_the_managers_own_scorer(setup):
  hooks, params, _, mc, rng, adv = setup
  m = MemoryManager(mc, hooks, probe=probe.StudyProbe(keep_measurements=True))
  m.setup(params, [manager_util.batch(rng, adv) for _ in range(2)], 0)
  assert len(probe.measurements(m).batches) == 2
  c, held = m.state.calibration, [manager_util.batch(rng, adv) for _ in range(3)]
  inputs = predictors.ScoreInputs(np.asarray(c.prompt_profile or np.zeros((len(m.lowp_ids), 0))),
                                  np.asarray(c.profile), np.asarray(c.susceptibility), c.grad_scale)
  np.testing.assert_allclose(probe.scores(m, held, inputs, mc.exposure, None, None), m.unit_scores(held))
  # the lab's path: the held-out scores of a predictor refitted on the kept measurements
  recs = [types.SimpleNamespace(batch=b, logp=None) for b in held]
  raw, sus = exposure_risk._scores(m, mc.exposure, recs, None)
  assert np.shape(raw) == (3, len(m.lowp_ids)) and np.isfinite(raw).all() and np.shape(sus) == (len(m.lowp_ids),)


@pytest.mark.slow
def test_a_calibration_of_other_units_is_never_read_against_these(setup, caplog):
  # memory.lowp_kinds changes the L units: a calibration of every kind is refused when given, and a resumed state
  # carrying one recalibrates on the run's own units
  hooks, params, on, mc, rng, adv = setup
  kinds = (U.ATTN_NORM, U.MLP_DOWN_IN)
  few = MemoryManager(dataclasses.replace(mc, lowp_kinds=kinds), hooks)
  assert few.lowp_ids == calibration.lowp_units(hooks.model_cfg.num_hidden_layers, kinds)
  with pytest.raises(ValueError, match="memory.lowp_kinds differ"):
    few.setup(params, [manager_util.batch(rng, adv)], 0, calibration_state=on.state.calibration)
  few.load_state(on.state, "a checkpoint of every kind")
  with caplog.at_level("WARNING"):
    few.step(params, [manager_util.batch(rng, adv) for _ in range(2)], 5)
  assert any("recalibrating" in r.getMessage() and "lowp_kinds" in r.getMessage() for r in caplog.records)
  assert len(few.state.calibration.predicted_error) == len(few.lowp_ids) == 2 * hooks.model_cfg.num_hidden_layers


@pytest.mark.slow
def test_manager_state_round_trips_and_converts_the_scalar_bucket_version(setup):
  from hilore_jax.errors import CheckpointError
  from hilore_jax.memory.state import ManagerState

  _, _, on, _, _, _ = setup
  saved = on.state.to_json()
  assert ManagerState.from_json(saved) == on.state and saved["version"] == 3
  # version 2: hilore bucketed one scalar level per minibatch (edges); its fitted allowances and calibration
  # describe other buckets, so they are dropped and the manager recalibrates
  v2 = {**saved, "version": 2, "edges": [0.5, 1.0], "max_level": 2.0, "buckets": [],
        "calibration": {k: v for k, v in saved["calibration"].items() if k not in ("profile", "score_max")}}
  old = ManagerState.from_json(v2)
  assert old.allowance == {} and old.verified == [] and old.calibration.profile == []
  with pytest.raises(CheckpointError, match="newer than this code"):
    ManagerState.from_json({**saved, "version": 4})


@pytest.mark.slow
def test_calibration_skips_minibatches_without_a_gradient(setup):
  hooks, params, _, mc, rng, adv = setup
  # every group's rewards equal, no KL: no gradient
  dead = manager_util.batch(rng, adv).replace(adv=np.zeros(B, np.float32))
  m = MemoryManager(dataclasses.replace(mc, calib_sets=1), hooks)
  m.setup(params, [dead, manager_util.batch(rng, adv)], 0)
  cal = m.state.calibration
  assert cal.calib_batches == 1 and cal.delta > 0 and np.isfinite(cal.unit_errors).all()


@pytest.mark.slow
def test_calibration_measures_each_minibatch_at_its_own_params(setup):
  """Defect 1: every calibration minibatch was measured at the first one's params, so later passes looked
  on-policy; each is now measured at the params its update saw."""
  hooks, params, _, mc, rng, adv = setup
  moved = jax.tree.map(lambda x: x * 1.3, params)  # the policy a later update saw
  b0, b1 = manager_util.batch(rng, adv), manager_util.batch(rng, adv)
  m = MemoryManager(dataclasses.replace(mc, calib_sets=1), hooks)
  m.setup(params, [b0, b1], 0, contexts=[calibration.UpdateContext(params), calibration.UpdateContext(moved)])
  got = np.asarray(m.state.calibration.unit_errors)
  units = calibration.lowp_units(2)
  own = calibration.measure_unit_errors(hooks, moved, b1, units, mc.group_size)
  first = calibration.measure_unit_errors(hooks, params, b1, units, mc.group_size)
  np.testing.assert_allclose(got[1], own, rtol=1e-5)
  assert np.abs(got[1] / first - 1).max() > 0.01
  np.testing.assert_allclose(got[0], calibration.measure_unit_errors(hooks, params, b0, units, mc.group_size),
                             rtol=1e-5)


@pytest.mark.slow
def test_plan_flops_add_up_per_layer(setup):
  """The sweep counts a plan's FLOPs as No-GC's plus each layer's extra: the same as tracing the plan itself."""
  from hilore_jax.capacity import flops

  hooks, params, _, _, rng, adv = setup
  b = manager_util.batch(rng, adv)
  pf = exposure_sweep.PlanFlops(hooks.gradient, 2, params, b)
  mixed = (model.FULL_REMAT, model.LayerPolicy(remat=True, save=(U.MLP_GATE,), lowp=(U.Q, U.ATTN_PROBS)))
  direct = flops.program_flops(lambda q, x: hooks.gradient(q, x, mixed), params, b)
  assert pf(mixed) == pytest.approx(direct, rel=1e-9)
  assert pf(model.uniform(2, model.FULL_REMAT)) > pf(mixed) > pf.none
  assert exposure_sweep.lowp_set(mixed, calibration.lowp_units(2)) == tuple(sorted(
      calibration.lowp_units(2).index((1, k)) for k in (U.Q, U.ATTN_PROBS)))


@pytest.mark.slow
def test_calibration_measures_the_configured_risk_metric(setup):
  """memory.risk_metric reaches every calibration measurement: clipped errors are the relative ones times
  ||g|| / max(||g||, c), and the update error of plain SGD (u = -lr g) is the gradient's relative error."""

  hooks, params, _, mc, rng, adv = setup
  b = manager_util.batch(rng, adv)
  units = calibration.lowp_units(2)
  rel = calibration.measure_unit_errors(hooks, params, b, units, mc.group_size)
  g = float(calibration.norm(calibration.exact_gradient(hooks, params, b)))
  c = 100 * g  # a clip far above this gradient: the error is against c
  clipped = MemoryManager(dataclasses.replace(mc, risk_metric="clipped", calib_sets=1),
                          dataclasses.replace(hooks, max_grad_norm=c))
  clipped.setup(params, [b], 0)
  np.testing.assert_allclose(clipped.state.calibration.unit_errors[0], rel * g / c, rtol=1e-4)
  assert clipped.state.calibration.risk_metric == "clipped"
  update = MemoryManager(dataclasses.replace(mc, risk_metric="update", calib_sets=1), hooks)
  with pytest.raises(ValueError, match="needs the optimizer"):
    update.setup(params, [b], 0)
  update.setup(params, [b], 0, opt_state=optax.sgd(1e-3).init(params))  # the stepper's optimizer is sgd
  np.testing.assert_allclose(update.state.calibration.unit_errors[0], rel, rtol=1e-3)


@pytest.mark.slow
def test_exposure_arrays_store_grad_norm_and_absolute_unit_errors(setup, tmp_path):
  """Defect (e): the arrays lacked ||g|| and the absolute ||dg_u||; both are stored, checked against a probe."""
  hooks, params, _, mc, rng, adv = setup
  units = calibration.lowp_units(2)
  batches = [manager_util.batch(rng, adv) for _ in range(2)]
  refs = [calibration.reference(hooks, calibration.UpdateContext(params), b) for b in batches]
  err = np.stack([calibration.measure_unit_errors(hooks, params, b, units, mc.group_size, exact=r,
                                                  metrics=("relative", "clipped")) for b, r in zip(batches, refs)])
  err_by = {"relative": err[:, :, 0], "clipped": err[:, :, 1]}
  path = str(tmp_path / "exposure_arrays.npz")
  exposure_risk.save_arrays(path, units, list(range(len(units))), err_by, {"s": (err[:, :, 0], 1.0)},
                             [r.grad_norm for r in refs])
  a = np.load(path)
  assert a["grad_norm_M"].shape == (2,) and a["abs_err_MU"].shape == (2, len(units))
  exact = hooks.gradient(params, batches[1], model.uniform(2, model.NO_REMAT))
  leaves = lambda t: [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]
  np.testing.assert_allclose(a["grad_norm_M"][1], np.sqrt(sum((x ** 2).sum() for x in leaves(exact))), rtol=1e-4)
  u = 3  # one unit's gradient with it alone L, differenced in numpy
  with calibration.measuring():
    g_u = hooks.probe_gradient(params, batches[1], calibration.probe_mix(2, units, [u]), "int8", mc.group_size)
  dg = np.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(leaves(g_u), leaves(refs[1].grad))))
  np.testing.assert_allclose(a["abs_err_MU"][1, u], dg, rtol=1e-4)
  np.testing.assert_allclose(a["abs_err_MU"], a["err_relative"] * a["grad_norm_M"][:, None], rtol=1e-6)


@pytest.mark.slow
def test_held_out_weight_read_units_keep_their_errors_not_their_gradients(setup):
  # with weight-read units only, a held-out minibatch's errors come from one instrumented backward and its exact
  # gradient is dropped (SmolLM2's 64 would not fit in host memory); the errors are the probe path's
  hooks, params, _, mc, rng, adv = setup
  mc = dataclasses.replace(mc, risk_metric="clipped", lowp_kinds=tuple(model.decoder.WEIGHT_READS))
  units = calibration.lowp_units(hooks.model_cfg.num_hidden_layers, mc.lowp_kinds)
  held = [bench_exposure.Record(1, 0, j, params, manager_util.batch(rng, adv), {}) for j in range(2)]
  kept, refs, err_by, layers = bench_exposure.measure_held_out(hooks, mc, held, units, progress=lambda s: None)
  # nor its params: without an optimizer state nothing reads them, and each held-out record's are read back apart
  assert len(kept) == 2 and layers is None and all(r.grad is None and r.params is None and r.weight_errors is not None
                                                   for r in refs)
  for r, ref, e in zip(held, refs, err_by["clipped"]):
    plain = calibration.reference(hooks, calibration.UpdateContext(params), r.batch, "clipped", mc.lowp_format,
                                  mc.group_size)
    assert ref.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    probed = calibration.decomposed_unit_errors(hooks, params, r.batch, units, mc.group_size, exact=plain)
    np.testing.assert_allclose(e, probed, rtol=1e-4)


@pytest.mark.slow
def test_a_calibration_on_spilled_records_keeps_their_params_on_disk(setup, tmp_path):
  # the bench's calibration keeps its measurements for the predictors' fits: its contexts read each record's
  # params back from disk, and its references keep neither params nor (weight-read units only) gradients, so 8
  # SmolLM2 minibatches pin no 0.5 GB copies; the calibration equals one on params held in memory
  from experiments.exposure import spill

  hooks, params, _, mc, rng, adv = setup
  mc = dataclasses.replace(mc, policy="hilore", risk_metric="clipped", lowp_kinds=tuple(model.decoder.WEIGHT_READS))
  units = calibration.lowp_units(hooks.model_cfg.num_hidden_layers, mc.lowp_kinds)
  batches = [manager_util.batch(rng, adv) for _ in range(2)]
  cals = {}
  for where in ("memory", "disk"):
    records = [bench_exposure.Record(0, 0, j, spill.keep(params, str(tmp_path / f"{j}") if where == "disk" else None),
                                     b, {}) for j, b in enumerate(batches)]
    m = MemoryManager(mc, hooks, probe=probe.StudyProbe(keep_measurements=True))
    bench_exposure.calibrate_on(m, records)
    measured = probe.measurements(m)
    # weight-read units only: calibration itself keeps no reference's gradient (K of them peaked E1b's smoke)
    assert all(r.grad is None and r.grad_norm > 0 for r in measured.refs)
    measured.refs = bench_exposure.without_gradients(measured.refs, units)
    assert all(isinstance(c, spill.KeptContext) for c in measured.contexts)
    assert all(r.grad is None and r.params is None for r in measured.refs)
    cals[where] = np.asarray(m.state.calibration.unit_errors)
  np.testing.assert_allclose(cals["disk"], cals["memory"], rtol=1e-6)
