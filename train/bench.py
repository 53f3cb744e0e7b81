"""python -m train.bench --config configs/bench_cpu.yaml --out DIR [key.path=value ...]"""

import argparse
import logging
import sys

from hilore_jax import config as config_lib


def main(argv=None):
  ap = argparse.ArgumentParser(description="Compare memory methods on the GRPO actor update")
  ap.add_argument("--config", help="YAML config file (model, grpo, memory and bench sections)")
  ap.add_argument("--out", required=True, help="directory for results.json, results.md, frontier.png, risk.md")
  ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. bench.seq_len=128 model.hidden_size=96")
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  try:
    cfg = config_lib.load_config(args.config, args.overrides)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"config error: {e}")
  from hilore_jax import allocator, bench, model

  try:
    result = bench.run(cfg, args.out, progress=lambda s: print(s, flush=True))
  except (allocator.InfeasibleBudget, model.OffloadUnsupported) as e:
    sys.exit(f"memory error: {e}")
  with open(f"{args.out}/results.md") as f:
    print(f.read())
  if result["risk"]:
    with open(f"{args.out}/risk.md") as f:
      print(f.read())


if __name__ == "__main__":
  main()
