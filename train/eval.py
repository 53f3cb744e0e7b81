"""python -m train.eval --config configs/tiny.yaml --checkpoint RUN_DIR_OR_HF_DIR [key.path=value ...]"""

import argparse
import json
import logging

from hilore_jax import cli
from hilore_jax.errors import ConfigError


def main(argv=None):
  ap = argparse.ArgumentParser(description="greedy accuracy and pass@k of a saved policy")
  ap.add_argument("--config", help="YAML config file (task, rollout lengths, eval settings)")
  ap.add_argument("--checkpoint", help="a run directory, its checkpoints/ folder, or an HF export directory")
  ap.add_argument("overrides", nargs="*", help="dotted overrides; checkpoint=... also works")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)
  overrides = [o for o in args.overrides if not o.startswith("checkpoint=")]
  checkpoint = args.checkpoint or next((o.split("=", 1)[1] for o in args.overrides if o.startswith("checkpoint=")),
                                       None)

  def body():
    if not checkpoint:
      raise ConfigError("give --checkpoint DIR (or checkpoint=DIR)")
    cfg = cli.load_config(args.config, overrides)
    from hilore_jax.evaluation import evaluate_checkpoint

    print(json.dumps(evaluate_checkpoint(cfg, checkpoint), indent=2))

  cli.run(body)


if __name__ == "__main__":
  main()
