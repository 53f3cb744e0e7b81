"""Issue 47's experiment E1b as pure functions of its arrays (experiments/exposure/e1b.py runs them): the tolerance
rule, the check that the risk budget binds, the doubling sweep of delta, each arm read where it first crosses the
violation target (undefined where it never does), the primary and secondary criteria with cluster-bootstrap CIs
over row sets, and the decision they make.

  tolerance  tolerance_share x the calibration-median error of the most aggressive plan memory allows (the fastest
             plan within the byte allowance, the risk budget unbounded)
  binds      that plan is over the tolerance on >= binds_share of the calibration minibatches; else "untestable
             with these kinds": every arm would reach memory's plan before the risk budget decided anything
  primary    (oracle - static) / (ceiling - optimal_hr), recompute removed at the violation target: the share of
             what L can remove within memory that a perfect predictor adds over static risk; >= primary_share with
             the CI's low end > 0
  secondary  static_clip recovers >= secondary_share of oracle - static at the target, and at the calibrated delta
             its violation rate is at most secondary_violation_points above static's"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from experiments.common.config import E1bSettings
from experiments.exposure.e1 import cluster_bootstrap
from experiments.exposure.sweep import at_violation

NAN = float("nan")
UNTESTABLE = "untestable with these kinds"
# a sweep status besides crossed, memory binds first and max doublings: the arm is over the target at delta 0 (units
# whose calibrated risk is 0 are L with no risk budget at all), so no delta reads it at the target: undefined, never 0
OVER_AT_ZERO = "over at delta 0"


def tolerance_rule(aggressive_err_K: Sequence[float], share: float) -> float:
  """The tolerance: `share` of the median over calibration minibatches of the most aggressive plan's error."""
  return float(share * np.median(np.asarray(aggressive_err_K, float)))


def risk_binds(aggressive_err_K: Sequence[float], tol: float, need: float) -> dict:
  """Whether the risk budget binds: the share of calibration minibatches on which the most aggressive plan memory
  allows is over the tolerance, against `need`."""
  over = float(np.mean(np.asarray(aggressive_err_K, float) > tol))
  return {"share_over_tolerance": over, "need": need, "binds": bool(over >= need)}


def sweep_until(point_at: Callable[[float], dict], delta0: float, e: E1bSettings) -> tuple[list[dict], str]:
  """(points by increasing delta, status) of one arm: delta 0, then from e.sweep_start x delta0 (halved while that
  point is already over the target) doubled until the violation rate crosses e.violation_target, then e.refine
  bisections in log delta of the octave where it crossed. point_at(delta) -> {violation_rate, saturated, ...}:
  saturated where every minibatch's plan is already its plan at an unbounded risk budget, so no larger delta can
  change anything. status: crossed | memory binds first (never crosses: undefined) | max doublings | over at delta 0
  (undefined too: its one point)."""
  target, pts = e.violation_target, {0.0: point_at(0.0)}
  over = lambda p: p["violation_rate"] > target
  if over(pts[0.0]):  # over already with no risk budget (units of zero risk L): no delta is at or under the target
    return [pts[0.0]], OVER_AT_ZERO
  d = delta0 * e.sweep_start if delta0 > 0 else 1e-12
  pts[d] = point_at(d)
  for _ in range(e.max_doublings):  # already over at the start: halve toward delta 0 (never over: no L)
    if not over(pts[d]):
      break
    d /= 2
    pts[d] = point_at(d)
  doublings = 0
  while True:
    if over(pts[d]) or pts[d]["saturated"] or doublings == e.max_doublings:
      status = "crossed" if over(pts[d]) else "memory binds first" if pts[d]["saturated"] else "max doublings"
      break
    d *= 2
    pts[d] = point_at(d)
    doublings += 1
  if status == "crossed":
    lo, hi = max(x for x in pts if x < d and not over(pts[x])), d
    for _ in range(e.refine if lo > 0 else 0):
      mid = float(np.sqrt(lo * hi))
      pts[mid] = point_at(mid)
      lo, hi = (mid, hi) if not over(pts[mid]) else (lo, mid)
  return [pts[x] for x in sorted(pts)], status


def resampled(points: Sequence[dict], idx, tol: float) -> list[dict]:
  """The sweep's points over the minibatches idx, violations against tol (from each point's per-minibatch errors):
  a re-read at another tolerance or a bootstrap resample, without new gradients."""
  out = []
  for p in points:
    mb = p["per_minibatch"]
    err, rem = np.asarray(mb["err"], float)[idx], np.asarray(mb["removed_pct"], float)[idx]
    frac_l = np.asarray(mb["frac_L"], float)[idx]
    out.append({"delta": p["delta"], "violation_rate": float(np.mean(err > tol)) if len(err) else NAN,
                "recompute_removed_pct": float(np.mean(rem)), "predicted_removed_pct": NAN,
                "frac_L": float(np.mean(frac_l))})
  return out


def read(points: Sequence[dict], target: float) -> dict:
  """An arm at the violation target (exposure_sweep.at_violation, nan where it never crosses), with its L share
  interpolated as its removal is."""
  out = at_violation(points, target)
  pts = sorted(points, key=lambda p: p["delta"])
  for a, b in zip(pts, pts[1:]):
    if a["violation_rate"] <= target < b["violation_rate"]:
      t = (target - a["violation_rate"]) / (b["violation_rate"] - a["violation_rate"])
      return {**out, "frac_L": a["frac_L"] + t * (b["frac_L"] - a["frac_L"]), "between": [a["delta"], b["delta"]]}
  return {**out, "frac_L": NAN, "between": []}


def _gain(sweeps, idx, tol, target, arm, base="hilore_exposure_off"):
  r = {a: at_violation(resampled(sweeps[a], idx, tol), target)["recompute_removed_pct"] for a in (arm, base)}
  return r[arm] - r[base]


def primary(sweeps: dict, ceiling_pct: float, optimal_hr_pct: float, clusters, tol: float, e: E1bSettings,
            n_boot: int) -> dict:
  """(oracle - static) / (ceiling - optimal_hr) at the target, its cluster CI, target, met (None: undefined; so
  is the CI's low end where over 2.5% of resamples are undefined, an arm not crossing there)."""
  room = ceiling_pct - optimal_hr_pct
  stat = lambda i: _gain(sweeps, i, tol, e.violation_target, "oracle") / room if room > 0 else NAN
  est = cluster_bootstrap(stat, clusters, n_boot)
  defined = np.isfinite(est["value"]) and est["undefined_resample_share"] <= 0.025
  met = bool(est["value"] >= e.primary_share and est["ci_low"] > 0) if defined else None
  note = "" if defined else ("undefined: the room L has within memory is not positive" if room <= 0 else
                             "undefined: oracle or static never crossed the target (in the run or in over 2.5% of "
                             "resamples)")
  return {**est, "target": e.primary_share, "met": met, "room_pct": room, "note": note}


def secondary(sweeps: dict, at_calibrated: dict, clusters, tol: float, e: E1bSettings, n_boot: int) -> dict:
  """static_clip's share of oracle - static at the target (point estimate decides; CI reported), and its violation
  rate at the calibrated delta against static's there."""
  t = e.violation_target

  def share(i):
    room = _gain(sweeps, i, tol, t, "oracle")
    return _gain(sweeps, i, tol, t, "static_clip") / room if room > 0 else NAN

  est = cluster_bootstrap(share, clusters, n_boot)
  extra = at_calibrated["static_clip"]["violation_rate"] - at_calibrated["hilore_exposure_off"]["violation_rate"]
  within = bool(extra <= e.secondary_violation_points + 1e-12)
  met = bool(est["value"] >= e.secondary_share and within) if np.isfinite(est["value"]) else None
  return {**est, "target": e.secondary_share, "violation_points_over_static": extra,
          "violation_points_max": e.secondary_violation_points, "violation_within": within, "met": met,
          "note": "" if met is not None else "undefined: the oracle gains nothing over static at the target, or an "
                                             "arm never crossed it"}


def decision(regime: dict, prim: dict | None, sec: dict | None) -> dict:
  """What the run decides (issue 47): untestable; the exposure question closes on CPU; clip-scaled static risk
  becomes the default with no gate; or exposure keeps its gate."""
  if not regime["met"]:
    why = UNTESTABLE if not regime["risk"]["binds"] else "regime not met"
    return {"verdict": why, "default": "unchanged: static calibrated risk, exposure behind its gate"}
  if prim["met"] is None:
    return {"verdict": "primary undefined", "default": "unchanged: static calibrated risk, exposure behind its gate"}
  if not prim["met"]:
    return {"verdict": "the exposure question closes on CPU: where the risk budget binds, a perfect predictor adds "
                       "too little over static risk", "default": "static calibrated risk; exposure buckets off"}
  if sec["met"]:
    return {"verdict": "static_clip carries the gain", "default": "clip-scaled static risk, no gate"}
  return {"verdict": "headroom for prediction, not carried by static_clip",
          "default": "unchanged: static calibrated risk, exposure behind its gate"}


def ranking(raw_KU, err_KU) -> dict:
  """How a score ranks a unit's error across minibatches (the gate's leave-one-out rho, issue 47's question why it
  was exactly 0.0 on 8 minibatches): the gate's leave-one-out rho and the plain within-unit rho (medians over units),
  how many distinct values the per-unit rhos take and the share of units at the median (one shared ranking of the
  minibatches makes them one value), and the rho of the minibatch-level factors (each unit over its own mean,
  averaged over units) of score and error."""
  from hilore_jax.memory import gate
  from hilore_jax.memory.predictors import within_unit_spearman
  from hilore_jax.memory.riskfit import fit_susceptibility

  raw, err = np.atleast_2d(np.asarray(raw_KU, float)), np.atleast_2d(np.asarray(err_KU, float))
  K = len(err)
  pred = np.stack([raw[k] * fit_susceptibility(np.delete(raw, k, 0), np.delete(err, k, 0)) for k in range(K)])
  loo = np.array([gate.spearman(pred[:, u], err[:, u]) for u in range(err.shape[1])])
  within = within_unit_spearman(raw, err)
  live = loo[np.isfinite(loo)]
  level = lambda x: (x / np.maximum(x.mean(0, keepdims=True), 1e-30)).mean(1)
  return {"loo_rho": gate.loo_within_unit_rho(raw, err),
          "within_rho": float(np.nanmedian(within)) if np.isfinite(within).any() else NAN,
          "distinct_unit_rhos": int(len(np.unique(np.round(live, 9)))),
          "share_units_at_median": float(np.mean(np.isclose(live, np.median(live)))) if live.size else NAN,
          "minibatch_level_rho": gate.spearman(level(raw), level(err)), "loo_rho_U": loo.tolist()}


def markdown(s: dict) -> str:
  """The E1b summary as the tables docs/exposure.md carries."""
  f = lambda x: "nan" if x is None or not np.isfinite(float(x)) else f"{float(x):.3g}"
  verdict = lambda c: {True: "met", False: "MISSED"}.get(c.get("met"), (c.get("note") or "undefined").split(":")[0])
  rg, cal = s["regime"], s["calibration"]
  agg, rk = rg["aggressive_plan"], rg["risk"]
  out = [f"Config `{s['config']}`; command `{s['command']}`; predictor {s['predictor']}.", "",
         f"Regime, before the held-out pass: second-pass clipfrac {f(rg.get('clipfrac_second_pass'))}, completion "
         f"length p90/p10 {f(rg.get('length_p90_p10'))} (E1's two: {'met' if rg['e1_met'] else 'not met'}); No-GC "
         f"peak {f(rg['none_over_gc'])}x GC's (memory binds: {rg['memory_binds']}); the most aggressive plan memory "
         f"allows puts {agg['l_units']} units L (allowance {rg['allowance_bytes']} B, active: {agg['active']}), "
         f"calibration-median error {f(np.median(agg['err_calibration']))}; tolerance {f(rg['tolerance'])} "
         f"({rg['tolerance_rule']}); that plan over it on {f(100 * rk['share_over_tolerance'])}% of calibration "
         f"minibatches (risk binds at >= {f(100 * rk['need'])}%: {rk['binds']}). "
         f"{'Met.' if rg['met'] else 'Not met: ' + s['decision']['verdict'] + '.'}"]
  if "arms" in s:
    ho, ref = s["held_out"], s["reference"]
    out += ["", f"{ho['minibatches']} held-out minibatches (rollouts {ho['rollouts']}) in {ho['clusters']} row sets; "
                f"ceiling (that plan) removes {f(ref['ceiling_removed_pct'])}% of GC's extra matmul FLOPs, "
                f"optimal_hr (no L) {f(ref['optimal_hr_removed_pct'])}%.", "",
            f"| arm | sweep | delta at {f(100 * s['settings']['violation_target'])}% violations | recompute removed "
            "there | L share there | active around it | at the calibrated delta: violations, removed, L share |",
            "|---|---|---:|---:|---:|---|---|"]
    for a, r in s["arms"].items():
      t, c = r["at_target"], r["at_calibrated_delta"]
      act = " / ".join(", ".join(f"{k} {v}" for k, v in x.items()) for x in t.get("active_around", [])) or "-"
      out.append(f"| {a} | {r['sweep_status']} ({r['points']} points) | {f(t['delta'])} | "
                 f"{f(t['recompute_removed_pct'])}% | {f(t['frac_L'])} | {act} | {f(c['violation_rate'])}, "
                 f"{f(c['recompute_removed_pct'])}%, {f(c['frac_L'])} |")
    p, q = s["primary"], s["secondary"]
    ci = lambda c: f"{f(c['value'])} [{f(c['ci_low'])}, {f(c['ci_high'])}]"
    out += ["", "| criterion | value [95% CI] | target | verdict |", "|---|---|---|---|",
            f"| primary: (oracle - static) / (ceiling - optimal_hr) | {ci(p)} | >= {f(p['target'])}, CI low > 0 | "
            f"{verdict(p)} |",
            f"| secondary: static_clip's share of oracle - static | {ci(q)} | >= {f(q['target'])}, violations at "
            f"the calibrated delta {f(100 * q['violation_points_over_static'])} points over static's (<= "
            f"{f(100 * q['violation_points_max'])}) | {verdict(q)} |"]
    out += [f"| (reported) {a}'s share of oracle - static | {ci(o)} | violations at the calibrated delta "
            f"{f(100 * o['violation_points_over_static'])} points over static's | |"
            for a, o in s.get("shares_reported", {}).items()]
  g = cal["gate"]
  out += ["", f"Gate on the calibration rollout: spread {f(g['spread'])}, unclipped share {f(g['unclipped_share'])}, "
              f"leave-one-out rho {f(g['loo_rho'])}, risk binds {g.get('risk_binds')}: "
              f"{'on' if g['measured_on'] else 'off'}.", "",
          f"Decision: {s['decision']['verdict']}. Default: {s['decision']['default']}."]
  if "P4" in s:
    paper = s["P4"]["paper"]
    out += ["", "| score, per minibatch across units | rho avg / pooled | top-10% recall avg / pooled | AUROC avg / "
                "pooled |", "|---|---|---|---|",
            f"| the paper (other model, units, error) | {f(paper['spearman'])} | {f(paper['top10_recall'])} | "
            f"{f(paper['auroc'])} |"]
    for name, t in s["P4"]["table"].items():
      cell = lambda k: f"{f(t['averaged'][k])} / {f(t['pooled'][k])}"
      out.append(f"| {name} | {cell('spearman')} | {cell('top10_recall')} | {cell('auroc')} |")
  return "\n".join(out) + "\n"
