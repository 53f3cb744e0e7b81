"""Compile seconds of the train step against depth: full checkpointing (one policy run) and a mixed HiLoRe-like
plan (H, L and R layers in three runs, as a plan of a few exposure levels gives), each at several depths.

Consecutive layers with the same policy run under one `lax.scan`, so compile time should follow the number of
distinct policy runs, which is fixed here, not the number of layers; the per-layer plan (every layer's policy
differs from its neighbours') is the worst case for comparison, where the scan cannot help.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from hilore_jax import model, sharding
from hilore_jax.loop import engine
from hilore_jax.capacity import synthetic
from experiments.config import BenchConfig
from hilore_jax.config import Config
from hilore_jax.rl import train_step

DEPTHS = (4, 8, 16, 32)
KEEP = model.LayerPolicy(remat=True, save=(model.MLP_GATE, model.Q))  # H: two matmul outputs kept
LOWP = model.LayerPolicy(remat=True, save=(model.V,), lowp=(model.MLP_NORM,))  # L: an int8 norm output


def plans(num_layers: int) -> dict[str, tuple[model.LayerPolicy, ...]]:
  """gc: one run; hilore_mixed: thirds kept H / L / recomputed (three runs); per_layer: no two neighbours equal."""
  third = max(num_layers // 3, 1)
  mixed = (KEEP,) * third + (LOWP,) * third + (model.FULL_REMAT,) * (num_layers - 2 * third)
  cycle = (KEEP, LOWP, model.FULL_REMAT)
  return {"gc": model.uniform(num_layers, model.FULL_REMAT), "hilore_mixed": mixed,
          "per_layer": tuple(cycle[i % 3] for i in range(num_layers))}


def _batch(cfg: Config, bc: BenchConfig, mcfg: model.ModelConfig, mesh):
  host = synthetic.token_batch(mcfg.vocab_size, np.random.default_rng(cfg.seed), bc.batch_size, bc.prompt_len,
                               bc.seq_len - bc.prompt_len)
  return jax.device_put(host, sharding.batch_sharding(mesh))


def measure(cfg: Config, bc: BenchConfig, depths=DEPTHS, names=("gc", "hilore_mixed"), progress=print) -> list[dict]:
  """One row per (depth, plan): compile seconds of the gradient program (the update program is compiled first and
  does not depend on the plan), the number of policy runs, and the compiled peak bytes."""
  rows = []
  for depth in depths:
    mcfg = engine.model_config(cfg).replace(num_hidden_layers=depth)
    eng, _ = engine.build(cfg, mcfg, 10)
    batch = _batch(cfg, bc, mcfg, eng.mesh)
    grpo = dataclasses.replace(cfg.grpo, max_completion_len=bc.seq_len - bc.prompt_len)
    eng.stepper.update_program(train_step.StepSpec(mcfg, grpo, plans(depth)["gc"], 1, cfg.train.logprob_chunk), batch)
    for name in names:
      pols = plans(depth)[name]
      spec = train_step.StepSpec(mcfg, grpo, pols, 1, cfg.train.logprob_chunk)
      t0 = time.perf_counter()
      step = eng.stepper.get(spec, batch, reason=f"bench_compile {name} at {depth} layers")
      row = {"layers": depth, "plan": name, "policy_runs": len(model.policy_runs(pols)),
             "compile_s": time.perf_counter() - t0, "peak_bytes": step.peak_bytes}
      rows.append(row)
      progress(f"{depth:3d} layers  {name:13s} {row['policy_runs']:3d} runs  compile {row['compile_s']:7.2f} s")
  return rows


def table(rows: list[dict]) -> str:
  """Markdown: one row per depth, compile seconds per plan."""
  names = list(dict.fromkeys(r["plan"] for r in rows))
  by = {(r["layers"], r["plan"]): r for r in rows}
  lines = ["| layers | " + " | ".join(f"{n} compile s (runs)" for n in names) + " |",
           "|---|" + "---|" * len(names)]
  for depth in dict.fromkeys(r["layers"] for r in rows):
    cells = [f"{by[depth, n]['compile_s']:.2f} ({by[depth, n]['policy_runs']})" for n in names]
    lines.append(f"| {depth} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
