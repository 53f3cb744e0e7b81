"""python -m experiments.quality.main --config configs/tiny.yaml --seeds 5 [--arm name:key=value,...]... [--out DIR]"""

import json

from hilore_jax import cli


def body(args):
  from experiments.quality import run as quality
  from hilore_jax.errors import ConfigError

  if args.seeds < 1:
    raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
  arms = tuple(quality.Arm.parse(a) for a in args.arm) or quality.DEFAULT_ARMS
  cfg = cli.load_config(args.config, args.overrides)
  result = quality.run(cfg, args.seeds, args.out, arms, progress=cli.progress)
  cli.print_files(args.out, "quality.md")
  print(json.dumps(result["paired"]))


def main(argv=None):
  cli.main("Train several arms from the same seeds; paired quality differences", body, argv,
           args=[cli.arg("--out", default="runs/bench_quality", help="runs and quality.json/.md/.png"),
                 cli.arg("--seeds", type=int, default=5, help="paired seeds (each arm trains once per seed)"),
                 cli.arg("--arm", action="append", default=[],
                         help="name:key=value,key=value; the first arm is the base (default: gc and hilore)")])


if __name__ == "__main__":
  main()
