"""python -m train.kl_report RUN_DIR [--out DIR]: predicted vs realised KL of a run trained with kl_control."""

import argparse
import json
import logging

from hilore_jax import cli


def main(argv=None):
  ap = argparse.ArgumentParser(description="Spearman and scatter of predicted vs realised per-update KL")
  ap.add_argument("run_dir", help="a training run's out_dir (its metrics.jsonl)")
  ap.add_argument("--out", help="directory for kl_report.json and kl_scatter.png (default: run_dir)")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)

  def body():
    from hilore_jax.bench import kl_report

    print(json.dumps(kl_report.run(args.run_dir, args.out), indent=2))

  cli.run(body)


if __name__ == "__main__":
  main()
