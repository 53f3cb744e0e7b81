"""python -m experiments.real_model.main --config configs/smollm2-135m-arith.yaml --out DIR [key.path=value ...]"""

from hilore_jax import cli, runtime


def body(args):
  from experiments.common import config
  from experiments.real_model import run as real_model

  cfg, br = config.load(args.config, args.overrides, "bench_real")
  _, sweep = config.load(args.config, args.overrides, "bench")  # the budgets every study sweeps: bench.budget_ratios
  runtime.enable_compilation_cache()
  real_model.run(cfg, br, args.out, sweep.budget_ratios, progress=cli.progress)
  cli.print_files(args.out, "real_model.md")


def main(argv=None):
  cli.main("A pretrained model's memory table, L error per unit kind and the manager's set-up cost", body, argv,
           args=[cli.arg("--out", default="runs/bench_real", help="directory for real_model.json and .md")])


if __name__ == "__main__":
  main()
