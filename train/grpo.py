"""python -m train.grpo --config configs/tiny.yaml [key.path=value ...]"""

import json
import logging

from hilore_jax import cli, runtime


def body(args):
  cfg = cli.load_config(args.config, args.overrides)
  from hilore_jax.loop.trainer import Trainer

  runtime.enable_compilation_cache()  # compiled steps survive restarts (one per allocation bucket)
  summary = Trainer(cfg).train()
  print(json.dumps({k: v for k, v in summary.items() if k != "compile_log"}, indent=2))


def main(argv=None):
  cli.main("GRPO training with hilore-jax", body, argv, level=logging.INFO)


if __name__ == "__main__":
  main()
