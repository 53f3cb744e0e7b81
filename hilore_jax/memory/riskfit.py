"""Fitting the risk model to measured unit errors: random calibration sets, the coherence factor, how well set
models predict, per-unit susceptibility, and the ranking measures (Spearman, top-k recall, AUROC). Pure numpy."""

from __future__ import annotations

import numpy as np


def random_sets(n_units: int, count: int, rng: np.random.Generator) -> list[list[int]]:
  """`count` random L sets of sizes spread over 2 .. n_units (what allocations choose lies in between)."""
  sizes = np.linspace(2, n_units, count).round().astype(int)
  return [sorted(rng.choice(n_units, size=int(k), replace=False).tolist()) for k in sizes]


def fit_coherence(unit_err_KU: np.ndarray, sets, set_err_KS: np.ndarray) -> float:
  """The coherence factor: the largest measured / (sum of unit errors) over calibration sets and batches, so the
  linear risk model covers every set it was fitted on (1: errors add up fully, 1/sqrt(n): orthogonal)."""
  unit_err_KU, set_err_KS = np.atleast_2d(unit_err_KU), np.atleast_2d(set_err_KS)
  ratios = [set_err_KS[k, j] / max(unit_err_KU[k, s].sum(), 1e-30) for k in range(len(unit_err_KU))
            for j, s in enumerate(sets)]
  return float(max(ratios)) if ratios else 1.0


def set_fit(unit_err_U: np.ndarray, sets, measured_S: np.ndarray, coherence: float) -> dict[str, float]:
  """How well the linear (coherence * sum) and the orthogonal (root sum of squares) models predict measured set
  errors: Spearman rho, median |predicted / measured - 1|, share covered (predicted >= measured)."""
  from scipy.stats import spearmanr

  out = {"sets": len(sets)}
  measured_S = np.asarray(measured_S, float)
  for name, pred in (("linear", np.array([coherence * unit_err_U[s].sum() for s in sets])),
                     ("orthogonal", np.array([np.sqrt((unit_err_U[s] ** 2).sum()) for s in sets]))):
    rel = pred / np.maximum(measured_S, 1e-30) - 1
    # a rank correlation is undefined on fewer than 3 sets or a constant side (scipy would warn and give NaN)
    ranked = len(sets) > 2 and np.ptp(pred) > 0 and np.ptp(measured_S) > 0
    out[f"{name}_spearman"] = float(spearmanr(pred, measured_S).statistic) if ranked else float("nan")
    out[f"{name}_median_abs_rel_err"] = float(np.median(np.abs(rel)))
    out[f"{name}_covered"] = float(np.mean(pred >= measured_S * (1 - 1e-6)))
  return out


def fit_susceptibility(raw_KU: np.ndarray, err_KU: np.ndarray) -> np.ndarray:
  """[U] per-unit median over calibration batches of measured error per unit of raw exposure."""
  raw_KU, err_KU = np.atleast_2d(raw_KU), np.atleast_2d(err_KU)
  ratio = np.where(raw_KU > 0, err_KU / np.where(raw_KU > 0, raw_KU, 1.0), np.nan)
  s = np.nanmedian(np.where(np.isnan(ratio).all(0, keepdims=True), 0.0, ratio), axis=0)
  return np.nan_to_num(s)


def risk_metrics(score: np.ndarray, err: np.ndarray, top: float = 0.1) -> dict[str, float]:
  """Spearman rho, recall of the measured top-`top` units among the score's top, and AUROC for them."""
  from scipy.stats import rankdata, spearmanr

  score, err = np.asarray(score, float), np.asarray(err, float)
  k = max(1, int(round(top * len(err))))
  true_top = set(np.argsort(-err)[:k])
  pred_top = set(np.argsort(-score, kind="stable")[:k])
  labels = np.zeros(len(err), bool)
  labels[list(true_top)] = True
  ranks = rankdata(score)
  n_pos, n_neg = labels.sum(), (~labels).sum()
  auroc = float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)) if n_neg else float("nan")
  rho = spearmanr(score, err).statistic if np.ptp(score) > 0 else float("nan")
  return {"spearman": float(rho), f"top{int(top * 100)}_recall": len(true_top & pred_top) / k, "auroc": auroc}
