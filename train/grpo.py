"""python -m train.grpo --config configs/tiny.yaml [key.path=value ...]"""

import argparse
import json

from hilore_jax import cli, runtime


def main(argv=None):
  ap = argparse.ArgumentParser(description="GRPO training with hilore-jax")
  ap.add_argument("--config", help="YAML config file")
  ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 out_dir=/tmp/run")
  args = ap.parse_args(argv)
  cli.setup_logging()

  def body():
    cfg = cli.load_config(args.config, args.overrides)
    from hilore_jax.trainer import Trainer

    runtime.enable_compilation_cache()  # compiled steps survive restarts (one per allocation bucket)
    summary = Trainer(cfg).train()
    print(json.dumps({k: v for k, v in summary.items() if k != "compile_log"}, indent=2))

  cli.run(body)


if __name__ == "__main__":
  main()
