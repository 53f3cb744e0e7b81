"""python -m experiments.bench.roofline --config configs/roofline_smollm2.yaml --out DIR [key.path=value ...]

A roofline projection of one H200's step time per plan (hilore_jax/capacity/roofline.py), compile-only: no step runs.
Plans: none, gc and each uncalibrated method of bench.methods at bench.budget_ratios, fitted to the budget on the
compiled step with the cost model's op times projected for the H200. Calibrated methods (hilore, hilore_static, ...)
need measured gradients: `python -m experiments.bench.main ... bench.roofline=true` projects their plans beside the
measurement.
"""

import json
import os

from hilore_jax import cli, runtime


def body(args):
  from hilore_jax.loop import engine
  from experiments.common import config
  from experiments.bench import report
  from hilore_jax.capacity import projection
  from hilore_jax.memory import methods

  cfg, bc = config.load(args.config, args.overrides, "bench")
  runtime.enable_compilation_cache()
  mcfg = engine.model_config(cfg)
  completion = bc.seq_len - bc.prompt_len
  chosen = [m for m in bc.methods if m not in methods.CALIBRATED]
  skipped = [m for m in bc.methods if m in methods.CALIBRATED]
  if skipped:
    print(f"roofline: skipping calibrated methods {skipped} (their plans need gradients: experiments.bench.main "
          "bench.roofline=true)", flush=True)
  plans = projection.planned(cfg, mcfg, bc.batch_size, bc.prompt_len, completion, chosen, bc.budget_ratios)
  rows = projection.project_plans(cfg, mcfg, bc.batch_size, bc.prompt_len, completion, plans,
                                  progress=cli.progress)
  os.makedirs(args.out, exist_ok=True)
  device = projection.device_info()
  with open(os.path.join(args.out, "roofline.json"), "w") as f:
    json.dump({"projection": device, "model": cfg.to_dict()["model"], "batch": [bc.batch_size, bc.seq_len],
               "rows": rows}, f, indent=2)
  text = "\n".join(report.projection_lines(rows, device))
  with open(os.path.join(args.out, "roofline.md"), "w") as f:
    f.write(text + "\n")
  print(text)


def main(argv=None):
  cli.main("Roofline projection of the step time per memory plan on one H200 (compile-only)", body, argv,
           args=[cli.arg("--out", required=True, help="directory for roofline.json and roofline.md")])


if __name__ == "__main__":
  main()
