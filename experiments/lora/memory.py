"""python -m experiments.lora.memory --config configs/smollm2-135m-reason-lora.yaml --out runs/lora_memory \
    model.attention=xla
    [--shapes smollm2-135m,qwen2.5-1.5b] [--beta 0.04]

LoRA against full fine-tuning, compile-only (abstract params: nothing is allocated or run), per model shape: the
resident bytes of the train state (params, AdamW state, and the KL reference: a copy of the params for full
fine-tuning, the frozen base itself for LoRA), the update's compiled peak under full checkpointing on one
microbatch of the config's shape (rows of train.microbatch_size, else 8; rollout.max_prompt_len +
rollout.max_new_tokens; engine.Step.peak_bytes: the larger program's temp plus the gradients, beyond the state),
the gradient program's matmul FLOPs (capacity/flops.py: the frozen weights' gradient matmuls are gone under LoRA)
and the share of them that is GC's repeated forward (1 - No-GC's / GC's). The LoRA arm is the config's lora
section (rank 16, all seven projections if it has none); writes lora_memory.json and lora_memory.md to --out.
"""

from __future__ import annotations

import dataclasses
import json
import os

from hilore_jax import cli

MiB = 2**20


def measure(cfg, shape: str | None, beta: float) -> dict:
  """One shape's figures, full fine-tuning and LoRA (cfg.lora, or rank 16 on all seven projections)."""
  import jax

  from experiments.common import engines
  from hilore_jax import model
  from hilore_jax.capacity import flops, measure as capacity
  from hilore_jax.loop import engine
  from hilore_jax.model import lora
  from hilore_jax.model.config import LoraSpec
  from hilore_jax.rl import train_step

  settings = capacity.Settings(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
  base_cfg = capacity.load_shape(shape, settings) if shape else engine.model_config(cfg)
  spec_l = cfg.lora.spec() or LoraSpec(16, 32.0)
  rows = cfg.train.microbatch_size or 8
  P, N = cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
  batch = capacity.abstract_batch(rows, P, N, beta > 0)
  out = {"shape": shape or cfg.model.path, "rows": rows, "prompt_len": P, "completion_len": N, "beta": beta,
         "lora_spec": dataclasses.asdict(spec_l), "dtype": base_cfg.dtype, "param_dtype": base_cfg.param_dtype}
  for name, mcfg in (("full", base_cfg), ("lora", base_cfg.replace(lora=spec_l))):
    eng, state = engines.build(cfg, mcfg, abstract=True)
    spec = train_step.StepSpec(mcfg, dataclasses.replace(cfg.grpo, beta=beta, max_completion_len=N),
                               model.uniform(mcfg.num_hidden_layers, model.FULL_REMAT), 1, cfg.train.logprob_chunk,
                               use_old_logp=True, use_ref_logp=beta > 0)
    nogc = dataclasses.replace(spec, policies=model.uniform(mcfg.num_hidden_layers, model.NO_REMAT))
    step = eng.stepper.get(spec, batch, count=False)
    sa = eng.stepper.state_abstract
    params_b, opt_b = capacity.device_bytes(sa["params"]), capacity.device_bytes(sa["opt_state"])
    ref_b = params_b if beta > 0 and mcfg.lora is None else 0  # LoRA's reference is its own frozen base
    trained = sum(x.size for x in jax.tree.leaves(lora.trainable(state["params"])))
    out[name] = {"params_bytes": params_b, "optimizer_bytes": opt_b, "reference_bytes": ref_b,
                 "resident_bytes": params_b + opt_b + ref_b, "trained_params": int(trained),
                 "peak_bytes": step.peak_bytes, "grad_temp_bytes": step.grad_temp_bytes,
                 "update_temp_bytes": step.update_temp_bytes, "grad_bytes": step.grad_bytes,
                 "grad_matmul_flops": flops.program_flops(
                     lambda p, b: train_step.grads_and_stats(p, b, spec)[0], sa["params"], batch),
                 "grad_matmul_flops_nogc": flops.program_flops(
                     lambda p, b: train_step.grads_and_stats(p, b, nogc)[0], sa["params"], batch)}
    # the share of GC's gradient program that is its repeated forward: what keeping activations can save
    out[name]["recompute_share"] = 1 - out[name]["grad_matmul_flops_nogc"] / out[name]["grad_matmul_flops"]
  return out


def markdown(rows: list[dict]) -> str:
  lines = ["| shape | learner | trained params | params | AdamW state | reference | resident | update peak | "
           "gradient matmul FLOPs | GC's recompute share |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    for name in ("full", "lora"):
      x = r[name]
      label = "full" if name == "full" else f"LoRA r{r['lora_spec']['rank']}"
      lines.append(f"| {r['shape']} | {label} | {x['trained_params'] / 1e6:,.2f} M | {x['params_bytes'] / MiB:,.0f} | "
                   f"{x['optimizer_bytes'] / MiB:,.1f} | {x['reference_bytes'] / MiB:,.0f} | "
                   f"{x['resident_bytes'] / MiB:,.0f} | {x['peak_bytes'] / MiB:,.0f} | "
                   f"{x['grad_matmul_flops'] / 1e12:,.3f} T | {x['recompute_share']:.3f} |")
    f, lo = r["full"], r["lora"]
    ratio = lambda k: lo[k] / f[k]
    lines.append(f"| {r['shape']} | LoRA / full | | | | | {ratio('resident_bytes'):.3f} | "
                 f"{ratio('peak_bytes'):.3f} | {ratio('grad_matmul_flops'):.3f} | |")
  r0 = rows[0]
  lines.append(f"\nMiB per device, compile-only; one microbatch of {r0['rows']} rows x ({r0['prompt_len']} + "
               f"{r0['completion_len']}) tokens under full checkpointing, KL beta {r0['beta']}, "
               f"{r0['dtype']} compute, {r0['param_dtype']} params.")
  return "\n".join(lines)


def body(args):
  cfg = cli.load_config(args.config, list(args.overrides))
  shapes = [s for s in args.shapes.split(",") if s] or [None]
  rows = []
  for s in shapes:
    rows.append(measure(cfg, s, args.beta))
    cli.progress(f"{s}: resident {rows[-1]['full']['resident_bytes'] / MiB:,.0f} -> "
                 f"{rows[-1]['lora']['resident_bytes'] / MiB:,.0f} MiB, update peak "
                 f"{rows[-1]['full']['peak_bytes'] / MiB:,.0f} -> {rows[-1]['lora']['peak_bytes'] / MiB:,.0f} MiB")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "lora_memory.json"), "w") as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(args.out, "lora_memory.md"), "w") as f:
    f.write(markdown(rows) + "\n")
  print(markdown(rows))


def main(argv=None):
  cli.main("LoRA against full fine-tuning: resident bytes, the update's compiled peak and matmul FLOPs "
           "(compile-only)", body, argv, args=[
               cli.arg("--out", default="runs/lora_memory"),
               cli.arg("--shapes", default="smollm2-135m,qwen2.5-1.5b",
                       help="configs/shapes names ('' for the config's own model)"),
               cli.arg("--beta", type=float, default=0.04, help="KL beta: a reference resident beside the state")])


if __name__ == "__main__":
  main()
