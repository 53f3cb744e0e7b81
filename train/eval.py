"""python -m train.eval --config configs/tiny.yaml --checkpoint RUN_DIR_OR_HF_DIR [key.path=value ...]"""

import json

from hilore_jax import cli
from hilore_jax.errors import ConfigError


def body(args):
  overrides = [o for o in args.overrides if not o.startswith("checkpoint=")]
  checkpoint = args.checkpoint or next((o.split("=", 1)[1] for o in args.overrides if o.startswith("checkpoint=")),
                                       None)
  if not checkpoint:
    raise ConfigError("give --checkpoint DIR (or checkpoint=DIR)")
  cfg = cli.load_config(args.config, overrides)
  from hilore_jax.loop.evaluation import evaluate_checkpoint

  print(json.dumps(evaluate_checkpoint(cfg, checkpoint), indent=2))


def main(argv=None):
  cli.main("greedy accuracy and pass@k of a saved policy", body, argv,
           args=[cli.arg("--checkpoint", help="a run directory, its checkpoints/ folder, or an HF export directory")])


if __name__ == "__main__":
  main()
