"""python -m experiments.kl.main RUN_DIR [--out DIR]: predicted vs realised KL of a run trained with kl_control."""

import json

from hilore_jax import cli


def body(args):
  from experiments.kl import run as kl

  print(json.dumps(kl.run(args.run_dir, args.out), indent=2))


def main(argv=None):
  cli.main("Spearman and scatter of predicted vs realised per-update KL", body, argv, config=False,
           args=[cli.arg("run_dir", help="a training run's out_dir (its metrics.jsonl)"),
                 cli.arg("--out", help="directory for kl_report.json and kl_scatter.png (default: run_dir)")])


if __name__ == "__main__":
  main()
