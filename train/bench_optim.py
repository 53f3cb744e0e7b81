"""python -m train.bench_optim --config configs/bench_cpu.yaml --out DIR [--ranks 16,32,64] [key.path=value ...]"""

import argparse
import logging

from hilore_jax import cli


def main(argv=None):
  ap = argparse.ArgumentParser(description="Optimizer-state, gradient and step bytes: AdamW vs LoGRA, GC vs HiLoRe")
  ap.add_argument("--config", help="YAML config file (model, grpo, memory, optimizer and bench sections)")
  ap.add_argument("--out", required=True, help="directory for optim.json and optim.md")
  ap.add_argument("--ranks", default="", help="LoGRA ranks, comma-separated (default: hidden/16, /8, /4)")
  ap.add_argument("--memory", default="gc,hilore", help="memory policies to compile under (gc, hilore)")
  ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.logra.refresh_every=100")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)

  def body():
    from hilore_jax.bench import optim_memory
    from hilore_jax.errors import ConfigError

    try:
      ranks = tuple(int(r) for r in args.ranks.split(",") if r)
    except ValueError:
      raise ConfigError(f"--ranks must be comma-separated integers, got {args.ranks!r}") from None
    memories = tuple(m for m in args.memory.split(",") if m)
    if not memories or set(memories) - {"gc", "hilore"}:
      raise ConfigError(f"--memory must list gc and/or hilore, got {args.memory!r}")
    cfg = cli.load_config(args.config, args.overrides)
    result = optim_memory.run(cfg, args.out, ranks, memories, progress=lambda s: print(s, flush=True))
    print(optim_memory.report(result))

  cli.run(body)


if __name__ == "__main__":
  main()
