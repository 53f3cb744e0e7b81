"""Predicted vs realised KL of a training run's updates (optimizer.kl_control): Spearman's rho and a scatter plot.

The prediction is of the proposed update and the realised KL is after the applied one (scaled by s), so the
prediction compared is s^2 * predicted: the second-order estimate is exactly quadratic in the step."""

from __future__ import annotations

import json
import os

import numpy as np

from hilore_jax.loop import metrics
from hilore_jax.errors import DataError


def pairs(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
  """(predicted KL of each applied update, its realised KL) over every update of the run, in order."""
  pred, real = [], []
  for r in rows:
    p, s, k = (r.get(f"kl_control/{n}_per_update", []) for n in ("predicted", "scale", "realized"))
    pred += [pi * si * si for pi, si in zip(p, s)]
    real += list(k)
  return np.asarray(pred, np.float64), np.asarray(real, np.float64)


def spearman(x, y) -> float:
  """Spearman's rank correlation (average ranks for ties)."""
  from scipy.stats import spearmanr

  return float(spearmanr(x, y).statistic)


def run(run_dir: str, out_dir: str | None = None) -> dict:
  """Read run_dir/metrics.jsonl; write kl_report.json and kl_scatter.png into out_dir (default run_dir)."""
  out_dir, path = out_dir or run_dir, os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise DataError(f"{path}: no such file; give a training run's out_dir")
  pred, real = pairs(metrics.read_metrics(path))
  moved = (pred > 0) | (real > 0)  # zero-lr updates (warmup's first) move nothing: no point on a log scale
  skipped = int(np.sum(~moved))
  pred, real = pred[moved], real[moved]
  if len(pred) < 3:
    raise DataError(f"{run_dir}: {len(pred)} updates with kl_control metrics; run with optimizer.kl_control.target "
                    "> 0 and at least 3 updates")
  rel = np.abs(pred / np.maximum(real, 1e-30) - 1)
  result = {"run": run_dir, "updates": int(len(pred)), "skipped_zero_updates": skipped,
            "spearman": spearman(pred, real),
            "pearson_log": float(np.corrcoef(np.log(np.maximum(pred, 1e-30)), np.log(np.maximum(real, 1e-30)))[0, 1]),
            "median_rel_err": float(np.median(rel)), "p90_rel_err": float(np.quantile(rel, 0.9)),
            "realized_median": float(np.median(real)), "realized_max": float(real.max())}
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "kl_report.json"), "w") as f:
    json.dump(result, f, indent=2)
  plot(pred, real, result, os.path.join(out_dir, "kl_scatter.png"))
  return result


def plot(pred, real, result: dict, path: str):
  with metrics.figure(path, (5, 5)) as (fig, ax):
    ax.scatter(pred, real, s=6, alpha=0.5)
    lo, hi = min(pred.min(), real.min()), max(pred.max(), real.max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted KL of the applied update (s^2 * predicted)")
    ax.set_ylabel("realised KL (same tokens, after the update)")
    ax.set_title(f"{result['updates']} updates, Spearman {result['spearman']:.3f}")
    ax.legend()
    ax.grid(alpha=0.3)
