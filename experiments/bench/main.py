"""python -m experiments.bench.main --config configs/bench_cpu.yaml --out DIR [key.path=value ...]"""

from hilore_jax import cli, runtime


def body(args):
  from experiments.common import config
  from experiments.bench import run

  cfg, bc = config.load(args.config, args.overrides, "bench")
  runtime.enable_compilation_cache()  # a rerun (or scripts/gpu_check.sh in a later window) reuses every compile
  result = run.run(cfg, bc, args.out, progress=cli.progress)
  cli.print_files(args.out, "results.md", *(["risk.md"] if result["risk"] else []))


def main(argv=None):
  cli.main("Compare memory methods on the GRPO actor update", body, argv,
           args=[cli.arg("--out", required=True, help="directory for results.json, results.md, frontier.png, risk.md")])


if __name__ == "__main__":
  main()
