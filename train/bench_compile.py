"""python -m train.bench_compile --config configs/bench_cpu.yaml [--layers 4,8,16,32] [--plans gc,hilore_mixed]
[key.path=value ...]"""

import argparse
import logging

from hilore_jax import cli


def main(argv=None):
  ap = argparse.ArgumentParser(description="Compile seconds of the train step against depth, per remat plan")
  ap.add_argument("--config", help="YAML config file (model, grpo and bench sections; depth is set here)")
  ap.add_argument("--layers", default="4,8,16,32", help="comma-separated depths to compile at")
  ap.add_argument("--plans", default="gc,hilore_mixed", help="comma-separated: gc, hilore_mixed, per_layer")
  ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. bench.seq_len=128")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.WARNING)

  def body():
    from hilore_jax.bench import compile_time
    from hilore_jax.errors import ConfigError

    try:
      layers = [int(x) for x in args.layers.split(",")]
    except ValueError:
      raise ConfigError(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    plans = args.plans.split(",")
    bad = sorted(set(plans) - set(compile_time.plans(1)))
    if bad:
      raise ConfigError(f"unknown --plans {bad}; choose from {sorted(compile_time.plans(1))}")
    cfg = cli.load_config(args.config, args.overrides)
    print(compile_time.table(compile_time.measure(cfg, layers, plans)))

  cli.run(body)


if __name__ == "__main__":
  main()
