"""The exposure benchmark's statistics and report: within-unit Spearman summaries, the arms' comparisons, the
issue's targets, the markdown tables and the two plots (experiments/exposure/run.py runs it)."""

from __future__ import annotations

import numpy as np

from hilore_jax.loop import metrics
from hilore_jax.memory.predictors import rho_summary, within_unit_spearman  # noqa: F401 (re-exported)

NAN = float("nan")


def spearman_summary(score_MU, err_MU, n_boot: int, seed: int = 0, pooled_MU=None) -> dict:
  """Median over units of the within-unit Spearman rho with a bootstrap CI over minibatches; the pooled figure
  (units and minibatches together, mostly fixed per-unit differences: of pooled_MU if given) beside it, labelled as
  such."""
  from scipy.stats import spearmanr

  score_MU, err_MU = np.asarray(score_MU, float), np.asarray(err_MU, float)
  r = rho_summary(score_MU, err_MU, n_boot, seed)
  pooled_MU = score_MU if pooled_MU is None else np.asarray(pooled_MU, float)
  pooled = float(spearmanr(pooled_MU.ravel(), err_MU.ravel()).statistic) if np.ptp(pooled_MU) > 0 else NAN
  return {"within_median": r["within_unit_rho_median"], "within_ci_low": r["ci_low"], "within_ci_high": r["ci_high"],
          "within_units_defined": r["units_defined"], "within_share_positive": r["share_positive"], "pooled": pooled}


PAIRS = (("hilore_exposure_on", "hilore_static"), ("hilore_exposure_on", "hilore_exposure_off"),
         ("oracle", "hilore_static"), ("hilore_exposure_on", "optimal_hr"))


def compare_arms(arms: dict) -> tuple[dict, dict]:
  """(pairs, closed): paired measured gains with CIs (nan without timing) and recompute-removed differences for the
  issue's comparisons, and the share of the oracle's gain over static risk that exposure-on recovers (in FLOPs and,
  when timed, measured time; undefined where the oracle gains nothing)."""
  from hilore_jax import stats

  pairs = {}
  for a, b in PAIRS:
    timed = "round_times_s" in arms[a] and "round_times_s" in arms[b]
    d = stats.summary(stats.paired_gain_pct(arms[a]["round_times_s"], arms[b]["round_times_s"])) if timed else {}
    pairs[f"{a} vs {b}"] = {"gain_pct": d.get("mean", NAN), "ci_low": d.get("ci_low", NAN),
                            "ci_high": d.get("ci_high", NAN), "recompute_removed_points":
                            arms[a]["recompute_removed_pct"] - arms[b]["recompute_removed_pct"]}
  closed = {}
  for key in ("gain_vs_gc_pct", "recompute_removed_pct"):
    get = lambda a: arms[a].get(key, NAN)
    oracle_gap, on_gain = get("oracle") - get("hilore_static"), get("hilore_exposure_on") - get("hilore_static")
    closed[key] = on_gain / oracle_gap if oracle_gap > 1e-9 else NAN
  return pairs, closed


def unit_error_level(err_MU, kinds=None) -> np.ndarray:
  """[M] each minibatch's unit-error level with every unit kind weighing the same: a unit's error over its own mean
  across minibatches, the median over a kind's units, the mean over kinds (a plain mean over units followed the
  kind with the largest errors, attn_probs)."""
  err_MU = np.asarray(err_MU, float)
  rel = err_MU / np.maximum(err_MU.mean(0, keepdims=True), 1e-30)
  kinds = np.asarray(kinds if kinds is not None else ["unit"] * err_MU.shape[1])
  return np.mean([np.median(rel[:, kinds == k], axis=1) for k in dict.fromkeys(kinds)], axis=0)


def where_it_varies(describe: list[dict], passes: list[int], err_MU, kinds=None) -> dict:
  """Each batch descriptor's range and its Spearman rho against the minibatch's unit-error level
  (unit_error_level); the share of second passes; the 10th-90th percentile of a unit's error relative to its own
  mean."""
  from scipy.stats import spearmanr

  err_MU = np.asarray(err_MU, float)
  level = unit_error_level(err_MU, kinds)
  out = {}
  for k in describe[0]:
    v = [d[k] for d in describe]
    out[k] = {"min": float(np.min(v)), "max": float(np.max(v)),
              "spearman_vs_unit_error": float(spearmanr(v, level).statistic) if np.ptp(v) > 0 else None}
  out["pass"] = {"second_pass_share": float(np.mean([p > 0 for p in passes]))}
  spread = err_MU / np.maximum(err_MU.mean(0, keepdims=True), 1e-30)
  out["unit_error_spread_p10_p90"] = [float(np.quantile(spread, 0.1)), float(np.quantile(spread, 0.9))]
  return out


def targets(res: dict) -> dict[str, bool]:
  """Issue 25's targets, read off the figures (never tuned: the regime and arms are fixed in the config)."""
  r = res["risk_prediction"][res["chosen_predictor"]]
  out = {"chosen predictor: within-unit rho >= 0.6 (CI low >= 0.45)":
         r["within_unit_rho_median"] >= 0.6 and r["ci_low"] >= 0.45}
  eq = res["equal_violation"]
  if eq:
    on, static, oracle = (eq[a]["recompute_removed_pct"] for a in ("hilore_exposure_on", "hilore_static", "oracle"))
    target = eq["hilore_static"]["violation_target"]
    out[f"at {target:.0%} violations exposure removes more recompute (FLOPs) than static risk"] = on > static
    out["... and at least half of the oracle's advantage over static"] = oracle > static and on - static >= 0.5 * (
        oracle - static)
  return out


def _f(x, spec=".3f") -> str:
  return "n/a" if x is None or not np.isfinite(x) else format(x, spec)


def report(res: dict) -> str:
  rg, mb, tol = res["regime"], res["minibatches"], res["regime"]["tolerance"]
  lines = [f"# Run-time exposure on real rollouts ({res['backend']}, jax {res['jax']})", "",
           f"{mb['calibration']} calibration minibatches (rollout {mb['calib_steps']}), {mb['held_out']} held out "
           f"(rollouts {mb['held_out_steps']}); {mb['units_measured']} of {mb['units']} units measured. Error: "
           f"{res['error_definition']}. Regime: No-GC peak {rg['none_over_gc']:.2f}x GC's, budget "
           f"{rg['budget_bytes'] / 2**20:.1f} MiB (memory binds: {rg['memory_binds']}); every unit L "
           f"{rg['all_L_error']:.2e} vs tolerance {tol:.0e} (risk binds: {rg['risk_binds']}).", "",
           "## Risk prediction on held-out minibatches", "",
           "Within unit: Spearman rho of the score against the unit's measured error across held-out minibatches, "
           "unit by unit; median over units with a bootstrap CI over minibatches. Pooled: over units and "
           f"minibatches together (mostly fixed per-unit differences). Chosen: **{res['chosen_predictor']}**.", "",
           "| score | within-unit median rho [95% CI] | units defined | share rho > 0 | pooled rho |",
           "|---|---|---:|---:|---:|"]
  for name, r in res["risk"].items():
    lines.append(f"| {name} | {_f(r['within_median'])} [{_f(r['within_ci_low'])}, {_f(r['within_ci_high'])}] | "
                 f"{r['within_units_defined']} | {_f(r['within_share_positive'], '.2f')} | {_f(r['pooled'])} |")
  by_metric = res["risk_prediction_by_metric"]
  lines += ["", "The same predictors' within-unit median rho against each error definition:", "",
            "| predictor | " + " | ".join(by_metric) + " |", "|---|" + "---:|" * len(by_metric)]
  for name in res["risk_prediction"]:
    lines.append(f"| {name} | " + " | ".join(_f(by_metric[m][name]["within_unit_rho_median"]) for m in by_metric)
                 + " |")
  lines += ["", "Within-unit median rho of the chosen predictor by unit kind: " +
            ", ".join(f"{k} {_f(v, '.2f')}" for k, v in res["risk_by_kind"].items())]
  if res["equal_violation"]:
    lines += ["", "## Equal violation rate", "",
              "Each risk-budgeted arm swept over delta (multiples of the calibrated delta "
              f"{res['calibration']['delta']:.3g}) at one byte allowance, {res['sweep_allowance_bytes']} B (the "
              "smallest any arm's bucket fitted: the arms differ in risk alone; the swept plans are not compiled); "
              "recompute removed: share of GC's extra "
              "matmul FLOPs over No-GC that its plans remove (jaxpr count, deterministic); predicted: the same from "
              "the cost model's seconds. Read at the target by linear interpolation between sweep points.", "",
              "| arm | violation target | delta | recompute removed (FLOPs) | predicted | violation rate |",
              "|---|---:|---:|---:|---:|---:|"]
    for a, e in res["equal_violation"].items():
      note = "" if e["interpolated"] else " (not crossed)"
      lines.append(f"| {a} | {e['violation_target']:.2f} | {e['delta']:.3g} | {e['recompute_removed_pct']:.1f}% | "
                   f"{e['predicted_removed_pct']:.1f}% | {e['violation_rate']:.3f}{note} |")
    lines += ["", "| arm | factor | violation rate | recompute removed | predicted | error mean / max |",
              "|---|---:|---:|---:|---:|---|"]
    for a, pts in res["sweep"].items():
      for p in pts:
        lines.append(f"| {a} | {p['factor']:g} | {p['violation_rate']:.3f} | {p['recompute_removed_pct']:.1f}% | "
                     f"{p['predicted_removed_pct']:.1f}% | {p['err_mean']:.2e} / {p['err_max']:.2e} |")
  if res["arms"]:
    lines += ["", "## Arms at the calibrated delta", "",
              "| arm | recompute removed (FLOPs) | predicted | measured gain vs GC % [95% CI] | error mean / max | "
              "violation rate [CI] | L / R share | plans | buckets | active |",
              "|---|---:|---:|---|---|---|---|---:|---:|---|"]
    for a, r in res["arms"].items():
      gain = (f"{r['gain_vs_gc_pct']:+.1f} [{r['gain_ci_low']:+.1f}, {r['gain_ci_high']:+.1f}]"
              if "gain_vs_gc_pct" in r else "not timed")
      lines.append(f"| {a} | {r['recompute_removed_pct']:.1f}% | {r['predicted_removed_pct']:.1f}% | {gain} | "
                   f"{r['err_mean']:.2e} / {r['err_max']:.2e} | {r['violation_rate']:.3f} "
                   f"[{_f(r['violation_ci'][0])}, {_f(r['violation_ci'][1])}] | {r['frac_L']:.2f} / "
                   f"{r['frac_R']:.2f} | {r['distinct_plans']} | {r['buckets']} | {', '.join(r['active'])} |")
  if res["kl_clamp"]:
    lines += ["", "## A bounded KL (grpo.kl_clamp) and the spread of ||g||", "",
              "| clamp | log10 p90/p10 of ||g|| | bounded | max / min | bounded | spread removed |",
              "|---:|---:|---:|---:|---:|---:|"]
    for c, k in res["kl_clamp"].items():
      lines.append(f"| {c} | {_f(k['log10_spread_p10_p90'], '.2f')} | {_f(k['log10_spread_p10_p90_bounded'], '.2f')}"
                   f" | {k['max_over_min']:.3g} | {k['max_over_min_bounded']:.3g} | "
                   f"{_f(k['spread_removed_share'], '.2f')} |")
  eff = res.get("error_definition_vs_effect")
  if eff:
    lines += ["", f"Which error definition predicts the update's effect ({eff['effect']}; {eff['minibatches']} "
              "minibatches), Spearman rho: " + ", ".join(f"{m} {_f(v, '.2f')}" for m, v in
                                                      eff["spearman_vs_effect"].items()) + f"; best: {eff['best']}."]
  met = "; ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in targets(res).items())
  lines += ["", f"Targets (issue 25): {met}.", "", "## Where exposure varies", "",
            "| descriptor | min | max | Spearman vs unit-error level |", "|---|---:|---:|---:|"]
  for k, v in res["varies"].items():
    if "min" in v:
      s = v["spearman_vs_unit_error"]
      lines.append(f"| {k} | {v['min']:.3g} | {v['max']:.3g} | {'n/a' if s is None else f'{s:.2f}'} |")
  p10, p90 = res["varies"]["unit_error_spread_p10_p90"]
  lines += ["", f"A unit's measured error relative to its own mean: 10th-90th percentile {p10:.2f}-{p90:.2f}x; "
            f"second-pass share of held-out minibatches {res['varies']['pass']['second_pass_share']:.2f}.", ""]
  return "\n".join(lines)


def plot(res: dict, path: str):
  """Realised error against the plan's predicted risk, every arm's minibatches, at the calibrated delta."""
  metric = res["error_definition"].split(":")[0]
  with metrics.figure(path, (7, 4.5)) as (fig, ax):
    for i, (a, r) in enumerate(res["arms"].items()):
      pts = [(e["plan_risk"], e["errors"][metric]) for e in r["per_minibatch"] if e["plan_risk"] > 0]
      if pts:
        x, y = zip(*pts)
        ax.scatter(x, y, s=12, color=f"C{i}", alpha=0.7, label=a)
    ax.axhline(res["regime"]["tolerance"], color="k", ls="--", lw=1, label="tolerance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted risk of the plan (coherence x sum of unit risks)")
    ax.set_ylabel(f"realised error ({metric})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def plot_sweep(res: dict, path: str):
  """Recompute removed (FLOPs) against the violation rate, per arm over the delta sweep, each arm's point at the
  violation target marked."""
  with metrics.figure(path, (7, 4.5)) as (fig, ax):
    for i, (a, pts) in enumerate(res["sweep"].items()):
      ax.plot([p["violation_rate"] for p in pts], [p["recompute_removed_pct"] for p in pts], "o-", ms=4,
              color=f"C{i}", label=a)
      e = res["equal_violation"][a]
      ax.plot([e["violation_rate"]], [e["recompute_removed_pct"]], "*", ms=12, color=f"C{i}")
    if res["equal_violation"]:
      ax.axvline(next(iter(res["equal_violation"].values()))["violation_target"], color="k", ls="--", lw=1)
    ax.set_xlabel("violation rate (held-out minibatches over the tolerance)")
    ax.set_ylabel("recompute removed (% of GC's extra matmul FLOPs)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def e1_markdown(s: dict) -> str:
  """Issue 36's E1 summary (exposure_e1.summary) as the tables docs/exposure.md carries: the regime check, P1-P4
  each with its 95% cluster-bootstrap interval, target and verdict, P4's table beside the paper's, the gate."""
  f = lambda x: "nan" if x is None or not np.isfinite(float(x)) else f"{float(x):.3g}"
  verdict = lambda m, c=None: {True: "met", False: "MISSED", None: (c or {}).get("note", "not run").split(":")[0]}[m]
  ci = lambda c: f"{f(c['value'])} [{f(c['ci_low'])}, {f(c['ci_high'])}]" if "ci_low" in c else c.get("note", "n/a")
  rg = s.get("regime") or {}
  out = [f"Config `{s['config']}`; {s['held_out']['minibatches']} held-out minibatches in "
         f"{s['held_out']['clusters']} row sets (n_eff); command `{s['command']}`.", "",
         f"Regime check on the calibration rollout: second-pass clipfrac {f(rg.get('clipfrac_second_pass'))}, "
         f"completion length p90/p10 {f(rg.get('length_p90_p10'))}: {verdict(rg.get('met'))}.", "",
         "| criterion | value [95% CI] | target | verdict |", "|---|---|---|---|"]
  p1, p2, p3, p4 = (s[k] for k in ("P1", "P2", "P3", "P4"))
  out.append(f"| P1 variation, median within-unit p90/p10 ({p1.get('metric')}) | {ci(p1)} | >= {f(p1.get('target'))} "
             f"(<= {f(p1.get('null'))}: nothing to predict) | {verdict(p1.get('met'))}: {p1.get('verdict')} |")
  for m, v in (p1.get("per_metric") or {}).items():
    out.append(f"| P1, {m}: within / between rollouts | {f(v['value'])}: {f(v['within_rollouts'])} / "
               f"{f(v['between_rollouts'])} | | |")
  out.append(f"| P2 headroom, oracle - static (points of recompute removed) | {ci(p2)} | >= {f(p2.get('target'))} | "
             f"{verdict(p2.get('met'), p2)} |")
  if "periodic" in p2:
    out.append(f"| P2, oracle - periodic static | {ci(p2['periodic'])} | >= {f(p2['periodic'].get('target'))} | "
               f"{verdict(p2['periodic'].get('met'), p2['periodic'])} |")
  out.append(f"| P3 prediction, within-unit rho | {ci(p3)} | >= {f(p3.get('target'))}, CI low >= "
             f"{f(p3.get('ci_low_target'))}, headroom share {f(p3.get('headroom_share'))} >= "
             f"{f(p3.get('headroom_share_target'))} | {verdict(p3.get('met'), p3)} |")
  out.append(f"| P4 cross-unit rho of the {p4.get('score')} | {ci(p4)} | paper {f(p4.get('target'))} | "
             f"{verdict(p4.get('met'))} |")
  paper = p4.get("paper", {})
  out += ["", "| score (P4) | rho avg / pooled | top-10% recall avg / pooled | AUROC avg / pooled |",
          "|---|---|---|---|",
          f"| the paper | {f(paper.get('spearman'))} | {f(paper.get('top10_recall'))} | {f(paper.get('auroc'))} |"]
  for name, t in (p4.get("table") or {}).items():
    cell = lambda k: f"{f(t['averaged'][k])} / {f(t['pooled'][k])}"
    name = name.replace("|", "\\|")  # sum |A|: a pipe would end the cell
    out.append(f"| {name} | {cell('spearman')} | {cell('top10_recall')} | {cell('auroc')} |")
  g = s.get("gate_decision") or {}
  out += ["", f"Exposure gate for this recipe: spread {f(g.get('spread'))} (>= {f(g.get('spread_min'))}), unclipped "
              f"share {f(g.get('unclipped_share'))} (>= {f(g.get('unclipped_min'))}), leave-one-out rho "
              f"{f(g.get('loo_rho'))} (>= {f(g.get('rho_min'))}): {'on' if g.get('on') else 'off'}."]
  return "\n".join(out) + "\n"
