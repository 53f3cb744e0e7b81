"""python -m train.bench_clip --config configs/bench_clip.yaml [--out DIR] [key.path=value ...]"""

import argparse
import json
import logging
import os

from hilore_jax import cli


def main(argv=None):
  ap = argparse.ArgumentParser(description="Compiled step memory with and without gradient clipping")
  ap.add_argument("--config", help="YAML config file (model, optimizer, grpo and bench sections)")
  ap.add_argument("--out", help="optional directory for clip.json and clip.md")
  ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_hidden_layers=4")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)

  def body():
    cfg = cli.load_config(args.config, args.overrides)
    from hilore_jax.bench import clip

    rows = clip.clip_rows(cfg, progress=lambda s: print(s, flush=True))
    table = clip.clip_table(rows)
    print(table)
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, "clip.json"), "w") as f:
        json.dump(rows, f, indent=2)
      with open(os.path.join(args.out, "clip.md"), "w") as f:
        f.write(table + "\n")

  cli.run(body)


if __name__ == "__main__":
  main()
