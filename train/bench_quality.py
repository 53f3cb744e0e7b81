"""python -m train.bench_quality --config configs/tiny.yaml --seeds 5 [--arm name:key=value,...]... [--out DIR]"""

import argparse
import json
import logging
import os

from hilore_jax import cli


def main(argv=None):
  ap = argparse.ArgumentParser(description="Train several arms from the same seeds; paired quality differences")
  ap.add_argument("--config", help="YAML config file")
  ap.add_argument("--out", default="runs/bench_quality", help="directory for the runs and quality.json/.md/.png")
  ap.add_argument("--seeds", type=int, default=5, help="paired seeds (each arm trains once per seed)")
  ap.add_argument("--arm", action="append", default=[],
                  help="name:key=value,key=value; the first arm is the base (default: gc and hilore)")
  ap.add_argument("overrides", nargs="*", help="dotted overrides for every arm, e.g. train.steps=300")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)

  def body():
    from hilore_jax.bench import quality
    from hilore_jax.errors import ConfigError

    if args.seeds < 1:
      raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    arms = tuple(quality.Arm.parse(a) for a in args.arm) or quality.DEFAULT_ARMS
    cfg = cli.load_config(args.config, args.overrides)
    result = quality.run(cfg, args.seeds, args.out, arms, progress=lambda s: print(s, flush=True))
    with open(os.path.join(args.out, "quality.md")) as f:
      print(f.read())
    print(json.dumps(result["paired"]))

  cli.run(body)


if __name__ == "__main__":
  main()
