"""python -m train.eval --config configs/tiny.yaml --checkpoint RUN_DIR_OR_HF_DIR [key.path=value ...]"""

import argparse
import json
import logging
import sys

from hilore_jax import config as config_lib


def main(argv=None):
  ap = argparse.ArgumentParser(description="greedy accuracy and pass@k of a saved policy")
  ap.add_argument("--config", help="YAML config file (task, rollout lengths, eval settings)")
  ap.add_argument("--checkpoint", help="a run directory, its checkpoints/ folder, or an HF export directory")
  ap.add_argument("overrides", nargs="*", help="dotted overrides; checkpoint=... also works")
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.WARNING)
  overrides = [o for o in args.overrides if not o.startswith("checkpoint=")]
  checkpoint = args.checkpoint or next((o.split("=", 1)[1] for o in args.overrides if o.startswith("checkpoint=")),
                                       None)
  if not checkpoint:
    sys.exit("give --checkpoint DIR (or checkpoint=DIR)")
  try:
    cfg = config_lib.load_config(args.config, overrides)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"config error: {e}")
  from hilore_jax.eval_run import evaluate_checkpoint

  try:
    print(json.dumps(evaluate_checkpoint(cfg, checkpoint), indent=2))
  except FileNotFoundError as e:
    sys.exit(f"checkpoint error: {e}")


if __name__ == "__main__":
  main()
