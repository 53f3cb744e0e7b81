"""The benchmark's outputs: results.json, results.md (table and targets), risk.md and frontier.png."""

from __future__ import annotations

import json
import os

import numpy as np

from hilore_jax import metrics
from hilore_jax.bench import stats, unit_risk

STYLE = ("sac", "uniform_int8", "uniform_int8_gc", "greedy_bits", "greedy_bits_gc", "adacc_style")
TARGET_RATIO = 1.10  # the issue's targets are stated at 1.10x GC's peak
GAIN_TARGET, MARGIN_OVER_HR, ERR_MEAN, ERR_MAX = 10.0, 3.0, 0.01, 0.015


def _fmt(v, spec=".3g"):
  return "—" if v is None else format(v, spec)


def flag_noise(rows: list[dict]) -> list[dict]:
  """Mark rows whose gain over GC exceeds No-GC's (nothing can beat keeping everything: that is noise)."""
  ceiling = next((r["gain_vs_gc_pct"] for r in rows if r["method"] == "none"), None)
  for r in rows:
    r["noise"] = bool(ceiling is not None and r["method"] not in ("none", "gc") and r["gain_vs_gc_pct"] is not None
                      and r["gain_vs_gc_pct"] > ceiling)
  return rows


def results_table(rows: list[dict]) -> str:
  head = ("| method | budget | matmul GFLOP/step | GB accessed | recompute removed | peak MiB | active | solver | "
          "tokens/s | gain vs GC [95% CI] | grad err mean | grad err max | H / L / R | sched. overhead |")
  lines = [head, "|---|---:|---:|---:|---:|---:|---|---|---:|---|---:|---:|---|---:|"]
  for r in rows:
    label = f"{r['method']} (-style)" if r["method"] in STYLE else r["method"]
    solver = r.get("solver", "—") + (f" (greedy {r['greedy_gap_pct']:+.1f}%)" if r.get("greedy_gap_pct") is not None
                                     else "")
    gain = (f"{_fmt(r['gain_vs_gc_pct'], '+.1f')}% [{_fmt(r.get('gain_ci_low'), '+.1f')}, "
            f"{_fmt(r.get('gain_ci_high'), '+.1f')}]" + (" NOISE (> No-GC)" if r.get("noise") else ""))
    lines.append(
        f"| {label} | {_fmt(r['budget_ratio'], '.2f') if r['budget_ratio'] else '—'} | {r['flops'] / 1e9:.2f} | "
        f"{_fmt((r.get('bytes_accessed') or 0) / 1e9, '.2f')} | {_fmt(r.get('recompute_removed_pct'), '.0f')}% | "
        f"{r['peak_bytes'] / 2**20:.1f} | {r.get('active_constraint', '—')} | {solver} | "
        f"{r['tokens_per_s']:.0f} | {gain} | {r['grad_rel_err_mean']:.2e} | {r['grad_rel_err_max']:.2e} | "
        f"{r['frac_H']:.2f} / {r['frac_L']:.2f} / {r['frac_R']:.2f} | {_fmt(r['schedule_overhead_pct'], '.3f')}% |")
  return "\n".join(lines)


def _paired_diff(a: dict, b: dict) -> tuple[float, float, float]:
  """Mean and bootstrap CI of a's per-rep gain minus b's (the same reps, so the machine's drift cancels)."""
  d = np.asarray(a["gains_pct"]) - np.asarray(b["gains_pct"])
  lo, hi = stats.bootstrap_ci(d)
  return float(d.mean()), lo, hi


def targets(rows: list[dict]) -> list[str]:
  """The issue's targets, each stated with the measured figures; 'met' only when the CI's lower bound clears it."""
  flag_noise(rows)
  by = {(r["method"], r["budget_ratio"]): r for r in rows}
  out = []
  same = [r for r in rows if r.get("same_as_gc") and r["method"] != "gc" and r.get("gain_ci_low") is not None]
  if same:
    g = [r["gain_vs_gc_pct"] for r in same]
    out.append(f"noise: {len(same)} rows run exactly GC's program; their paired gains span {min(g):+.1f}% to "
               f"{max(g):+.1f}% (CIs from {min(r['gain_ci_low'] for r in same):+.1f}% to "
               f"{max(r['gain_ci_high'] for r in same):+.1f}%)")
  noisy = [f"{r['method']}@{r['budget_ratio']}" for r in rows if r.get("noise")]
  if noisy:
    out.append(f"NOISE: gains above No-GC's are impossible and flagged: {', '.join(noisy)}")
  ratios = sorted({r["budget_ratio"] for r in rows if r["budget_ratio"]})
  at = min(ratios, key=lambda x: abs(x - TARGET_RATIO)) if ratios else None
  h = by.get(("hilore", at))
  if h is not None and h.get("gain_ci_low") is not None:
    ok = h["gain_ci_low"] >= GAIN_TARGET and not h["noise"]
    out.append(f"{'met' if ok else 'MISSED'}: at budget {at:.2f} HiLoRe's gain over GC is {h['gain_vs_gc_pct']:+.1f}% "
               f"[{h['gain_ci_low']:+.1f}, {h['gain_ci_high']:+.1f}] (target: CI lower bound >= +{GAIN_TARGET:.0f}%)"
               + (" — flagged as noise" if h["noise"] else ""))
    for other, margin in (("optimal_hr", MARGIN_OVER_HR), ("adacc_style", 0.0)):
      o = by.get((other, at))
      if o is None or not o.get("gains_pct"):
        continue
      d, lo, hi = _paired_diff(h, o)
      out.append(f"{'met' if lo >= margin else 'MISSED'}: HiLoRe - {other} = {d:+.1f} points [{lo:+.1f}, {hi:+.1f}] "
                 f"(target: CI lower bound >= {margin:+.0f}); FLOPs {h['flops'] / 1e9:.2f} vs {o['flops'] / 1e9:.2f} G")
    out.append(f"{'met' if h['grad_rel_err_mean'] <= ERR_MEAN and h['grad_rel_err_max'] <= ERR_MAX else 'MISSED'}: "
               f"HiLoRe's gradient error mean {h['grad_rel_err_mean']:.2e} (target <= {ERR_MEAN:.0%}), max "
               f"{h['grad_rel_err_max']:.2e} (target <= {ERR_MAX:.1%})")
  hil = [r for r in rows if r["method"] == "hilore"]
  if hil:
    sched = max(r["schedule_overhead_pct"] for r in hil)
    out.append(f"{'met' if sched <= 0.3 else 'MISSED'}: scheduling overhead at most {sched:.4f}% of the step "
               "(target <= 0.3%)")
  over = [f"{r['method']}@{r['budget_ratio']}" for r in rows if r.get("budget_bytes") and
          r["peak_bytes"] > r["budget_bytes"]]
  out.append(("met: no method's compiled peak is above its budget" if not over else
              f"MISSED: compiled peak above budget for {', '.join(over)}"))
  return out


def regime_lines(regime: dict) -> list[str]:
  if not regime:
    return []
  temp, err = regime.get("nogc_over_gc_temp"), regime.get("all_l_grad_err")
  return ["## Regime", "",
          f"- No-GC's compiled temp is {_fmt(temp, '.2f')}x GC's (memory binds when >= 3)",
          f"- every unit L ({regime.get('lowp_format')}) gives relative gradient error {_fmt(err, '.3g')} against the "
          f"tolerance {regime['tolerance']:.3g} (risk binds when above: "
          f"{'yes' if err and err > regime['tolerance'] else 'no'})",
          ""]


def fit_lines(fit: dict) -> list[str]:
  if not fit:
    return []
  out = ["## Set-risk model (units' errors are not orthogonal)", "",
         f"Coherence factor {fit['coherence']:.3f} (measured set error / sum of its units' errors, the largest over "
         "the calibration sets). Prediction of the measured error of random L sets:", "",
         "| sets | model | Spearman | median abs rel. err | covered (pred >= measured) |", "|---|---|---:|---:|---:|"]
  for where in ("calibration", "held_out"):
    f = fit.get(where) or {}
    for m in ("linear", "orthogonal"):
      if f"{m}_spearman" in f:
        out.append(f"| {where} ({f['sets']}) | {m} | {f[f'{m}_spearman']:.3f} | {f[f'{m}_median_abs_rel_err']:.3f} | "
                   f"{f[f'{m}_covered']:.2f} |")
  return out + [""]


def write_outputs(result: dict, out_dir: str):
  rows = flag_noise(result["rows"])
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump({"machine": result["machine"], "config": result["config"], "regime": result.get("regime"),
               "rows": rows, "calibration": result.get("calibration"), "risk_fit": result.get("risk_fit")}, f,
              indent=2, default=list)
  m, bc = result["machine"], result["config"]["bench"]
  mdl = result["config"]["model"]
  md = [f"# Memory methods on {m['device']} ({m['backend']}, {m['cpus']} CPUs, jax {m['jax']})", "",
        f"Model: {mdl.get('num_hidden_layers')} layers, hidden {mdl.get('hidden_size')}, "
        f"intermediate {mdl.get('intermediate_size')}, {mdl.get('dtype')}; minibatch {bc['batch_size']} x "
        f"{bc['seq_len']} tokens; {bc['reps']} interleaved reps. Matmul FLOPs: every dot of the gradient program's "
        "jaxpr after dead-code removal, scan bodies times their trip count, recompute included (XLA's cost analysis "
        "counts a loop body once). Bytes accessed: XLA's cost analysis of the compiled step (loop bodies once). "
        "Peak = XLA's compiled temp bytes. Gain = mean over reps of the throughput ratio to GC measured in the same "
        "rep, with a bootstrap 95% CI. Active = the budget that binds the plan (a looser one would give a faster "
        "plan). Relative gradient error ||g - g*|| / ||g*|| against the reference g* (full "
        "checkpointing, fp32 at highest matmul precision), mean and max over the timed batch and "
        f"{bc['risk_batches']} others.", ""] + regime_lines(result.get("regime") or {}) + [
        results_table(rows), "", "## Targets", ""] + [f"- {t}" for t in targets(rows)] + [""] + fit_lines(
            result.get("risk_fit") or {})
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write("\n".join(md) + "\n")
  if result.get("risk"):
    with open(os.path.join(out_dir, "risk.md"), "w") as f:
      f.write("# Risk prediction: does the score rank units by their measured gradient error?\n\n"
              "Fit on the calibration batches, evaluated on held-out batches (pooled over batches and units). "
              "Top-10% recall and AUROC are for the units whose measured error is in the top 10%.\n\n"
              + unit_risk.risk_table(result["risk"]) + "\n")
  frontier_plot(rows, os.path.join(out_dir, "frontier.png"))


def frontier_plot(rows: list[dict], path: str):
  with metrics.figure(path, (7, 4.5)) as (fig, ax):
    for i, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
      rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["peak_bytes"])
      ax.plot([r["peak_bytes"] / 2**20 for r in rs], [r["tokens_per_s"] for r in rs], marker="os^vD<>p"[i % 8],
              label=method, linestyle="-" if len(rs) > 1 else "none")
    ax.set_xlabel("compiled peak (temp) MiB")
    ax.set_ylabel("tokens / s (actor update)")
    ax.set_title("Memory vs throughput, every method and budget")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
