"""Seconds per calibration measurement at E1's shape on a fetched model (default SmolLM2-135M-Instruct): one probe
gradient (a reference, or one L set), the instrumented backward (the reference and every weight-read unit's error),
and the compile of a mixed plan's gradient program. Each is run twice; the second, warm, is the figure.

  python -m train.fetch_model smollm2-135m-instruct && python scripts/probe_cost.py [MODEL_DIR]"""

import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout it runs from, as `python -m` would

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hilore_jax import model, runtime  # noqa: E402
from hilore_jax.capacity import synthetic  # noqa: E402
from hilore_jax.loop import step_hooks  # noqa: E402
from hilore_jax.model import hf  # noqa: E402
from hilore_jax.rl import train_step  # noqa: E402
from hilore_jax.rl.config import GRPOConfig  # noqa: E402

ROWS, PROMPT, COMPLETION = 8, 96, 256  # configs/exposure_e1_smollm2.yaml: a minibatch of 8, prompt 96 + 256


def timed(name: str, fn) -> float:
  for _ in range(2):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    s = time.perf_counter() - t0
  print(f"{name}: {s:.1f} s (warm)", flush=True)
  return s


def main():
  path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(runtime.cache_dir("models"), "smollm2-135m-instruct")
  cfg, params = hf.load_hf(path)
  L = cfg.num_hidden_layers
  spec = train_step.StepSpec(cfg, GRPOConfig(beta=0.02), model.uniform(L, model.NO_REMAT), use_old_logp=True,
                             use_ref_logp=True)
  hooks = step_hooks.memory_hooks(None, spec, 1.0)
  batch = synthetic.grpo_batch(cfg, params, np.random.default_rng(0), ROWS, PROMPT, COMPLETION, group=ROWS)
  probe = timed("probe gradient", lambda: hooks.probe_gradient(params, batch, np.zeros((L, len(model.UNITS)),
                                                                                         np.float32), "int8", 64))
  inst = timed("instrumented backward", lambda: hooks.probe_errors(params, batch, "int8", 64))
  print(f"reference + decomposed probe: {2 * probe:.1f} s; instrumented / that: {inst / (2 * probe):.2f}")
  pols = tuple(model.FULL_REMAT if i % 2 else model.LayerPolicy(remat=True, save=(model.Q, model.K),
                                                                lowp=(model.ATTN_NORM,), formats=("int8",))
               for i in range(L))
  t0 = time.perf_counter()
  jax.jit(lambda p, b: train_step.grads_and_stats(p, b, dataclasses.replace(spec, policies=pols))[0]).lower(
      params, batch).compile()
  print(f"compile of a mixed plan's gradient program: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
  main()
