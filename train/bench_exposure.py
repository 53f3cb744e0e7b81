"""python -m train.bench_exposure --config configs/bench_exposure.yaml --out DIR [key=value ...]"""

import argparse
import logging
import os

from hilore_jax import cli


def main(argv=None):
  ap = argparse.ArgumentParser(description="Run-time exposure on real rollouts: risk prediction and the ablation")
  ap.add_argument("--config", help="YAML config file")
  ap.add_argument("--out", default="runs/bench_exposure", help="directory for exposure.json/.md/.png")
  ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. bench_exposure.reps=3")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)

  def body():
    from hilore_jax.bench import exposure

    cfg = cli.load_config(args.config, args.overrides)
    exposure.run(cfg, args.out, progress=lambda s: print(s, flush=True))
    with open(os.path.join(args.out, "exposure.md")) as f:
      print(f.read())

  cli.run(body)


if __name__ == "__main__":
  main()
