"""python -m experiments.compile_time.main --config configs/bench_cpu.yaml [--layers 4,8,16,32]
[--plans gc,hilore_mixed] [key.path=value ...]

python -m experiments.compile_time.main --shape smollm2-135m --layers 8,16,30,36 --completion 1792 --attention blockwise
[--method hilore --ratio 1.1] [--unrolled] --out DIR: the memory manager's plan at each depth, its gradient
program's compile seconds and the compiling process's peak RSS (a fresh process per program), compile-only; rows kept
in DIR/depth.json (a rerun measures only what is missing), the table printed and written to DIR/depth.md.
With --runs 0,1,2,4: instead, the plan at each memory.plan_runs value (0: any), its predicted seconds and compiled
peak at one byte allowance (DIR/plan_runs.json): what the plan shape costs."""

import os

from hilore_jax import cli


def body(args):
  from experiments.compile_time import run as compile_time
  from experiments.common import config
  from hilore_jax.errors import ConfigError

  layers = cli.int_list("--layers", args.layers)
  if args.shape:
    from hilore_jax.capacity import measure as capacity

    if args.shape not in capacity.shape_names() and not (args.shape.endswith(".json") and os.path.exists(args.shape)):
      raise ConfigError(f"unknown --shape {args.shape!r}; choose from {', '.join(capacity.shape_names())} or give a "
                        "config.json path")
    if not args.out:
      raise ConfigError("--shape needs --out DIR (its rows are kept there)")
    os.makedirs(args.out, exist_ok=True)
    if args.runs:
      import json

      runs = cli.int_list("--runs", args.runs)
      rows = [{"layers": d, **r} for d in layers
              for r in compile_time.constraint_cost(args.shape, d, args.completion, args.attention, args.method,
                                                    args.ratio, runs)]
      with open(os.path.join(args.out, "plan_runs.json"), "w") as f:
        json.dump(rows, f, indent=1)
      print(compile_time.cost_table(rows))
      return
    rows = compile_time.depth_rows(os.path.join(args.out, "depth.json"), args.shape, layers, args.completion,
                                   args.attention, args.method, args.ratio, args.unrolled, cli.progress,
                                   args.repeats)
    table = compile_time.depth_table(rows)
    with open(os.path.join(args.out, "depth.md"), "w") as f:
      f.write(table + "\n")
    print(table)
    return
  plans = args.plans.split(",")
  bad = sorted(set(plans) - set(compile_time.plans(1)))
  if bad:
    raise ConfigError(f"unknown --plans {bad}; choose from {sorted(compile_time.plans(1))}")
  cfg, bc = config.load(args.config, args.overrides, "bench")
  print(compile_time.table(compile_time.measure(cfg, bc, layers, plans)))


def main(argv=None):
  cli.main("Compile seconds of the train step against depth, per remat plan", body, argv,
           args=[cli.arg("--layers", default="4,8,16,32", help="comma-separated depths to compile at"),
                 cli.arg("--plans", default="gc,hilore_mixed", help="comma-separated: gc, hilore_mixed, per_layer"),
                 cli.arg("--shape", help="a configs/shapes model: the manager's plan at each depth, compile-only"),
                 cli.arg("--completion", type=int, default=1792, help="--shape: completion tokens per row"),
                 cli.arg("--attention", default="blockwise", help="--shape: model.attention"),
                 cli.arg("--method", default="hilore", help="--shape: a capacity method (its plan is measured)"),
                 cli.arg("--ratio", type=float, default=1.1, help="--shape: its budget, x GC's compiled peak"),
                 cli.arg("--unrolled", action="store_true", help="--shape: also every layer a plain call"),
                 cli.arg("--repeats", type=int, default=1, help="--shape: compiles per program, fresh processes "
                         "(the least seconds is kept)"),
                 cli.arg("--runs", help="--shape: memory.plan_runs values (0: any): the plan's predicted seconds "
                         "and compiled peak at each, at one allowance (plan_runs.json), instead of the depth table"),
                 cli.arg("--out", help="--shape: directory for depth.json and depth.md")])


if __name__ == "__main__":
  main()
