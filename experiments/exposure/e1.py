"""Issue 36's experiment E1 as one summary (docs/data/exposure_e1.json): the regime check, P1-P4 each as
{value, ci_low, ci_high, target, met}, and the exposure gate's decision, from the exposure benchmark's held-out arrays.
Pure functions of arrays; CIs by a cluster bootstrap over row sets (a row set's passes resampled together), n_eff the
number of clusters.

  P1 variation   median over units of the within-unit p90 / p10 of the error (per metric; within a rollout: the
                 error over its rollout's mean; between rollouts: the rollout means)
  P2 headroom    recompute removed (FLOPs points) at the violation target: oracle - static, oracle - periodic static
  P3 prediction  the chosen predictor's within-unit rho (median over units), and its share of the oracle's headroom
  P4 the paper's per held-out minibatch cross-unit rho, top-10% recall and AUROC, averaged and pooled"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from experiments.common.config import E1Criteria
from experiments.exposure.sweep import at_violation, sweep_arm
from hilore_jax.memory.gate import within_unit_spread
from hilore_jax.memory.predictors import within_unit_spearman
from hilore_jax.memory.riskfit import risk_metrics

NAN = float("nan")


def cluster_bootstrap(stat: Callable[[np.ndarray], float], clusters: Sequence, n_boot: int, seed: int = 0) -> dict:
  """{value, ci_low, ci_high, n_eff, undefined_resample_share}: stat of every minibatch (an index array), and its
  95% interval over n_boot resamples of whole clusters (clusters[i]: minibatch i's row set) where stat is defined
  (finite), with the share of resamples where it is not."""
  ids = np.asarray([str(c) for c in clusters])
  groups = [np.flatnonzero(ids == u) for u in dict.fromkeys(ids)]
  value = float(stat(np.arange(len(ids))))
  rng, boots = np.random.default_rng(seed), []
  for _ in range(n_boot):
    b = float(stat(np.concatenate([groups[i] for i in rng.integers(0, len(groups), len(groups))])))
    if np.isfinite(b):
      boots.append(b)
  lo, hi = np.quantile(boots, [0.025, 0.975]) if boots else (NAN, NAN)
  return {"value": value, "ci_low": float(lo), "ci_high": float(hi), "n_eff": len(groups),
          "undefined_resample_share": 1 - len(boots) / n_boot if n_boot else NAN}


def _criterion(est: dict, target: float, met: bool | None, **extra) -> dict:
  """met None: undefined (a figure the run could not define, e.g. no arm crossed the violation target), which is
  neither met nor missed."""
  return {**est, "target": target, "met": None if met is None else bool(met), **extra}


def _defined(x) -> bool:
  return x is not None and bool(np.isfinite(x))


def p1_variation(err_by: dict[str, np.ndarray], clusters, rollouts, chosen: str, c: E1Criteria, n_boot: int) -> dict:
  """P1 for the deciding metric (`chosen`), with every metric's value and the within / between-rollout split."""
  rollouts = np.asarray(rollouts)

  def split(err_MU, idx):
    e, r = err_MU[idx], rollouts[idx]
    means = {k: e[r == k].mean(0) for k in np.unique(r)}
    within = e / np.where(np.stack([means[k] for k in r]) > 0, np.stack([means[k] for k in r]), 1.0)
    return within_unit_spread(within), within_unit_spread(np.stack(list(means.values())))

  per_metric = {}
  for m, e in err_by.items():
    e = np.asarray(e, float)
    w, b = split(e, np.arange(len(e)))
    per_metric[m] = {"value": within_unit_spread(e), "within_rollouts": w, "between_rollouts": b}
  est = cluster_bootstrap(lambda i: within_unit_spread(np.asarray(err_by[chosen], float)[i]), clusters, n_boot)
  v = est["value"]
  verdict = "paper-like" if v >= c.p1_paper_like else ("nothing to predict" if v <= c.p1_nothing else "between")
  return _criterion(est, c.p1_paper_like, v >= c.p1_paper_like, metric=chosen, null=c.p1_nothing, verdict=verdict,
                    per_metric=per_metric)


def _removed_at(points: list[dict], idx, tol: float, target: float) -> float:
  """Recompute removed at the violation target of an arm's sweep, over the minibatches idx (per-minibatch errors and
  removals: each point's per_minibatch); nan where the sweep never crosses the target (at_violation)."""
  pts = [{"delta": p["delta"], "violation_rate": float(np.mean(np.asarray(p["per_minibatch"]["err"])[idx] > tol)),
          "recompute_removed_pct": float(np.mean(np.asarray(p["per_minibatch"]["removed_pct"])[idx])),
          "predicted_removed_pct": 0.0} for p in points]
  return at_violation(pts, target)["recompute_removed_pct"]


def p2_headroom(sweeps: dict[str, list], clusters, tol: float, target: float, c: E1Criteria, n_boot: int,
                rollouts=None, periodic_from: int = 0) -> dict:
  """P2: oracle minus static (and minus periodic static, where that arm ran, over the rollouts after its
  recalibration rollout `periodic_from`) at the violation target."""
  after = None if rollouts is None else np.asarray(rollouts) > periodic_from

  def gap(other):
    def stat(i):
      i = i[after[i]] if other == "hilore_periodic_static" and after is not None else i
      return _removed_at(sweeps["oracle"], i, tol, target) - _removed_at(sweeps[other], i, tol, target) if len(i) \
          else NAN
    return stat

  def verdict(est, target):  # undefined where either arm never crossed the target
    return est["value"] >= target if _defined(est["value"]) else None

  est = cluster_bootstrap(gap("hilore_exposure_off"), clusters, n_boot)
  out = _criterion(est, c.p2_static_points, verdict(est, c.p2_static_points), violation_target=target)
  if "hilore_periodic_static" in sweeps:
    per = cluster_bootstrap(gap("hilore_periodic_static"), clusters, n_boot)
    out["periodic"] = _criterion(per, c.p2_periodic_points, verdict(per, c.p2_periodic_points))
  else:
    out["periodic"] = {"value": NAN, "target": c.p2_periodic_points, "met": None,
                       "note": "not run: no periodic-static arm"}
  if out["met"] is not None:
    out["met"] = bool(out["met"] and out["periodic"]["met"] is not False)
  if out["met"] is None:
    out["note"] = f"undefined: an arm's sweep never crossed {target:.0%} violations"
  return out


def p3_prediction(score_MU, err_MU, sweeps, clusters, tol: float, target: float, c: E1Criteria, n_boot: int) -> dict:
  """P3: the chosen predictor's within-unit rho (cluster CI) and its share of the oracle's headroom over static."""
  score_MU, err_MU = np.asarray(score_MU, float), np.asarray(err_MU, float)
  rho = lambda i: float(np.nanmedian(r)) if np.isfinite(r := within_unit_spearman(score_MU[i], err_MU[i])).any() \
      else NAN
  est = cluster_bootstrap(rho, clusters, n_boot)
  share = NAN
  if {"oracle", "hilore_exposure_on", "hilore_exposure_off"} <= set(sweeps):
    idx = np.arange(len(err_MU))
    at = {a: _removed_at(sweeps[a], idx, tol, target) for a in ("oracle", "hilore_exposure_on", "hilore_exposure_off")}
    room = at["oracle"] - at["hilore_exposure_off"]
    share = (at["hilore_exposure_on"] - at["hilore_exposure_off"]) / room if room > 0 else NAN
  ranks = est["value"] >= c.p3_rho and est["ci_low"] >= c.p3_rho_ci_low
  # an undefined headroom share (no arm crossed, or the oracle gains nothing over static) leaves P3 undefined where
  # its ranking parts pass: nan >= 0.5 is False, which read a share nobody could measure as a missed one
  met = (ranks and share >= c.p3_headroom_share) if _defined(share) or not ranks else None
  return _criterion(est, c.p3_rho, met, ci_low_target=c.p3_rho_ci_low, headroom_share=share,
                    headroom_share_target=c.p3_headroom_share,
                    **({} if _defined(share) else {"note": "headroom share undefined: the oracle's headroom over "
                                                           "static is not positive or not defined"}))


def p4_paper(scores: dict[str, np.ndarray], err_MU, clusters, c: E1Criteria, n_boot: int, main: str) -> dict:
  """P4: per held-out minibatch, each score's cross-unit rho / top-10% recall / AUROC against the measured errors,
  averaged over minibatches and pooled; the `main` score's averaged rho with a cluster CI is the criterion's value."""
  err_MU = np.asarray(err_MU, float)
  keys = ("spearman", "top10_recall", "auroc")

  def averaged(s, idx):
    rows = [risk_metrics(s[i], err_MU[i]) for i in idx]
    return {k: float(np.nanmean([r[k] for r in rows])) for k in keys}

  table = {}
  for name, s in scores.items():
    s = np.asarray(s, float)
    table[name] = {"averaged": averaged(s, range(len(s))), "pooled": risk_metrics(s.ravel(), err_MU.ravel())}
  s = np.asarray(scores[main], float)
  est = cluster_bootstrap(lambda i: averaged(s, i)["spearman"], clusters, n_boot)
  paper = dict(zip(keys, c.p4_paper))
  return _criterion(est, paper["spearman"], est["value"] >= paper["spearman"], score=main, paper=paper, table=table)


def periodic_sweep(mc, be, hooks, records, held, allowance: int, realised, plan_flops, gc_flops: float, gc_s: float,
                   tol: float, units) -> tuple[list, dict]:
  """(sweep points, read at the violation target) of the periodic-static arm: hilore with exposure off,
  recalibrated on rollout be.recalibrate_rollout's records (each at its own update's params), swept over delta on
  every held-out minibatch (P2 reads only those after that rollout)."""
  import dataclasses

  from experiments.exposure.spill import KeptContext
  from hilore_jax.memory import MemoryManager

  m = MemoryManager(dataclasses.replace(mc.at_budget(None, "hilore"), buckets=1), hooks)
  records = [r for r in records if r.step == be.recalibrate_rollout]
  contexts = [KeptContext(r, r.logp) for r in records]
  m.setup(records[0].params, [r.batch for r in records], 0, contexts=contexts)
  m.allocate([held[0].batch])  # its one bucket, fitted to the budget
  points = sweep_arm(lambda b, d: m.plan_at(b, d, allowance), [0] * len(held), be.sweep, m.state.calibration.delta,
                     realised, plan_flops, gc_flops, gc_s, tol, units)
  return points, at_violation(points, be.violation_target)


def regime(cal_records, c: E1Criteria) -> dict:
  """The regime check on the calibration rollout: its second pass's clip fraction and completion lengths' p90 / p10."""
  second = [r.describe["clipfrac"] for r in cal_records if r.pass_ > 0]
  lengths = np.concatenate([np.asarray(r.batch.mask).sum(1) for r in cal_records if r.pass_ == 0])
  clipfrac = float(np.mean(second)) if second else NAN
  p10 = float(np.quantile(lengths, 0.1)) if lengths.size else NAN
  ratio = float(np.quantile(lengths, 0.9) / p10) if p10 > 0 else float("inf")
  return {"clipfrac_second_pass": clipfrac, "length_p90_p10": ratio,
          "met": bool(clipfrac >= c.regime_clipfrac_min and ratio >= c.regime_length_ratio_min)}


def summary(config_path: str, command: str, arrays: dict, c: E1Criteria, gate_decision: dict, n_boot: int,
            regime_check: dict | None = None) -> dict:
  """The exposure_e1.json record. arrays: err_by {metric: [M, U]}, metric (the deciding one), score_MU (the chosen
  predictor's), scores {name: [M, U]} for P4, clusters and rollouts [M], sweeps {arm: points with per_minibatch},
  tol and violation_target; periodic_from: the periodic-static arm's recalibration rollout."""
  err, cl = np.asarray(arrays["err_by"][arrays["metric"]], float), arrays["clusters"]
  sweeps, tol, target = arrays.get("sweeps", {}), arrays["tol"], arrays["violation_target"]
  out = {"config": config_path, "command": command, "regime": regime_check or {},
         "held_out": {"minibatches": len(err), "clusters": len(set(map(str, cl)))},
         "P1": p1_variation(arrays["err_by"], cl, arrays["rollouts"], arrays["metric"], c, n_boot)}
  out["P2"] = p2_headroom(sweeps, cl, tol, target, c, n_boot, arrays["rollouts"], arrays.get("periodic_from", 0)) \
      if "oracle" in sweeps else {"met": None}
  out["P3"] = p3_prediction(arrays["score_MU"], err, sweeps, cl, tol, target, c, n_boot)
  out["P4"] = p4_paper(arrays["scores"], err, cl, c, n_boot, next(iter(arrays["scores"])))
  out["gate_decision"] = gate_decision
  return out



def prior_scores(cal_state, units) -> dict[str, np.ndarray]:
  """[U] P4's scores that are constant over minibatches: each unit's int8 reconstruction RMS at calibration, and a
  type/layer prior: the calibration's mean error as a unit-kind factor times a layer factor (a log-additive fit)."""
  kinds, layers = np.array([k for _, k in units]), np.array([layer for layer, _ in units])
  log_err = np.log(np.maximum(np.asarray(cal_state.static_error, float), 1e-30))
  kind_f = {k: log_err[kinds == k].mean() for k in set(kinds)}
  resid = log_err - np.array([kind_f[k] for k in kinds])
  layer_f = {layer: resid[layers == layer].mean() for layer in set(layers)}
  out = {"type/layer prior": np.exp([kind_f[k] + layer_f[layer] for k, layer in zip(kinds, layers)])}
  if cal_state.recon_rms:
    out["reconstruction RMS"] = np.asarray(cal_state.recon_rms, float)
  return out


def write(be, metric: str, cal, held, err_by: dict, units, mu, table: dict, chosen: str, sweeps: dict, cal_state,
          tol: float) -> dict:
  """Assemble the summary from exposure.py's run (its records, units and the measured ones mu, score table of
  (raw, susceptibility) pairs, deciding metric, calibration) and write it to be.e1_json; the command is this
  process's."""
  import json
  import os
  import sys

  argv = sys.argv[1:]
  config_path = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else ""
  M = len(held)
  scores = {"run-time score": table[chosen], **{k: v for k, v in table.items() if k != chosen},
            **{k: (np.tile(v, (M, 1)), np.ones(len(v))) for k, v in prior_scores(cal_state, units).items()}}
  arrays = {"err_by": {m: np.asarray(e)[:, mu] for m, e in err_by.items()}, "metric": metric,
            "score_MU": np.asarray(table[chosen][0])[:, mu],
            "scores": {k: (np.asarray(r) * np.asarray(s))[:, mu] for k, (r, s) in scores.items()},
            "clusters": [f"{r.step}:{r.index}" for r in held], "rollouts": [r.step for r in held], "sweeps": sweeps,
            "tol": tol, "violation_target": be.violation_target, "periodic_from": be.recalibrate_rollout}
  # the benchmark's arms force exposure on; the recipe's decision is the measured one (on the bench's calibration)
  gate = cal_state.gate
  decision = {**gate, "mode": "auto", "on": gate.get("measured_on", gate.get("on"))}
  out = summary(config_path, " ".join(["python -m experiments.exposure.main", *argv]), arrays, be.criteria, decision,
                be.bootstrap, regime(cal, be.criteria))
  os.makedirs(os.path.dirname(be.e1_json) or ".", exist_ok=True)
  with open(be.e1_json, "w") as f:
    json.dump(out, f, indent=1, default=float)
  return out
