"""python -m train.bench_quality --config configs/tiny_hilore.yaml seeds=3 [--out DIR] [key.path=value ...]"""

import argparse
import json
import logging
import sys

from hilore_jax import config as config_lib


def main(argv=None):
  ap = argparse.ArgumentParser(description="Train GC and HiLoRe from the same seeds; paired accuracy difference")
  ap.add_argument("--config", help="YAML config file")
  ap.add_argument("--out", default="runs/bench_quality", help="directory for the runs and quality.json/.md/.png")
  ap.add_argument("overrides", nargs="*", help="seeds=N and dotted overrides, e.g. train.steps=20")
  args = ap.parse_args(argv)
  seeds = 3
  overrides = []
  for o in args.overrides:
    if o.startswith("seeds="):
      try:
        seeds = int(o.split("=", 1)[1])
      except ValueError:
        sys.exit(f"config error: seeds must be an integer, got {o!r}")
      if seeds < 1:
        sys.exit(f"config error: seeds must be >= 1, got {seeds}")
    else:
      overrides.append(o)
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  try:
    cfg = config_lib.load_config(args.config, overrides)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"config error: {e}")
  from hilore_jax import quality

  result = quality.run(cfg, seeds, args.out, progress=lambda s: print(s, flush=True))
  with open(f"{args.out}/quality.md") as f:
    print(f.read())
  print(json.dumps(result["paired_diff_pp"]))


if __name__ == "__main__":
  main()
