"""python -m train.capacity --out DIR [--shapes smollm2-135m,qwen2.5-1.5b] [--methods gc,hilore] [--budgets-gib 24,80]
    [--devices 1,8] [--attention xla,blockwise] [--growth-methods gc] [--lora RANK]
    [--packed] [--microbatch-rows 8] [--mlp-chunk-len 512] [--plan-runs 2]

The longest completion whose whole GRPO step (gradient and update programs, old and reference log-prob passes)
compiles within each per-device budget, compile-only (hilore_jax/capacity/measure.py; docs/capacity.md). Every
compiled point is cached in DIR/capacity_cache.json: a rerun resumes where the last one stopped.
"""

import os

from hilore_jax import cli, runtime
from hilore_jax.errors import ConfigError


def _list(flag: str, text: str, known=None) -> list[str]:
  items = [x.strip() for x in text.split(",") if x.strip()]
  if not items:
    raise ConfigError(f"{flag} is empty")
  bad = [x for x in items if known is not None and x not in known]
  if bad:
    raise ConfigError(f"{flag}: unknown {bad}; choose from {', '.join(known)}")
  return items


def _numbers(flag: str, text: str, kind=float) -> list:
  try:
    out = [kind(x) for x in _list(flag, text)]
  except ValueError:
    raise ConfigError(f"{flag} must be comma-separated {'integers' if kind is int else 'numbers'}, got "
                      f"{text!r}") from None
  if any(x <= 0 for x in out):
    raise ConfigError(f"{flag} must be positive, got {text!r}")
  return out


def body(args):
  from hilore_jax.capacity import measure as capacity, run as capacity_run
  from hilore_jax.model.config import ATTENTION_KERNELS

  devices = _numbers("--devices", args.devices, int)
  budgets = _numbers("--budgets-gib", args.budgets_gib)
  shapes = _list("--shapes", args.shapes)
  unknown = [s for s in shapes if not (s.endswith(".json") and os.path.exists(s)) and s not in capacity.shape_names()]
  if unknown:
    raise ConfigError(f"--shapes: unknown {unknown}; choose from {', '.join(capacity.shape_names())} or give a "
                      "config.json path")
  methods = _list("--methods", args.methods, list(capacity.METHODS))
  growth = _list("--growth-methods", args.growth_methods, list(capacity.METHODS)) if args.growth_methods else []
  attention = _list("--attention", args.attention, ATTENTION_KERNELS)
  if args.lora < 0:
    raise ConfigError(f"--lora must be >= 0 (0: full fine-tuning), got {args.lora}")
  for flag, value in (("--grid", args.grid), ("--max-completion", args.max_completion)):
    if value is not None and value <= 0:
      raise ConfigError(f"{flag} must be positive, got {value}")
  # the forced CPU devices of the fsdp mesh: XLA reads the flag when its backend starts, so before any computation
  if max(devices) > 1 and not runtime.configure_xla_flags(
      (f"--xla_force_host_platform_device_count={max(devices)}",)):
    raise ConfigError("JAX started before train.capacity could force its CPU devices")
  runtime.enable_compilation_cache()
  settings = capacity.Settings(grid=args.grid, max_completion=args.max_completion, lora_rank=args.lora,
                               packed=args.packed, microbatch_rows=args.microbatch_rows,
                               mlp_chunk_len=capacity.Settings.mlp_chunk_len if args.mlp_chunk_len is None
                               else args.mlp_chunk_len,
                               plan_runs=capacity.Settings.plan_runs if args.plan_runs is None else args.plan_runs)
  capacity_run.run(args.out, shapes, methods, budgets, devices, attention, growth, settings, cli.progress)
  cli.print_files(args.out, "capacity.md")


def main(argv=None):
  cli.main("The longest completion whose GRPO step fits a device, by method and attention kernel (compile-only)",
           body, argv, config=False, args=[
               cli.arg("--out", required=True, help="directory for capacity.json/.md/.png and the point cache"),
               cli.arg("--shapes", default="smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b",
                       help="configs/shapes names or config.json paths"),
               cli.arg("--methods", default="nogc,gc,sac,optimal_hr,hilore,gc_int8"),
               cli.arg("--budgets-gib", default="24,80,141", help="per-device budgets in GiB"),
               cli.arg("--devices", default="1,8", help="device counts (an fsdp mesh of forced CPU devices)"),
               cli.arg("--attention", default="xla,blockwise", help="model.attention kernels"),
               cli.arg("--growth-methods", default="gc", help="methods whose bytes are tabled at 1024/2048/4096 "
                       "tokens per row ('' for none)"),
               cli.arg("--grid", default=64, type=int, help="the search's step in completion tokens"),
               cli.arg("--max-completion", type=int, help="the search's cap in completion tokens (default: the "
                       "shape's max_position_embeddings - 256)"),
               cli.arg("--lora", default=0, type=int, help="LoRA rank: adapters on all seven projections of a "
                       "frozen base, AdamW over them, the base as the KL reference (0: full fine-tuning)"),
               cli.arg("--packed", action="store_true", help="price packed microbatches: the rows' completions end "
                       "to end in one buffer per device, each group's prompt once (train.packing)"),

               cli.arg("--microbatch-rows", type=int, help="rows per microbatch of the group's 8 (fewer: "
                       "the token budget's lever, the same step in more microbatches)"),
               cli.arg("--mlp-chunk-len", type=int, help="model.mlp_chunk_len: a recomputed MLP's backward over "
                       "chunks of this many positions (0: whole; default: the model's, 512; docs/capacity.md's grid "
                       "was measured at 0)"),
               cli.arg("--plan-runs", type=int, help="memory.plan_runs: at most this many runs of layers with one "
                       "policy in a solved method's plan (0: any; default: the trainer's, 2; docs/capacity.md's grid "
                       "was measured at 4)")])


if __name__ == "__main__":
  main()
