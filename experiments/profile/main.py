"""python -m experiments.profile.main --config configs/bench_binding.yaml --out DIR [--results BENCH_DIR] [--reps N]"""

import json
import os

from hilore_jax import cli, runtime


def body(args):
  from experiments.common import config
  from experiments.profile import run as plan_profile

  cfg, bc = config.load(args.config, args.overrides, "bench")
  runtime.enable_compilation_cache()
  results = None
  if args.results:
    with open(os.path.join(args.results, "results.json")) as f:
      results = json.load(f)
  plan_profile.run_profile(cfg, bc, args.out, args.reps, results, args.keep_xplane, progress=cli.progress)
  cli.print_files(args.out, "profile.md")


def main(argv=None):
  cli.main("Per-op and per-category time of every memory plan's actor update (jax.profiler traces), beside XLA's "
           "counts and the cost model's prediction", body, argv,
           args=[cli.arg("--out", required=True, help="directory for profile.json, profile.md and traces/"),
                 cli.arg("--results", help="an experiments.bench.main output directory: its plans (when its rows carry "
                                           "them) and its measured order"),
                 cli.arg("--reps", type=int, default=5, help="traced steps and untraced rounds per plan"),
                 cli.arg("--keep-xplane", action="store_true", help="keep each trace's xplane.pb (TensorBoard)")])


if __name__ == "__main__":
  main()
