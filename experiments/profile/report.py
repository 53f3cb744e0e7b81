"""experiments.profile.main's outputs: profile.json (everything) and profile.md (a summary table, a table per plan, and
whether each predictor orders the plans as the measurement does), measured and predicted labelled apart."""

from __future__ import annotations

import json
import os

import numpy as np

from hilore_jax import stats

SHOWN = ("matmul", "elementwise", "copy", "custom_call", "loop", "other", "executor")
TOP_OPS = 12


def _f(v, spec=".2f", scale=1.0):
  return "—" if v is None else format(v * scale, spec)


def _gain(gains) -> str:
  if not gains:
    return "—"
  lo, hi = stats.bootstrap_ci(gains)
  return f"{np.mean(gains):+.1f}% [{lo:+.1f}, {hi:+.1f}]"


def _bench_gain(b: dict) -> str:
  """The bench's own gain over GC and its CI, as results.json has them."""
  if b.get("gain_vs_gc_pct") is None:
    return "—"
  return f"{b['gain_vs_gc_pct']:+.1f}% [{_f(b.get('gain_ci_low'), '+.1f')}, {_f(b.get('gain_ci_high'), '+.1f')}]"


def _cat_ms(p: dict, cat: str) -> float:
  return sum(p["trace"][k]["by_category"][cat]["time_s"] for k in ("grad", "update") if k in p["trace"])


def summary_table(plans: list[dict]) -> str:
  cats = " | ".join(f"{c} ms" for c in SHOWN)
  head = (f"| plan | layer scan | H / L / R | **measured** bench gain vs GC [95% CI] (results.json) | **measured** "
          f"wall ms (median, untraced) | **measured** gain vs GC [95% CI] | **measured** traced grad + update ms | "
          f"{cats} | traced GB (estimate) | XLA GB (loop bodies once) | XLA GB (unrolled) | matmul GFLOP | "
          "grad temp MiB | **predicted** rerun ms (cost model) |")
  lines = [head, "|" + "---|" * 3 + "---:|" * (len(SHOWN) + 10)]
  for p in plans:
    fr = p["frac"]
    hlr = " / ".join(_f(fr[k]) for k in "HLR")
    name = p["label"] + (" (control)" if p["control"] else "") + (f" (= {', '.join(p['same_as'])})"
                                                                  if p["same_as"] else "")
    cells = " | ".join(_f(_cat_ms(p, c), ".2f", 1e3) for c in SHOWN)
    lines.append(f"| {name} | {'yes' if p['layer_scan'] else 'no'} | {hlr} | {_bench_gain(p['bench'])} | "
                 f"{_f(p['wall_median_s'], '.2f', 1e3)} | "
                 f"{_gain(p.get('wall_gains_pct'))} | {_f(p['traced_step_s'], '.2f', 1e3)} | {cells} | "
                 f"{_f(p['traced_bytes_total'], '.3f', 1e-9)} | {_f(sum(p['xla_bytes'].values()), '.3f', 1e-9)} | "
                 f"{_f(p['xla_bytes_unrolled_total'], '.3f', 1e-9)} | {_f(p['matmul_flops'], '.2f', 1e-9)} | "
                 f"{_f(p['temp_bytes']['grad'], '.1f', 2**-20)} | {_f(p['predicted_rerun_s'], '.3f', 1e3)} |")
  return "\n".join(lines)


def plan_section(p: dict) -> str:
  """One plan: each program's span, time and bytes by category, XLA's counts, and its costliest ops."""
  out = [f"### {p['label']}", "",
         "| program | **measured** span ms | ops ms | " + " | ".join(f"{c} ms" for c in SHOWN) +
         " | traced GB (estimate) | XLA GB (loop bodies once) | XLA GFLOP | temp MiB |",
         "|---|" + "---:|" * (len(SHOWN) + 6)]
  for prog in ("grad", "update"):
    t = p["trace"].get(prog)
    if t is None:
      continue
    cats = " | ".join(_f(t["by_category"][c]["time_s"], ".2f", 1e3) for c in SHOWN)
    out.append(f"| {prog} | {_f(t['span_s'], '.2f', 1e3)} | {_f(t['ops_s'], '.2f', 1e3)} | {cats} | "
               f"{_f(t['bytes'], '.3f', 1e-9)} | {_f(p['xla_bytes'][prog], '.3f', 1e-9)} | "
               f"{_f(p['xla_flops'][prog], '.2f', 1e-9)} | {_f(p['temp_bytes'][prog], '.1f', 2**-20)} |")
  grad = p["trace"].get("grad")
  if grad:
    out += ["", f"Costliest ops of the gradient program (per step, {TOP_OPS} of {len(grad['ops'])}):", "",
            "| op | category | executions | **measured** ms | MB (estimate) | GB/s |", "|---|---|---:|---:|---:|---:|"]
    for r in grad["ops"][:TOP_OPS]:
      rate = r["bytes"] / r["time_s"] * 1e-9 if r["time_s"] > 0 else None
      out.append(f"| `{r['op']}` | {r['category']} | {r['executions']:g} | {_f(r['time_s'], '.3f', 1e3)} | "
                 f"{_f(r['bytes'], '.3f', 1e-6)} | {_f(rate, '.1f')} |")
  return "\n".join(out)


def order_section(name: str, o: dict) -> str:
  if not o["pairs"]:
    return f"**{name}**: no per-round times to compare."
  lines = [f"**{name}**: {o['resolved']} of {len(o['pairs'])} pairs resolved (paired CI of the gain difference "
           "excludes 0).", "", "| predictor (lower = faster) | agrees | disagrees | ties |", "|---|---:|---:|---:|"]
  lines += [f"| {k} | {v['agree']} | {v['disagree']} | {v['tie']} |" for k, v in o["predictors"].items()]
  wrong = [r for r in o["pairs"] if r.get("cost model (predicted rerun s)") == "disagrees"]
  if wrong:
    lines += ["", "Resolved pairs the cost model orders the other way: " + "; ".join(
        f"{r['pair'][0]} vs {r['pair'][1]} ({r['diff_pts']:+.1f} pts [{r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}])"
        for r in wrong) + "."]
  return "\n".join(lines)


def markdown(result: dict) -> str:
  cfg, plans = result["config"], result["plans"]
  m, b = cfg["model"], cfg["bench"]
  src = {p["bench"].get("plan_source") for p in plans if not p["control"]}
  head = [
      "# Where each plan's actor update spends its time", "",
      f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, "
      f"{m['dtype']}; minibatch {b['batch_size']} x {b['seq_len']}; {result['reps']} traced steps and "
      f"{result['timing']['rounds']} untraced interleaved rounds per plan; plans {' / '.join(sorted(map(str, src)))}; "
      f"{result['machine']['device']} ({result['machine']['cpus']} CPUs), jax {result['machine']['jax']}.", "",
      "**Measured**: wall time (untraced), each program's traced span and its ops' times (profiler on; "
      "experiments/profile/ops.py: an op's time is its thunk's span less nested ops, overlaps between threads split "
      "evenly; `executor` is the span no op covered; `loop` a loop's own control time). **Counted**: XLA's "
      "cost analysis, temp bytes, matmul FLOPs, the traced bytes (each executed thunk's operands and result from "
      "the HLO shapes: an estimate). **Predicted**: the cost model's rerun + codec seconds above No-GC "
      "(memory/costmodel.py; it orders plans, it is not a step time). Controls `gc_unrolled` / `none_unrolled` "
      "run GC's / No-GC's computation with the layers unrolled, as every partial plan's are.", "",
      "## Summary", "", summary_table(plans), "", "## Per plan", ""]
  differ = [p["label"] for p in plans if p["bench"].get("matches_results") is False]
  if differ:  # the bench's measurement is then not of these programs: its order leaves them out
    head[-4:-4] = [f"**Differ from results.json** (peak or H/L/R): {', '.join(differ)}; their bench figures are "
                   "left out.", ""]
  body = [plan_section(p) + "\n" for p in plans]
  tail = ["## Does each figure order the plans as the measurement does?", ""]
  for name, o in result["orders"].items():
    tail += [order_section(name, o), ""]
  return "\n".join(head + body + tail)


def write_outputs(result: dict, out_dir: str):
  with open(os.path.join(out_dir, "profile.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out_dir, "profile.md"), "w") as f:
    f.write(markdown(result))

