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


@pytest.fixture(scope="module")
def tiny():
  hooks, params = manager_util.hooks(1.0)  # clip c = 1
  rng = np.random.default_rng(0)
  adv = np.array([1.5, -0.5, -1.0, 1.0, 0.5, -1.5])
  batches = [manager_util.batch(rng, adv * s) for s in (1.0, 2.0, 0.5, 1.5)]
  mc = MemoryConfig(policy="hilore", budget_ratio=1.5, group_size=8, calib_sets=1, budget_probes=2, buckets=1,
                    cache=False, verify_steps=0, drift_check_every=1)
  return hooks, params, batches, mc


@pytest.mark.usefixtures("fixed_op_times")
def test_a_sentinel_jump_recalibrates_and_a_steady_run_does_not(tiny):
  hooks, params, batches, mc = tiny
  m = MemoryManager(dataclasses.replace(mc, warmup="none"), hooks)
  m.step(params, batches, 0)
  cal = m.state.calibration
  assert m.state.calibrated_at == 0 and len(cal.grad_norms) == 4 and len(cal.recon_rms) == len(m.lowp_ids)
  steady = list(cal.grad_norms)
  for step in (1, 2):  # the same gradients, params and minibatches: every sentinel at its calibration value
    m.observe(0.1, False, grad_norms=steady)
    metrics = m.step(params, batches, step)[0].metrics
    assert m.state.calibrated_at == 0 and metrics["memory/recalibrated"] == 0.0
    assert metrics["memory/drift/grad_ratio"] == pytest.approx(1.0)
    # drift_check_every=1: the reconstruction RMS and the running plan's exact error are measured each step
    assert 0.5 < metrics["memory/drift/recon_ratio"] < 1.5 and np.isfinite(metrics["memory/drift/exact_ratio"])
  m.observe(0.1, False, grad_norms=[10 * g for g in steady])  # ||g|| / c jumps 10x
  metrics = m.step(params, batches, 3)[0].metrics
  assert m.state.calibrated_at == 3 and metrics["memory/recalibrated"] == 1.0
  assert metrics["memory/drift/grad_ratio"] == pytest.approx(10.0)
  assert m.state.calibration is not cal  # measured again


@pytest.mark.usefixtures("fixed_op_times")
def test_warmup_runs_gc_until_calibration_minibatches_from_two_rollouts_are_in(tiny):
  hooks, params, batches, mc = tiny
  m = MemoryManager(dataclasses.replace(mc, calib_batches=4, calib_rollouts=2, drift_check_every=0), hooks)
  first, second = batches[:2], batches[2:] + [batches[0]]
  assert all(a.bucket == -1 for a in m.step(params, first, 0))  # warm-up: full checkpointing
  m.finish_step(params, first, 0)
  assert m.state is None and m.pending_setup  # one rollout in: still full checkpointing
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
