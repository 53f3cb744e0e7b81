"""python -m experiments.clip.main --config configs/bench_clip.yaml [--out DIR] [key.path=value ...]"""

import json
import os

from hilore_jax import cli


def body(args):
  from experiments.clip import run as clip
  from experiments.common import config

  cfg, bc = config.load(args.config, args.overrides, "bench")
  rows = clip.clip_rows(cfg, bc, progress=cli.progress)
  table = clip.clip_table(rows)
  print(table)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "clip.json"), "w") as f:
      json.dump(rows, f, indent=2)
    with open(os.path.join(args.out, "clip.md"), "w") as f:
      f.write(table + "\n")


def main(argv=None):
  cli.main("Compiled step memory with and without gradient clipping", body, argv,
           args=[cli.arg("--out", help="optional directory for clip.json and clip.md")])


if __name__ == "__main__":
  main()
