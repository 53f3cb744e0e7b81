"""Paired training quality: the same seeds trained under two memory methods (GC and HiLoRe by default); the
per-seed difference in held-out accuracy, its spread, and the reward curves overlaid."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from hilore_jax import metrics
from hilore_jax.config import Config


def run(cfg: Config, seeds: int, out_dir: str, methods=("gc", "hilore"), progress=print) -> dict:
  """Train every (seed, method) pair (a finished pair in out_dir is reused) and write quality.json/.md/.png."""
  from hilore_jax.trainer import Trainer

  os.makedirs(out_dir, exist_ok=True)
  runs: dict[str, dict[int, dict]] = {m: {} for m in methods}
  for s in range(seeds):
    for m in methods:
      run_dir = os.path.join(out_dir, f"{m}_seed{s}")
      done = os.path.join(run_dir, "summary.json")
      if not os.path.exists(done):
        progress(f"quality: training {m} with seed {cfg.seed + s}")
        c = dataclasses.replace(cfg, seed=cfg.seed + s, out_dir=run_dir,
                                memory=dataclasses.replace(cfg.memory, policy=m),
                                eval=dataclasses.replace(cfg.eval, at_start=True, at_end=True),
                                checkpoint=dataclasses.replace(cfg.checkpoint, export_hf=False))
        Trainer(c).train()
      with open(done) as f:
        summary = json.load(f)
      runs[m][s] = {"accuracy": summary["eval_after"]["eval/accuracy"],
                    "accuracy_before": summary["eval_before"]["eval/accuracy"],
                    "rewards": [r["reward/mean"] for r in metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))]}
  base, other = methods
  diff = np.array([runs[other][s]["accuracy"] - runs[base][s]["accuracy"] for s in range(seeds)])
  result = {"methods": list(methods), "seeds": seeds,
            "per_seed": [{"seed": cfg.seed + s, **{m: runs[m][s]["accuracy"] for m in methods},
                          "before": runs[base][s]["accuracy_before"]} for s in range(seeds)],
            "paired_diff_pp": {"mean": 100 * float(diff.mean()), "std": 100 * float(diff.std(ddof=1)) if seeds > 1
                               else 0.0, "min": 100 * float(diff.min()), "max": 100 * float(diff.max())}}
  with open(os.path.join(out_dir, "quality.json"), "w") as f:
    json.dump(result, f, indent=2)
  d = result["paired_diff_pp"]
  md = [f"# Paired training quality: {other} vs {base}, {seeds} seeds", "",
        f"| seed | before GRPO | {base} | {other} | {other} - {base} (pp) |", "|---:|---:|---:|---:|---:|"]
  md += [f"| {r['seed']} | {100 * r['before']:.1f}% | {100 * r[base]:.1f}% | {100 * r[other]:.1f}% | "
         f"{100 * (r[other] - r[base]):+.1f} |" for r in result["per_seed"]]
  md += ["", f"Paired difference: mean {d['mean']:+.2f} pp, std {d['std']:.2f} pp, range [{d['min']:+.1f}, "
         f"{d['max']:+.1f}] pp (greedy accuracy on the held-out set)."]
  with open(os.path.join(out_dir, "quality.md"), "w") as f:
    f.write("\n".join(md) + "\n")
  _plot(runs, os.path.join(out_dir, "quality.png"))
  return result


def _plot(runs: dict, path: str):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  for i, (m, by_seed) in enumerate(runs.items()):
    curves = np.array([r["rewards"] for r in by_seed.values()])
    steps = np.arange(1, curves.shape[1] + 1)
    ax.plot(steps, curves.mean(0), color=f"C{i}", label=f"{m} (mean of {len(curves)} seeds)")
    ax.fill_between(steps, curves.min(0), curves.max(0), color=f"C{i}", alpha=0.2)
  ax.set_xlabel("GRPO step")
  ax.set_ylabel("mean reward")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
