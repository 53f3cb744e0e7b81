"""Subprocess body for the GPU peak test (a fresh process, so peak_bytes_in_use counts only this run): plan
optimal H/R under 1.10x GC on a compiled step, run it once, print budget and measured bytes as JSON."""

import dataclasses
import json
import os
import sys

# this checkout (tests/<wing>/ is two levels below it), not an installed copy
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import jax  # noqa: E402
import numpy as np  # noqa: E402

from hilore_jax import cli, model, sharding  # noqa: E402
from hilore_jax.loop import engine, step_hooks
from hilore_jax.capacity import synthetic  # noqa: E402
from hilore_jax.memory import MemoryManager  # noqa: E402
from hilore_jax.rl import train_step

cfg = cli.load_config(None, ["model.vocab_size=512", "model.hidden_size=512", "model.intermediate_size=1408",
                             "model.num_hidden_layers=6", "model.num_attention_heads=8", "model.num_key_value_heads=2",
                             "memory.policy=optimal_hr", "memory.budget_ratio=1.10", "memory.budget_probes=3"])
mcfg = engine.model_config(cfg)
eng, state0 = engine.build(cfg, mcfg, 10)
B, P, N = 8, 64, 960
grpo = dataclasses.replace(cfg.grpo, max_completion_len=N)
spec = train_step.StepSpec(mcfg, grpo, model.uniform(mcfg.num_hidden_layers, model.NO_REMAT), 1, 128,
                           use_old_logp=True)
host = synthetic.grpo_batch(mcfg, state0["params"], np.random.default_rng(0), B, P, N, 4)
batch = jax.device_put(host.replace(ref_logp=None), sharding.batch_sharding(eng.mesh))
manager = MemoryManager(cfg.memory, step_hooks.memory_hooks(eng.stepper, spec))
manager.setup(state0["params"], [batch], 0)  # profiles single-layer ops: far below the step's peak
(alloc,) = manager.allocate([batch])  # probe compiles only: nothing of the step has run yet
step = eng.stepper.get(dataclasses.replace(spec, policies=alloc.policies), batch)
dev = jax.devices()[0]
jax.block_until_ready((state0, batch))
base, before = dev.memory_stats()["bytes_in_use"], dev.memory_stats()["peak_bytes_in_use"]
state, metrics = step(state0, batch)
jax.block_until_ready((state, metrics))
peak = dev.memory_stats()["peak_bytes_in_use"]
print(json.dumps({"budget_bytes": manager.state.budget_bytes, "compiled_bytes": step.peak_bytes,
                  "base_bytes": base, "peak_before": before, "peak_bytes_in_use": peak, "frac_H": alloc.metrics[
                      "alloc/frac_H"], "device": dev.device_kind}))
