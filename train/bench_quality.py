"""python -m train.bench_quality --config configs/tiny_hilore.yaml seeds=3 [--out DIR] [key.path=value ...]"""

import argparse
import json
import logging
import os

from hilore_jax import cli
from hilore_jax.errors import ConfigError


def main(argv=None):
  ap = argparse.ArgumentParser(description="Train GC and HiLoRe from the same seeds; paired accuracy difference")
  ap.add_argument("--config", help="YAML config file")
  ap.add_argument("--out", default="runs/bench_quality", help="directory for the runs and quality.json/.md/.png")
  ap.add_argument("overrides", nargs="*", help="seeds=N and dotted overrides, e.g. train.steps=20")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)

  def body():
    seeds, overrides = 3, []
    for o in args.overrides:
      if o.startswith("seeds="):
        try:
          seeds = int(o.split("=", 1)[1])
        except ValueError:
          raise ConfigError(f"seeds must be an integer, got {o!r}") from None
        if seeds < 1:
          raise ConfigError(f"seeds must be >= 1, got {seeds}")
      else:
        overrides.append(o)
    cfg = cli.load_config(args.config, overrides)
    from hilore_jax.bench import quality

    result = quality.run(cfg, seeds, args.out, progress=lambda s: print(s, flush=True))
    with open(os.path.join(args.out, "quality.md")) as f:
      print(f.read())
    print(json.dumps(result["paired_diff_pp"]))

  cli.run(body)


if __name__ == "__main__":
  main()
