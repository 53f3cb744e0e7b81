"""python -m experiments.optim.main --config configs/bench_cpu.yaml --out DIR [--ranks 16,32,64]
    [key.path=value ...]"""

from hilore_jax import cli


def body(args):
  from experiments.common import config
  from experiments.optim import run as optim_memory
  from hilore_jax.errors import ConfigError

  ranks = tuple(cli.int_list("--ranks", args.ranks)) if args.ranks else ()
  memories = tuple(m for m in args.memory.split(",") if m)
  if not memories or set(memories) - {"gc", "hilore"}:
    raise ConfigError(f"--memory must list gc and/or hilore, got {args.memory!r}")
  cfg, bc = config.load(args.config, args.overrides, "bench")
  result = optim_memory.run(cfg, bc, args.out, ranks, memories, progress=cli.progress)
  print(optim_memory.report(result))


def main(argv=None):
  cli.main("Optimizer-state, gradient and step bytes: AdamW vs LoGRA, GC vs HiLoRe", body, argv,
           args=[cli.arg("--out", required=True, help="directory for optim.json and optim.md"),
                 cli.arg("--ranks", default="", help="LoGRA ranks, comma-separated (default: hidden/16, /8, /4)"),
                 cli.arg("--memory", default="gc,hilore", help="memory policies to compile under (gc, hilore)")])


if __name__ == "__main__":
  main()
