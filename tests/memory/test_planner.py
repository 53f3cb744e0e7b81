"""Planning as pure functions over an explicit state (memory/planner.py, fitting.py): each call returns a new state
and leaves the one it was given as it was; a bucket's plan is solved once, until a fit or a recalibration drops it;
and a study's options arrive as a StudyProbe given to the manager (memory/probe.py)."""

import manager_util
import numpy as np
import pytest

from hilore_jax.memory import Calibration, MemoryManager, fitting, planner, probe
from hilore_jax.memory.config import GateConfig, MemoryConfig

# buckets by exposure level, the gate off: allocate scores nothing (the given calibration has no error profile)
MC = MemoryConfig(policy="hilore", budget_ratio=1.5, group_size=8, budget_probes=2, buckets=4,
                  gate=GateConfig(mode="never"))


def _calibration(U: int) -> Calibration:
  return Calibration([1.0] * U, [1e-3] * U, [1e-3] * U, delta=1e-4, calibration_error=0.0, calibration_level=0.1,
                     level_max=0.1, fit={}, calib_batches=1)


@pytest.mark.usefixtures("fixed_op_times")
def test_planning_returns_new_states_and_leaves_the_given_one():
  hooks, params = manager_util.hooks()
  batch = manager_util.batch(np.random.default_rng(0), [1.0, -1.0, 0.5])
  mm = MemoryManager(MC, hooks)
  mm.setup(params, [batch], 0, calibration_state=_calibration(len(mm.lowp_ids)))
  pl, U = mm.planner, len(mm.lowp_ids)
  ps = planner.at_shape(pl, mm.planner_state, batch)
  assert ps.shape == hooks.batch_shape(batch) and mm.planner_state.shape is None  # the driver's state untouched

  ps1, b0 = planner.bucket_for(pl, ps, (0,) * U)  # a new bucket is appended to the new state's buckets only
  assert b0 == 0 and ps.saved.buckets == [] and ps1.saved.buckets == [[0] * U]
  before = ps1.saved.to_json()
  ps2 = fitting.fit(pl, ps1, b0, batch)  # probe compiles: the fit lands in the new state
  assert ps1.saved.to_json() == before and not ps1.saved.verified and ps2.saved.verified == [0]
  assert "0" in ps2.saved.allowance and 0 not in ps2.buckets  # its plan is solved on first use

  ps3, plan = planner.bucket_plan(pl, ps2, 0)
  ps4, again = planner.bucket_plan(pl, ps3, 0)
  assert 0 not in ps2.buckets and ps4 is ps3 and again is plan  # solved once
  # lower levels in every unit: the fitted bucket covers them (no new bucket); higher ones: a new bucket
  ps5, b = planner.bucket_for(pl, ps4, (-1,) * U)
  assert b == 0 and ps5.saved.buckets == [[0] * U]
  ps6, b = planner.bucket_for(pl, ps5, (1,) * U)
  assert b == 1 and len(ps6.saved.buckets) == 2 and len(ps5.saved.buckets) == 1
  # a fit drops its own bucket's plan, a recalibration every plan and solve; re-solving gives the same plan
  assert 0 not in planner.forget(ps6, "fitted", bucket=0).buckets and 0 in ps6.buckets
  dropped = planner.forget(ps6, "recalibrated", plans=True)
  assert not dropped.plans and not dropped.buckets and ps6.plans
  assert planner.bucket_plan(pl, dropped, 0)[1] == plan

  # the driver holds the state each call returns; its one bucket (exposure off) has the same risks, so the same plan
  assert mm.state.verified == [] and mm.state.buckets == []
  a = mm.allocate([batch])[0]
  assert a.bucket == 0 and mm.state.buckets == [[]] and mm.state.verified == [0] and a.plan == plan


def test_an_oracle_probe_scores_minibatches_with_the_errors_given():
  hooks, _ = manager_util.hooks()
  batch = manager_util.batch(np.random.default_rng(0), [1.0, -1.0, 0.5])
  errors = np.array([0.0, 1e-3, 2e-3, 5e-2])
  oracle = MemoryManager(MC, hooks, probe=probe.StudyProbe(oracle=True))
  probe.give_errors(oracle, errors)
  np.testing.assert_array_equal(oracle.unit_scores([batch]), errors[None])  # no calibration needed: nothing scored
  with pytest.raises(TypeError, match="oracle=True"):
    probe.give_errors(MemoryManager(MC, hooks), errors)
  # the options are the constructor's: a manager's calibrations keep their measurements only when asked
  assert not MemoryManager(MC, hooks).probe.keep_measurements and probe.measurements(oracle) is None
