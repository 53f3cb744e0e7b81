"""Subprocess body for the per-device accounting test: argv = devices, mesh data, mesh fsdp, output .json.

Sets up HiLoRe's memory manager on one minibatch and writes what it accounted (budget, unit bytes, plan) and the
compiled per-device peak of the step it chose. The calibration is given (uniform unit errors), not measured: this
test is about bytes, and measuring would compile a gradient per unit.
"""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared helpers
from devices import start_worker  # noqa: E402

n_dev, data, fsdp, out = start_worker()
import numpy as np  # noqa: E402
from trainer_util import tiny_config  # noqa: E402

from hilore_jax.memory import methods, planner, profile  # noqa: E402
from hilore_jax.memory.manager import Calibration  # noqa: E402
from hilore_jax.rl.update_batch import UpdateBatch  # noqa: E402
from hilore_jax.loop.trainer import Trainer  # noqa: E402

t = Trainer(tiny_config(out + ".run", f"mesh.data={data}", f"mesh.fsdp={fsdp}", "train.warmstart_steps=0",
                        "model.hidden_size=32", "model.intermediate_size=88", "memory.policy=hilore",
                        "memory.group_size=8", "memory.buckets=1", "memory.budget_ratio=1.25",
                        "memory.budget_probes=1"))
rng = np.random.default_rng(0)
B, P, N = 12, 7, 9
batch = t.place(UpdateBatch(rng.integers(3, 80, (B, P)).astype(np.int32), np.ones((B, P), np.int32),
                            rng.integers(3, 80, (B, N)).astype(np.int32), (rng.random((B, N)) > 0.2).astype(np.int32),
                            rng.normal(size=B).astype(np.float32)))
U = len(t.memory.lowp_ids)
cal = Calibration([1.0] * U, [1e-3] * U, [1e-3] * U, delta=1e-4, calibration_error=0.0, calibration_level=0.1,
                  level_max=0.1, fit={}, calib_batches=1)
t.memory.setup(t.state["params"], [batch], 0, calibration_state=cal)
(alloc,) = t.memory.allocate([batch])
st, units = t.memory.state, planner.unit_list(t.memory.planner_state)
step = t.stepper.get(dataclasses.replace(t.spec, policies=alloc.policies), batch)
cfg = t.model_cfg


def plan_for(rows):
  """HiLoRe's plan at the fitted allowance with units sized for `rows` rows per gradient pass."""
  us = profile.enumerate_units(cfg, rows, P + N, 8, st.profile)
  risk_of = planner.risks(t.memory.planner, t.memory.planner_state, 0)[0]
  return methods.plan("hilore", us, st.profile["ops"], st.allowance["0"], risk_of=risk_of,
                      delta=st.calibration.delta, group_size=8)


with open(out, "w") as f:
  json.dump({"gc_bytes": st.gc_bytes, "budget_bytes": st.budget_bytes, "allowance": st.allowance["0"],
             "rows": t.memory.planner_state.shape[0], "unit_bytes": sum(u.bytes_h for u in units),
             "global_unit_bytes": sum(u.bytes_h for u in profile.enumerate_units(cfg, B, P + N, 8)),
             "choice": list(alloc.plan.choice), "plan_bytes": alloc.plan.bytes,
             "global_choice": list(plan_for(B).choice), "compiled_bytes": step.peak_bytes,
             "frac_H": alloc.metrics["alloc/frac_H"], "frac_L": alloc.metrics["alloc/frac_L"]}, f)
