"""Static calibrated risk and the exposure gate (issue 36, item 5), pure functions of calibration's arrays.

hilore allocates every minibatch from each unit's calibrated error: its quantile (memory.calib_quantile, p90) over
the calibration minibatches. Run-time exposure scoring (buckets) pays only where a unit's error varies between
minibatches, where that variation is not divided away by clipping, and where the predictor ranks it; the gate
switches exposure buckets on only where calibration measures all three (thresholds: memory.gate.*):
  spread     median over units of the within-unit p90 / p10 of the measured error   >= gate.spread_min (2x)
  unclipped  share of calibration minibatches with ||g|| < c (the clip)              >= gate.unclipped_min (30%)
  loo_rho    median over units of the leave-one-out within-unit Spearman rho of the
             predictor's score against the measured error                           >= gate.rho_min (0.4)
and, where the caller knows it, that the risk budget binds: the fastest plan memory allows is over the tolerance on
most calibration minibatches (issue 47). Where memory alone binds, every risk score gives the same plan, so exposure
cannot change a decision however well it ranks.
On fewer than gate.min_batches (4) calibration minibatches the gate never decides: a p90 / p10 and a leave-one-out
rank correlation over one or two samples measure nothing, so it is undecided and exposure stays off."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hilore_jax.memory.config import GateConfig
from hilore_jax.memory.riskfit import fit_susceptibility


def unit_quantile(err_KU: np.ndarray, q: float) -> np.ndarray:
  """[U] each unit's q-quantile over the K calibration minibatches (linear interpolation): its calibrated error."""
  return np.quantile(np.atleast_2d(np.asarray(err_KU, float)), q, axis=0)


def within_unit_spread(err_KU: np.ndarray) -> float:
  """Median over units of p90 / p10 of a unit's error over minibatches (inf where p10 is 0 and p90 not; units
  without any error ignored; nan with none left)."""
  err_KU = np.atleast_2d(np.asarray(err_KU, float))
  hi, lo = np.quantile(err_KU, 0.9, axis=0), np.quantile(err_KU, 0.1, axis=0)
  live = hi > 0
  if not live.any():
    return float("nan")
  with np.errstate(divide="ignore"):
    return float(np.median(np.where(lo[live] > 0, hi[live] / np.where(lo[live] > 0, lo[live], 1.0), np.inf)))


def unclipped_share(grad_norms: Sequence[float], max_grad_norm: float) -> float:
  """Share of minibatches whose gradient norm is under the clip (1 without a clip: nothing divides exposure away)."""
  g = np.asarray(grad_norms, float)
  if not max_grad_norm:
    return 1.0
  return float(np.mean(g < max_grad_norm)) if g.size else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> float:
  """Spearman rho (nan where either side is constant or there are fewer than 3 points)."""
  from scipy.stats import spearmanr

  x, y = np.asarray(x, float), np.asarray(y, float)
  if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
    return float("nan")
  return float(spearmanr(x, y).statistic)


def loo_within_unit_rho(raw_KU: np.ndarray, err_KU: np.ndarray) -> float:
  """Median over units of the within-unit Spearman rho between each minibatch's predicted error and its measured
  one, the prediction of minibatch k made by the predictor fitted without k (its susceptibility: measured error per
  unit of raw score, fit_susceptibility) -- the predictor's honest ranking of minibatches it was not fitted on. nan
  where no unit has a defined rho."""
  raw_KU, err_KU = np.atleast_2d(np.asarray(raw_KU, float)), np.atleast_2d(np.asarray(err_KU, float))
  K = len(err_KU)
  if K < 3:
    return float("nan")
  pred_KU = np.stack([raw_KU[k] * fit_susceptibility(np.delete(raw_KU, k, 0), np.delete(err_KU, k, 0))
                      for k in range(K)])
  rho = np.array([spearman(pred_KU[:, u], err_KU[:, u]) for u in range(err_KU.shape[1])])
  return float(np.nanmedian(rho)) if np.isfinite(rho).any() else float("nan")


def decide(spread: float, unclipped: float, loo_rho: float, gc: GateConfig, buckets: int = 2,
           batches: int | None = None, risk_binds: bool | None = None) -> dict:
  """The gate's record: its inputs, thresholds, each test, what they decide (`measured_on`) and whether exposure
  buckets run (`on`): mode always / never forces it (the benchmark's arms); buckets <= 1 keeps exposure off. On
  fewer than gc.min_batches calibration minibatches (`batches`) it is `undecided`, and auto keeps exposure off.
  risk_binds: whether the risk budget binds (None: not measured, no such test)."""
  passed = {"spread": bool(spread >= gc.spread_min), "unclipped": bool(unclipped >= gc.unclipped_min),
            "loo_rho": bool(loo_rho >= gc.rho_min)}
  if risk_binds is not None:
    passed["risk_binds"] = bool(risk_binds)
  undecided = batches is not None and batches < gc.min_batches
  measured = all(passed.values()) and buckets > 1 and not undecided
  on = {"auto": measured, "always": True, "never": False}[gc.mode] and buckets > 1
  return {"spread": float(spread), "unclipped_share": float(unclipped), "loo_rho": float(loo_rho),
          "spread_min": gc.spread_min, "unclipped_min": gc.unclipped_min, "rho_min": gc.rho_min, "mode": gc.mode,
          "risk_binds": risk_binds if risk_binds is None else bool(risk_binds), "passed": passed,
          "measured_on": bool(measured), "on": bool(on), "undecided": bool(undecided), "batches": batches,
          "min_batches": gc.min_batches}


def describe(record: dict) -> str:
  """The gate's decision in one phrase: undecided with the count it has and needs, or its inputs against their
  thresholds."""
  if record.get("undecided"):
    n = record["batches"]
    return (f"gate {record['mode']}: undecided: {n} minibatch{'es' if n != 1 else ''}, it needs "
            f"{record['min_batches']} (memory.calib_batches)")
  return (f"gate {record['mode']}: within-unit p90/p10 {record['spread']:.2f}x vs {record['spread_min']:.2f}x, "
          f"||g|| < c on {100 * record['unclipped_share']:.0f}% vs {100 * record['unclipped_min']:.0f}%, leave-one-out "
          f"rho {record['loo_rho']:.2f} vs {record['rho_min']:.2f}")


def gate_metrics(record: dict) -> dict[str, float]:
  """memory/gate/* metrics of a gate record (empty for a calibration without one)."""
  if not record:
    return {}
  return {"memory/gate/spread": record["spread"], "memory/gate/unclipped_share": record["unclipped_share"],
          "memory/gate/loo_rho": record["loo_rho"], "memory/gate/on": float(record["on"]),
          "memory/gate/undecided": float(record.get("undecided", False))}


def evaluate(err_KU: np.ndarray, raw_KU: np.ndarray, grad_norms: Sequence[float], max_grad_norm: float,
             gc: GateConfig, buckets: int = 2, risk_binds: bool | None = None) -> dict:
  """The gate's record from calibration's arrays: measured unit errors [K, U], the predictor's raw scores [K, U]
  (without susceptibility) and each minibatch's ||g||; risk_binds as decide takes it."""
  return decide(within_unit_spread(err_KU), unclipped_share(grad_norms, max_grad_norm),
                loo_within_unit_rho(raw_KU, err_KU), gc, buckets, len(np.atleast_2d(err_KU)), risk_binds)
