"""python -m experiments.bench_compile --config configs/bench_cpu.yaml [--layers 4,8,16,32] [--plans gc,hilore_mixed]
[key.path=value ...]"""

from hilore_jax import cli


def body(args):
  from experiments import compile_time, config

  layers = cli.int_list("--layers", args.layers)
  plans = args.plans.split(",")
  bad = sorted(set(plans) - set(compile_time.plans(1)))
  if bad:
    from hilore_jax.errors import ConfigError

    raise ConfigError(f"unknown --plans {bad}; choose from {sorted(compile_time.plans(1))}")
  cfg, bc = config.load(args.config, args.overrides, "bench")
  print(compile_time.table(compile_time.measure(cfg, bc, layers, plans)))


def main(argv=None):
  cli.main("Compile seconds of the train step against depth, per remat plan", body, argv,
           args=[cli.arg("--layers", default="4,8,16,32", help="comma-separated depths to compile at"),
                 cli.arg("--plans", default="gc,hilore_mixed", help="comma-separated: gc, hilore_mixed, per_layer")])


if __name__ == "__main__":
  main()
