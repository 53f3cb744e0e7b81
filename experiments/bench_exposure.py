"""python -m experiments.bench_exposure --config configs/bench_exposure.yaml --out DIR [key=value ...]"""

from hilore_jax import cli


def body(args):
  from experiments import config, exposure

  cfg, be = config.load(args.config, args.overrides, "bench_exposure")
  exposure.run(cfg, be, args.out, progress=cli.progress)
  cli.print_files(args.out, "exposure.md")


def main(argv=None):
  cli.main("Run-time exposure on real rollouts: risk prediction and the ablation", body, argv,
           args=[cli.arg("--out", default="runs/bench_exposure", help="directory for exposure.json/.md/.png")])


if __name__ == "__main__":
  main()
