"""python -m train.grpo --config configs/tiny.yaml [key.path=value ...]"""

import argparse
import json
import logging
import os
import sys

from hilore_jax import config as config_lib


def main(argv=None):
  ap = argparse.ArgumentParser(description="GRPO training with hilore-jax")
  ap.add_argument("--config", help="YAML config file")
  ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 out_dir=/tmp/run")
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "orbax", "matplotlib"):  # orbax logs every save step at INFO through absl
    logging.getLogger(noisy).setLevel(logging.WARNING)
  try:
    cfg = config_lib.load_config(args.config, args.overrides)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"config error: {e}")
  from hilore_jax import allocator, buckets, model, tokenizer
  from hilore_jax.trainer import Trainer, TrainingDiverged

  # compiled steps survive restarts (one per allocation bucket under memory.policy=hilore)
  buckets.enable_persistent_compilation_cache(os.path.join(tokenizer.cache_root(), "xla"))

  try:
    summary = Trainer(cfg).train()
  except TrainingDiverged as e:
    sys.exit(f"training stopped: {e}")
  except FileExistsError as e:
    sys.exit(f"refusing to start: {e}")
  except (allocator.InfeasibleBudget, model.OffloadUnsupported) as e:
    sys.exit(f"memory error: {e}")
  print(json.dumps({k: v for k, v in summary.items() if k != "compile_log"}, indent=2))


if __name__ == "__main__":
  main()
