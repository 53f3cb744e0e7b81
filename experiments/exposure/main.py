"""python -m experiments.exposure.main --config configs/bench_exposure.yaml --out DIR [key=value ...]
(with bench_exposure.e1b.json set, issue 47's E1b runs instead: experiments/exposure/e1b.py)"""

from hilore_jax import cli


def body(args):
  from experiments.common import config

  cfg, be = config.load(args.config, args.overrides, "bench_exposure")
  if be.e1b.json:
    from experiments.exposure import e1b as exposure_e1b

    exposure_e1b.run(cfg, be, args.out, progress=cli.progress)
    cli.print_files(args.out, "e1b.md")
    return
  from experiments.exposure import run as exposure

  exposure.run(cfg, be, args.out, progress=cli.progress)
  cli.print_files(args.out, "exposure.md")


def main(argv=None):
  cli.main("Run-time exposure on real rollouts: risk prediction and the ablation", body, argv,
           args=[cli.arg("--out", default="runs/bench_exposure", help="directory for exposure.json/.md/.png")])


if __name__ == "__main__":
  main()
