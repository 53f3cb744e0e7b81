"""Recalibration on drift (memory/drift.py): the sentinels' decision by hand, a jump recalibrates and a steady run
does not (through the manager), and calibration gathered over the first rollouts while GC runs."""

import dataclasses

import jax
import numpy as np
import manager_util
import pytest

from hilore_jax.memory import MemoryManager, drift
from hilore_jax.memory.config import MemoryConfig

NAN = float("nan")


def test_sentinels_past_their_thresholds_by_hand():
  mc = MemoryConfig(drift_grad_ratio=2.0, drift_recon_ratio=1.5, drift_exact_ratio=2.0)
  assert drift.decide({"grad_ratio": 1.9, "recon_ratio": 0.7, "exact_ratio": 1.9}, mc) == []
  assert drift.decide({"grad_ratio": 2.0}, mc) == ["grad_ratio"]  # the threshold itself counts
  assert drift.decide({"grad_ratio": 0.5}, mc) == ["grad_ratio"]  # either way: ||g|| fell under the clip
  assert drift.decide({"recon_ratio": 0.6, "exact_ratio": 2.5}, mc) == ["recon_ratio", "exact_ratio"]
  assert drift.decide({"exact_ratio": 0.1}, mc) == []  # the realised error only drifts upwards
  assert drift.decide({"grad_ratio": NAN, "recon_ratio": NAN}, mc) == []  # not measured: not drifted
  assert drift.over_clip([3.0, 1.0, 2.0], 0.5) == 4.0 and drift.over_clip([3.0], 0.0) == 3.0
  m = drift.metrics({"grad_ratio": 3.0}, True)
  assert m["memory/recalibrated"] == 1.0 and m["memory/drift/grad_ratio"] == 3.0
  assert np.isnan(m["memory/drift/recon_ratio"])  # every key present in every row of a step


def test_references_follow_the_run_by_hand():
  assert drift.follow(None, 2.0) == 2.0  # the first value starts the average
  assert drift.follow(1.0, 8.0) == pytest.approx(8.0 ** drift.EMA)  # of logs: a ratio, not an offset
  ref = 1.0
  for _ in range(40):  # a value that stays moves the average all the way
    ref = drift.follow(ref, 4.0)
  assert ref == pytest.approx(4.0, rel=1e-3)


@pytest.fixture(scope="module")
def tiny():
  hooks, params = manager_util.hooks(1.0)  # clip c = 1
  rng = np.random.default_rng(0)
  adv = np.array([1.5, -0.5, -1.0, 1.0, 0.5, -1.5])
  batches = [manager_util.batch(rng, adv * s) for s in (1.0, 2.0, 0.5, 1.5)]
  # min_l_gain 0: any predicted gain calibrates (these tests are of drift, not of that decision: test_lgain.py)
  mc = MemoryConfig(policy="hilore", budget_ratio=1.5, group_size=8, calib_sets=1, budget_probes=2, buckets=1,
                    cache=False, verify_steps=0, drift_check_every=1, min_l_gain=0.0)
  return hooks, params, batches, mc


def _after(m, params, batches, step, grad_norms):
  """A step's end as the trainer reads it: its updates' ||g|| observed, then the manager's work after it."""
  m.observe(0.1, False, grad_norms=grad_norms)
  return m.finish_step(params, batches, step)


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_op_times")
def test_a_jump_recalibrates_the_l_units_after_the_step_and_a_steady_or_slow_drift_does_not(tiny):
  hooks, params, batches, mc = tiny
  m = MemoryManager(dataclasses.replace(mc, warmup="none"), hooks)
  m.step(params, batches, 0)
  cal = m.state.calibration
  lset = m._running_lset(batches[0])
  assert cal is not None and lset and m.state.calibrations == 1 and m.state.recalibrations == 0
  steady = list(cal.grad_norms)
  for step in range(4):  # the same gradients, params and minibatches; then a slow drift, 1.4x a step
    took = _after(m, params, batches, step, [g * 1.4 ** max(step - 1, 0) for g in steady])
    metrics = m.step(params, batches, step + 1)[0].metrics
    assert m.state.calibrated_at == 0 and metrics["memory/recalibrated"] == 0.0
    assert metrics["memory/recalibrations"] == 0.0 and metrics["memory/calibrations"] == 1.0
    # drift_check_every=1: the L units' reconstruction RMS and the running plan's exact error after every step
    assert np.isfinite(metrics["memory/drift/exact_ratio"]) and took["time/recalibrate_s"] > 0
    if step:  # the first step starts the references: nothing to compare yet
      # a trend of 1.4x a step leads the moving average by a bounded ratio (1.4^((1 - EMA) / EMA) at most)
      assert 1.0 - 1e-6 <= metrics["memory/drift/grad_ratio"] < mc.drift_grad_ratio
      assert metrics["memory/drift/recon_ratio"] == pytest.approx(1.0)
    else:
      assert np.isnan(metrics["memory/drift/grad_ratio"]) and np.isnan(metrics["memory/drift/recon_ratio"])
  before = np.array(cal.static_risk)
  _after(m, params, batches, 4, [g * 1.4 ** 3 * 10 for g in steady])  # ||g|| / c jumps 10x
  metrics = m.step(params, batches, 5)[0].metrics
  assert m.state.calibrated_at == 5 and metrics["memory/recalibrated"] == 1.0
  assert metrics["memory/recalibrations"] == 1.0 and metrics["memory/calibrations"] == 2.0
  assert metrics["memory/drift/grad_ratio"] > 3.0
  after = np.array(m.state.calibration.static_risk)
  others = np.setdiff1d(np.arange(len(after)), lset)
  # only the running plan's L units were measured again; the others keep their calibration
  np.testing.assert_array_equal(after[others], before[others])
  assert not np.allclose(after[list(lset)], before[list(lset)])


@pytest.mark.usefixtures("fixed_op_times")
def test_a_plan_without_l_never_recalibrates(tiny):
  hooks, params, batches, mc = tiny
  # L predicted to save under 99% of GC's recompute: not worth calibrating, the risk-free plan runs
  m = MemoryManager(dataclasses.replace(mc, warmup="none", min_l_gain=0.99), hooks)
  m.step(params, batches, 0)
  assert m.state.calibration is None and not m.state.lgain["calibrate"] and m.state.calibrations == 0
  for step, scale in enumerate((1.0, 10.0, 0.01)):  # jumps either way
    assert _after(m, params, batches, step, [scale] * 4) == {}  # nothing ran after the step
    metrics = m.step(params, batches, step + 1)[0].metrics
    assert metrics["memory/recalibrations"] == 0.0 and metrics["alloc/frac_L"] == 0.0
  assert m.state.calibrations == 0 and m.state.calibration is None


@pytest.mark.slow  # two set-ups and a calibration over four minibatches; the quick tier keeps the plan without L
@pytest.mark.usefixtures("fixed_op_times")
def test_warmup_runs_gc_until_calibration_minibatches_from_two_rollouts_are_in(tiny):
  hooks, params, batches, mc = tiny
  m = MemoryManager(dataclasses.replace(mc, calib_batches=4, calib_rollouts=2, drift_check_every=0), hooks)
  first, second = batches[:2], batches[2:] + [batches[0]]
  assert all(a.bucket == -1 for a in m.step(params, first, 0))  # warm-up: full checkpointing
  m.finish_step(params, first, 0)
  # the plan phase is done (budget, fits, and L worth calibrating); one rollout in: still full checkpointing
  assert m.state.lgain["calibrate"] and m.state.calibration is None and m.pending_setup
  assert all(a.bucket == -1 for a in m.step(params, second, 1))
  later = jax.tree_util.tree_map(lambda x: x * 1.01, params)  # the second rollout's update moved the params
  m.finish_step(later, second, 1)
  cal = m.state.calibration
  assert not m.pending_setup and cal.calib_batches == 4 and m.state.calibrated_at == 2
  # in turn from each rollout: first[0], second[0], first[1], second[1], each at its own rollout's params
  expected = [first[0], second[0], first[1], second[1]]
  assert [float(g) for g in cal.grad_norms] == pytest.approx(
      [float(drift.calibration.reference(hooks, drift.calibration.UpdateContext(p), b).grad_norm)
       for p, b in zip([params, later, params, later], expected)], rel=1e-5)
