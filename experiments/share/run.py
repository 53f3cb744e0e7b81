"""The update with each GRPO group's prompt computed once against once per row (issue 35), compile-only: the
gradient and update programs' matmul FLOPs (the jaxpr's, every layer and recompute counted: capacity/flops.py), XLA's
cost-analysis FLOPs (every loop body once, the layer scan's too) and the compiled peak (`engine.Step.peak_bytes`),
per remat policy, on identical rollouts (each prompt repeated G times, every token real)."""

from __future__ import annotations

import json
import os

import numpy as np

from hilore_jax import model
from hilore_jax.loop import engine
from hilore_jax.capacity import flops
from experiments.common import engines
from hilore_jax.config import Config
from hilore_jax.rl import prompt_share, train_step
from hilore_jax.rl.update_batch import UpdateBatch

POLICIES = {"none": model.NO_REMAT, "gc": model.FULL_REMAT}


def group_batch(num_prompts: int, G: int, prompt_len: int, completion_len: int, vocab: int,
                seed: int = 0) -> UpdateBatch:
  """A minibatch of num_prompts groups of G rows (the rollout's layout, row i*G+g), every token real."""
  rng = np.random.default_rng(seed)
  B = num_prompts * G
  prompts = np.repeat(rng.integers(1, vocab, (num_prompts, prompt_len)), G, axis=0).astype(np.int32)
  return UpdateBatch(prompts, np.ones_like(prompts), rng.integers(1, vocab, (B, completion_len)).astype(np.int32),
                     np.ones((B, completion_len), np.int32), rng.normal(size=B).astype(np.float32))


def measure(cfg: Config, num_prompts: int = 8, G: int = 8, prompt_len: int = 256, completion_len: int = 256,
            policies=("none", "gc")) -> dict:
  """Figures of the shared and unshared update per remat policy, and their ratios."""
  mcfg = engine.model_config(cfg)
  eng, state = engines.build(cfg, mcfg, abstract=True)
  batch = group_batch(num_prompts, G, prompt_len, completion_len, mcfg.vocab_size, cfg.seed)
  batches = {"unshared": batch, "shared": prompt_share.share_prompts(batch)}
  out: dict = {"prompts": num_prompts, "generations": G, "prompt_len": prompt_len, "completion_len": completion_len,
               "layers": mcfg.num_hidden_layers, "hidden": mcfg.hidden_size, "attention": mcfg.attention,
               "dtype": mcfg.dtype, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  for mode, b in batches.items():
    out[f"tokens/{mode}"] = prompt_share.token_counts(b)[0]
  for name in policies:
    spec = train_step.StepSpec(mcfg, cfg.grpo, model.uniform(mcfg.num_hidden_layers, POLICIES[name]),
                               logprob_chunk=cfg.train.logprob_chunk)
    for mode, b in batches.items():
      step = eng.stepper.get(spec, b, count=False)
      matmul = flops.program_flops(lambda p, b: train_step.gradient_step(p, b, spec)[0], state["params"], b)
      out[f"{name}/{mode}"] = {"matmul_flops": matmul, "xla_flops": step.flops, "peak_bytes": step.peak_bytes,
                               "grad_temp_bytes": step.grad_temp_bytes}
    s, u = out[f"{name}/shared"], out[f"{name}/unshared"]
    out[f"{name}/ratio"] = {k: s[k] / u[k] for k in s}
  out["ideal_ratio"] = out["tokens/shared"] / out["tokens/unshared"]
  return out


def table(row: dict, policies=("none", "gc")) -> str:
  """Markdown table of one measure() row."""
  lines = [f"{row['prompts']} prompts x G={row['generations']}, prompt {row['prompt_len']}, completions "
           f"{row['completion_len']}, {row['layers']} layers, {row['attention']} attention, {row['dtype']}: "
           "compile-only",
           f"token positions: shared {row['tokens/shared']}, unshared {row['tokens/unshared']} "
           f"(ideal ratio {row['ideal_ratio']:.3f})", "",
           "| remat | update | matmul GFLOP | XLA GFLOP (loop bodies once) | compiled peak MiB |",
           "|---|---|---|---|---|"]
  for name in policies:
    for mode in ("unshared", "shared", "ratio"):
      f = row[f"{name}/{mode}"]
      if mode == "ratio":
        lines.append(f"| {name} | **shared / unshared** | **{f['matmul_flops']:.3f}x** | {f['xla_flops']:.3f}x | "
                     f"**{f['peak_bytes']:.3f}x** |")
      else:
        lines.append(f"| {name} | {mode} | {f['matmul_flops'] / 1e9:.1f} | {f['xla_flops'] / 1e9:.1f} | "
                     f"{f['peak_bytes'] / 2**20:.0f} |")
  return "\n".join(lines)


def run(cfg: Config, out_path: str, **kw) -> dict:
  row = measure(cfg, **kw)
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "w") as f:
    json.dump(row, f, indent=1)
  return row


