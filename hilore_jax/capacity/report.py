"""capacity.json as markdown (the longest completion by method, kernel and budget; the step's bytes by tokens per
row, with the growth check) and a plot (bytes by tokens; longest completion by budget)."""

from __future__ import annotations

from hilore_jax.loop import metrics

GiB, MiB = 2**30, 2**20


def label(row: dict) -> str:
  return row["method"] + (f"@{row['budget_ratio']:.2f}x" if row.get("budget_ratio") is not None else "")


def growth_check(peak: dict) -> dict:
  """The issue's linearity figures at 1024/2048/4096 tokens per row: the increments' ratio (p4096-p2048) /
  (p2048-p1024) (2.0 for a peak affine in T, 4.0 for a quadratic one over a zero base) and the per-token slopes'
  ratio (1.0 affine, growing with the T^2 term)."""
  p = {int(k): v for k, v in peak.items()}
  if not {1024, 2048, 4096} <= set(p):
    return {}
  d1, d2 = p[2048] - p[1024], p[4096] - p[2048]
  return {"increment_ratio": d2 / d1 if d1 else float("nan"), "slope_ratio": (d2 / 2048) / (d1 / 1024)
          if d1 else float("nan")}


def markdown(result: dict) -> str:
  from hilore_jax.capacity.measure import with_legacy  # measure imports jax and the model: only where read

  s = with_legacy(result["settings"])
  lines = ["# Capacity (compile-only): the longest completion whose whole GRPO step fits one device",
           "", f"Prompt {s['prompt_len']} tokens, {s['rows']} rows (one group) in microbatches of "
           f"{s.get('microbatch_rows') or s['rows']}, {s['dtype']} compute, "
           + (f"LoRA rank {s['lora_rank']} on all seven projections of a frozen {s['param_dtype']} base (AdamW "
              f"state of the adapters alone, the base is the KL reference)" if s.get("lora_rank") else
              f"{s['param_dtype']} params and AdamW state") + f", KL beta {s['beta']}" +
           ("" if s.get("lora_rank") else " (reference weights resident)") +
           (f", a recomputed MLP in chunks of {s['mlp_chunk_len']} positions" if s.get("mlp_chunk_len") else
            ", the MLP never chunked") + f", solved plans of at most {s['plan_runs']} layer runs; completion "
           f"lengths searched on a {s['grid']}-token grid. A cell is the longest completion in tokens (>= at the "
           "cap: the shape's max_position_embeddings - prompt), 0 when none fits.", ""]
  rows = result.get("rows", [])
  budgets = sorted({r["budget_gib"] for r in rows})
  if rows:
    lines += ["| shape | devices | attention | method | " + " | ".join(f"{b:g} GiB" for b in budgets) + " |",
              "|---|---:|---|---|" + "---:|" * len(budgets)]
    cells: dict[tuple, dict] = {}
    for r in rows:
      cells.setdefault((r["shape"], r["devices"], r["attention"], label(r)), {})[r["budget_gib"]] = \
          (">= " if r["capped"] else "") + str(r["longest_completion"])
    for (shape, dev, att, lab), by in cells.items():
      lines.append(f"| {shape} | {dev} | {att} | {lab} | " + " | ".join(by.get(b, "") for b in budgets) + " |")
  growth = result.get("growth", [])
  if growth:
    toks = sorted({int(t) for g in growth for t in g["peak_bytes"]})
    lines += ["", "## The step's bytes by tokens per row (one device)", "",
              "peak: the repo's compiled peak (engine.Step.peak_bytes: the larger program's temp plus the gradients, "
              "beyond the state); device: the whole step's largest program footprint with what stays resident. "
              "Increment ratio (p4096-p2048)/(p2048-p1024) of the peak: 2.0 if it is affine in T; slope ratio: the "
              "same per token, 1.0 if affine.", "",
              "| shape | method | attention | " + " | ".join(f"peak {t} (MiB)" for t in toks) + " | "
              + " | ".join(f"device {t} (GiB)" for t in toks) + " | increment ratio | slope ratio |",
              "|---|---|---|" + "---:|" * (2 * len(toks) + 2)]
    for g in growth:
      chk = growth_check(g["peak_bytes"])
      lines.append(f"| {g['shape']} | {label(g)} | {g['attention']} | "
                   + " | ".join(f"{g['peak_bytes'][str(t)] / MiB:,.0f}" for t in toks) + " | "
                   + " | ".join(f"{g['device_bytes'][str(t)] / GiB:.2f}" for t in toks)
                   + "".join(f" | {chk.get(k, float('nan')):.2f}" for k in ("increment_ratio", "slope_ratio")) + " |")
  return "\n".join(lines) + "\n"


def plot(result: dict, path: str):
  """Left: peak bytes by tokens per row (growth rows); right: longest completion by budget (one device count)."""
  rows, growth = result.get("rows", []), result.get("growth", [])
  if not rows and not growth:
    return
  with metrics.figure(path, (11, 4.2)) as (fig, whole):
    whole.remove()
    ax, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for g in growth:
      t = sorted(int(k) for k in g["peak_bytes"])
      ax.plot(t, [g["peak_bytes"][str(k)] / GiB for k in t], marker="o",
              label=f"{g['shape']} {label(g)} {g['attention']}")
    ax.set_xlabel("tokens per row (prompt + completion)")
    ax.set_ylabel("compiled peak (GiB)")
    ax.set_title(f"step peak, {result['settings']['rows']} rows")
    ax.grid(alpha=0.3)
    if growth:
      ax.legend(fontsize=7)
    series: dict[tuple, list] = {}
    for r in rows:
      series.setdefault((r["shape"], label(r), r["attention"], r["devices"]), []).append(r)
    for (shape, lab, att, dev), rs in series.items():
      rs = sorted(rs, key=lambda r: r["budget_gib"])
      right.plot([r["budget_gib"] for r in rs], [r["longest_completion"] for r in rs], marker="o",
                 label=f"{shape} {lab} {att} x{dev}")
    right.set_xlabel("per-device budget (GiB)")
    right.set_ylabel("longest completion (tokens)")
    right.set_title("capacity")
    right.grid(alpha=0.3)
    if rows:
      right.legend(fontsize=7)
