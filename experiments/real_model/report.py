"""The real-model bench's markdown: set-up cost, the L-error table beside the tiny model's, the memory table with its
byte breakdown, and LoGRA's state."""

from __future__ import annotations

MiB = 2**20


def _mib(b) -> str:
  return "—" if b is None else f"{b / MiB:,.0f}"


def l_error_table(real: dict, tiny: dict, tolerance: float) -> list[str]:
  fmts = list(real)
  kinds = sorted({k for f in fmts for k in real[f]["per_kind_median"]})
  head = "| unit kind | " + " | ".join(f"{f} real (median / max) | {f} tiny" for f in fmts) + " |"
  lines = [head, "|---|" + "---:|---:|" * len(fmts)]
  for k in kinds:
    cells = []
    for f in fmts:
      r, t = real[f], tiny.get(f, {})
      cells.append(f"{r['per_kind_median'].get(k, float('nan')):.2e} / {r['per_kind_max'].get(k, float('nan')):.2e}")
      cells.append(f"{t.get('per_kind_median', {}).get(k, float('nan')):.2e}")
    lines.append(f"| {k} | " + " | ".join(cells) + " |")
  cells = []
  for f in fmts:
    all_l = real[f]["all_l"]
    cells.append(f"**{all_l:.2e}** ({'binds' if all_l > tolerance else 'does not bind'})")
    cells.append(f"{tiny.get(f, {}).get('all_l', float('nan')):.2e}")
  lines.append("| every unit L at once | " + " | ".join(cells) + " |")
  return lines


def memory_table(rows: list[dict]) -> list[str]:
  lines = ["| shape | method | budget | compiled peak | within budget | H / L / R | grads | gradient temp | "
           "update temp | logits chunk |", "|---|---|---:|---:|---|---|---:|---:|---:|---:|"]
  for r in rows:
    ok = "—" if r["budget_bytes"] is None else ("yes" if r["peak_bytes"] <= r["budget_bytes"] else "NO")
    lines.append(f"| {r['shape']} | {r['method']} | {r['budget_ratio'] or '—'} | {_mib(r['peak_bytes'])} | {ok} | "
                 f"{r['frac_H']:.2f} / {r['frac_L']:.2f} / {r['frac_R']:.2f} | {_mib(r['grad_bytes'])} | "
                 f"{_mib(r['grad_temp_bytes'])} | {_mib(r['update_temp_bytes'])} | {_mib(r['logits_chunk_bytes'])} |")
  return lines


def report(result: dict) -> str:
  """real_model.md: the parts measured so far."""
  m = result["config"]["model"]
  lines = [f"# {m.get('path') or 'model'}: memory, L error and set-up cost", ""]
  c = result.get("calibration")
  if "setup" in result:
    s = result["setup"]
    lines += ["## The manager's set-up on the run's shape", "",
              f"GC compile, op profile and calibration: {s['setup_s']:.0f} s ({s['probe_gradients']} probe gradients "
              f"on {c['rows']}-row minibatches, unit kinds measured at layers {c['probed_layers'] or 'all'}); the "
              f"first bucket's budget fit: {s['first_fit_s']:.0f} s ({s['probe_compiles']} compiles). One step of the "
              f"run: {s['step_s']:.1f} s (rollout {s['rollout_s']:.1f} s + {s['updates_per_step']} x update "
              f"{s['update_s']:.1f} s). Set-up = **{s['share_of_100_steps_pct']:.1f}%** of a 100-step run.", ""]
  if c:
    lines += [f"Calibration: delta {c['delta']:.3g}, coherence {c['coherence']:.2f}.", ""]
  if "l_error" in result:
    lines += ["## Relative gradient error of each unit kind alone as L", "",
              f"On the model's own rollouts (real) and on the tiny random model (bench_binding's shape, synthetic "
              f"minibatches); ||g_u - g|| / ||g||, median over the measured layers and minibatches. Tolerance "
              f"{result['tolerance']:g}." + (" Real: layers {layers} of {rows} rows of {minibatches} minibatch(es)."
                                             .format(**result["l_error_where"]) if "l_error_where" in result else ""),
              ""]
    lines += l_error_table(result["l_error"], result["l_error_tiny"], result["tolerance"])
    lines.append("")
  if "memory" in result:
    lines += ["## Compiled memory per method (compile only, MiB per device)", ""]
    lines += memory_table(result["memory"])
    first = result["memory"][0]
    lines += ["", f"Params {_mib(first['params_bytes'])} MiB and AdamW state {_mib(first['opt_state_bytes'])} MiB "
              f"come on top of every row (the step's peak is the larger program's temp plus the gradients between "
              f"them).", ""]
  if "logra" in result:
    lines += ["## LoGRA's step memory", "", "| optimizer | shape | opt state | step peak | total |",
              "|---|---|---:|---:|---:|"]
    for r in result["logra"]:
      lines.append(f"| {r['optimizer']} | {r['shape']} | {_mib(r['opt_state_bytes'])} | {_mib(r['peak_bytes'])} | "
                   f"{_mib(r['total_bytes'])} |")
  return "\n".join(lines) + "\n"
