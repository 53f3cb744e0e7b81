"""Uncertainty, one leaf module for the trainer and the lab: bootstrap CIs of means and paired ratios, Wilson CIs."""

from __future__ import annotations

import numpy as np


def bootstrap_ci(x, level: float = 0.95, n: int = 10_000, seed: int = 0) -> tuple[float, float]:
  """Percentile bootstrap CI of the mean of x (nan, nan for fewer than 2 values)."""
  x = np.asarray(x, float)
  if len(x) < 2:
    return float("nan"), float("nan")
  rng = np.random.default_rng(seed)
  means = x[rng.integers(0, len(x), (n, len(x)))].mean(axis=1)
  tail = (1 - level) / 2
  return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def paired_gain_pct(times_s, base_times_s) -> np.ndarray:
  """Per-rep throughput gain over the base, in percent: base_time / time - 1, paired within each rep."""
  t, b = np.asarray(times_s, float), np.asarray(base_times_s, float)
  return 100 * (b / t - 1)


def summary(x, level: float = 0.95) -> dict[str, float]:
  """mean, std, and the bootstrap CI of the mean."""
  x = np.asarray(x, float)
  lo, hi = bootstrap_ci(x, level)
  return {"mean": float(x.mean()) if len(x) else float("nan"), "std": float(x.std(ddof=1)) if len(x) > 1 else 0.0,
          "ci_low": lo, "ci_high": hi, "n": int(len(x))}


def noise_floor(control_gains_pct, seed: int = 0) -> dict[str, float]:
  """The noise floor from a control (a second compilation of the base's program): its mean paired gain, CI, |gain|,
  and `bound`, the CI's far edge in absolute value: which of the two copies is the base is arbitrary, so a control
  at -3 [-5, -1] says a copy may as well measure +5."""
  g = np.asarray(control_gains_pct, float)
  lo, hi = bootstrap_ci(g, seed=seed)
  mean = float(g.mean()) if len(g) else float("nan")
  return {"gain": mean, "ci_low": lo, "ci_high": hi, "abs": abs(mean), "bound": max(hi, -lo)}


def same_program_floor(groups: dict[str, list[tuple[str, list[float]]]], seed: int = 0) -> dict:
  """The spread of rows that run one executable: for every pair within a group (label, per-round gains), the far
  edge of their paired difference's CI; `bound` is the largest (nan without a pair). Rows timing the same program
  differ only by noise the per-row CI may not cover (drift the rounds share unevenly)."""
  worst = {"pairs": 0, "bound": float("nan"), "worst_pair": None, "diff": None, "ci": None}
  for rows in groups.values():
    for i, (a, ga) in enumerate(rows):
      for b, gb in rows[i + 1:]:
        d = np.asarray(ga, float) - np.asarray(gb, float)
        lo, hi = bootstrap_ci(d, seed=seed)
        worst["pairs"] += 1
        if not np.isnan(lo) and not max(hi, -lo) <= worst["bound"]:
          worst.update(bound=max(hi, -lo), worst_pair=[a, b], diff=float(d.mean()), ci=[lo, hi])
  return worst


def with_same_program(floor: dict, same: dict) -> dict:
  """The run's floor: the control's, raised to the same-program spread where that is larger."""
  bound = max(floor["bound"], same["bound"]) if not np.isnan(same["bound"]) else floor["bound"]
  return {**floor, "control_bound": floor["bound"], "same_program": same, "bound": bound}


def run_floor(control_gains_pct, rows, seed: int = 0) -> dict:
  """A run's floor from its control's gains and rows (label, program key, gains): rows sharing a key are grouped."""
  groups: dict = {}
  for label, key, gains in rows:
    groups.setdefault(key, []).append((label, gains))
  return with_same_program(noise_floor(control_gains_pct, seed), same_program_floor(groups, seed))


def beats_floor(ci_low: float | None, floor: dict | None) -> bool:
  """A win the control cannot explain: the gain's CI low above the floor's bound (the control's CI high, mirrored)."""
  return bool(floor is not None and ci_low is not None and not np.isnan(floor["bound"]) and ci_low > floor["bound"])


def wilson_ci(successes: int, n: int, z: float = 1.96) -> list[float]:
  """[lo, hi] Wilson score interval of a proportion (exact at 0 and n, unlike the normal one)."""
  p, z2 = successes / n, z * z
  centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
  return [max(0.0, float(centre - half)), min(1.0, float(centre + half))]
