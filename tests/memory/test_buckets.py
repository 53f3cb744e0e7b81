import jax
import numpy as np
import pytest

from hilore_jax import model
from hilore_jax.loop import engine
from hilore_jax.memory import buckets
from hilore_jax.rl import train_state, train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import UpdateBatch


def test_unit_levels_by_hand():
  ref = [1.0, 1.0, 1.0, 0.0, 2.0]
  # 1.0 is level 0's upper edge; 1.5 lies in (sqrt2, 2]: level 2; 0.01 is raised to the lowest level -4; a unit with
  # no calibrated risk and a zero score are ZERO
  levels = buckets.unit_levels([1.0, 1.5, 0.01, 3.0, 0.0], ref, 4)
  assert levels == (0, 2, -4, buckets.ZERO, buckets.ZERO)
  np.testing.assert_allclose(buckets.level_risk(levels, ref), [1.0, 2.0, 0.25, 0.0, 0.0])
  assert all(r >= s for r, s in zip(buckets.level_risk(levels, ref), [1.0, 1.5, 0.01, 0.0, 0.0]))  # never below


@pytest.mark.slow
def test_second_step_in_the_same_bucket_compiles_nothing(tiny_cfg):
  import numpy as np
  import optax

  from hilore_jax import sharding
  mesh = sharding.make_mesh(1, 1)
  params = model.init_params(tiny_cfg, jax.random.PRNGKey(0))
  opt = optax.adam(1e-3)
  state = train_state.create(params, opt)
  shardings = jax.tree_util.tree_map(lambda _: sharding.replicated(mesh), state)
  stepper = engine.Stepper(mesh, opt, state, shardings)
  rng = np.random.default_rng(0)
  batch = lambda: UpdateBatch(rng.integers(3, 31, (4, 3)).astype(np.int32), np.ones((4, 3), np.int32),
                              rng.integers(3, 31, (4, 2)).astype(np.int32), np.ones((4, 2), np.int32),
                              rng.normal(size=4).astype(np.float32))
  lc = GRPOConfig()
  by_bucket = {0: model.uniform(tiny_cfg.num_hidden_layers, model.FULL_REMAT),
               1: model.uniform(tiny_cfg.num_hidden_layers, model.LayerPolicy(remat=True, lowp=(model.MLP_DOWN_IN,)))}
  for bucket in (0, 0, 1, 1, 0):
    spec = train_step.StepSpec(tiny_cfg, lc, by_bucket[bucket])
    state, _ = stepper(spec, state, batch(), reason=f"bucket {bucket}")
  assert stepper.compile_count == 2  # one per bucket used, none for repeats
  assert [e["reason"] for e in stepper.compile_log] == ["bucket 0", "bucket 1"]


def test_probe_compiles_are_bounded_and_the_recent_ones_promoted(tiny_cfg):
  # a run that probes many plans keeps only the last few executables (each holds JIT-mapped code; hundreds hit the
  # process's map limit), and a kept probe that is then run is promoted without compiling again
  import optax

  from hilore_jax import sharding
  mesh = sharding.make_mesh(1, 1)
  params = model.init_params(tiny_cfg, jax.random.PRNGKey(0))
  opt = optax.adam(1e-3)
  state = train_state.create(params, opt)
  stepper = engine.Stepper(mesh, opt, state, jax.tree_util.tree_map(lambda _: sharding.replicated(mesh), state),
                           probe_cache=2)
  batch = UpdateBatch(np.full((4, 3), 5, np.int32), np.ones((4, 3), np.int32), np.full((4, 2), 7, np.int32),
                      np.ones((4, 2), np.int32), np.ones(4, np.float32))
  L = tiny_cfg.num_hidden_layers
  plans = [model.uniform(L, model.FULL_REMAT), model.uniform(L, model.NO_REMAT),
           model.uniform(L, model.LayerPolicy(remat=True, save=(model.MLP_GATE,)))]
  specs = [train_step.StepSpec(tiny_cfg, GRPOConfig(), p) for p in plans]
  for spec in specs:
    assert stepper.get(spec, batch, count=False).peak_bytes > 0
  assert stepper.probe_compiles == 3 and len(stepper._probed) == 2  # the oldest probe was let go
  stepper.get(specs[1], batch, count=False)  # used again: now the most recent
  stepper.get(specs[0], batch, count=False)  # evicted earlier: compiled again, letting go of specs[2], least recent
  assert stepper.probe_compiles == 4 and len(stepper._probed) == 2
  stepper.get(specs[1], batch)  # run: promoted from the probes, no compile
  assert stepper.probe_compiles == 4 and [e["seconds"] for e in stepper.compile_log] == [0.0]
