"""python -m train.bench --config configs/bench_cpu.yaml --out DIR [key.path=value ...]"""

import argparse
import logging
import os

from hilore_jax import cli, runtime


def main(argv=None):
  ap = argparse.ArgumentParser(description="Compare memory methods on the GRPO actor update")
  ap.add_argument("--config", help="YAML config file (model, grpo, memory and bench sections)")
  ap.add_argument("--out", required=True, help="directory for results.json, results.md, frontier.png, risk.md")
  ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. bench.seq_len=128 model.hidden_size=96")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)

  def body():
    cfg = cli.load_config(args.config, args.overrides)
    from hilore_jax.bench import run

    runtime.enable_compilation_cache()  # a rerun (or scripts/gpu_check.sh in a later window) reuses every compile
    result = run.run(cfg, args.out, progress=lambda s: print(s, flush=True))
    for name in ("results.md", "risk.md") if result["risk"] else ("results.md",):
      with open(os.path.join(args.out, name)) as f:
        print(f.read())

  cli.run(body)


if __name__ == "__main__":
  main()
