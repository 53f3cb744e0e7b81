"""Compile seconds of the train step against depth: full checkpointing (one policy run) and a mixed HiLoRe-like
plan (H, L and R layers in three runs, as a plan of a few exposure levels gives), each at several depths.

Consecutive layers with the same policy run under one `lax.scan`, so compile time should follow the number of
distinct policy runs, which is fixed here, not the number of layers; the per-layer plan (every layer's policy
differs from its neighbours') is the worst case for comparison, where the scan cannot help.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from hilore_jax import model, sharding
from hilore_jax.loop import engine
from hilore_jax.capacity import synthetic
from experiments.common import engines
from experiments.common.config import BenchConfig
from hilore_jax.config import Config
from hilore_jax.rl import train_step

DEPTHS = (4, 8, 16, 32)
KEEP = model.LayerPolicy(remat=True, save=(model.MLP_GATE, model.Q))  # H: two matmul outputs kept
LOWP = model.LayerPolicy(remat=True, save=(model.V,), lowp=(model.MLP_NORM,))  # L: an int8 norm output


def plans(num_layers: int) -> dict[str, tuple[model.LayerPolicy, ...]]:
  """gc: one run; hilore_mixed: thirds kept H / L / recomputed (three runs); per_layer: no two neighbours equal."""
  third = max(num_layers // 3, 1)
  mixed = (KEEP,) * third + (LOWP,) * third + (model.FULL_REMAT,) * (num_layers - 2 * third)
  cycle = (KEEP, LOWP, model.FULL_REMAT)
  return {"gc": model.uniform(num_layers, model.FULL_REMAT), "hilore_mixed": mixed,
          "per_layer": tuple(cycle[i % 3] for i in range(num_layers))}


def _batch(cfg: Config, bc: BenchConfig, mcfg: model.ModelConfig, mesh):
  host = synthetic.token_batch(mcfg.vocab_size, np.random.default_rng(cfg.seed), bc.batch_size, bc.prompt_len,
                               bc.seq_len - bc.prompt_len)
  return jax.device_put(host, sharding.batch_sharding(mesh))


def measure(cfg: Config, bc: BenchConfig, depths=DEPTHS, names=("gc", "hilore_mixed"), progress=print) -> list[dict]:
  """One row per (depth, plan): compile seconds of the gradient program (the update program is compiled first and
  does not depend on the plan), the number of policy runs, and the compiled peak bytes."""
  rows = []
  for depth in depths:
    mcfg = engine.model_config(cfg).replace(num_hidden_layers=depth)
    eng, _ = engines.build(cfg, mcfg)
    batch = _batch(cfg, bc, mcfg, eng.mesh)
    grpo = dataclasses.replace(cfg.grpo, max_completion_len=bc.seq_len - bc.prompt_len)
    eng.stepper.update_program(train_step.StepSpec(mcfg, grpo, plans(depth)["gc"], 1, cfg.train.logprob_chunk), batch)
    for name in names:
      pols = plans(depth)[name]
      spec = train_step.StepSpec(mcfg, grpo, pols, 1, cfg.train.logprob_chunk)
      t0 = time.perf_counter()
      step = eng.stepper.get(spec, batch, reason=f"bench_compile {name} at {depth} layers")
      row = {"layers": depth, "plan": name, "policy_runs": len(model.policy_runs(pols)),
             "compile_s": time.perf_counter() - t0, "peak_bytes": step.peak_bytes}
      rows.append(row)
      progress(f"{depth:3d} layers  {name:13s} {row['policy_runs']:3d} runs  compile {row['compile_s']:7.2f} s")
  return rows


def table(rows: list[dict]) -> str:
  """Markdown: one row per depth, compile seconds per plan."""
  names = list(dict.fromkeys(r["plan"] for r in rows))
  by = {(r["layers"], r["plan"]): r for r in rows}
  lines = ["| layers | " + " | ".join(f"{n} compile s (runs)" for n in names) + " |",
           "|---|" + "---|" * len(names)]
  for depth in dict.fromkeys(r["layers"] for r in rows):
    cells = [f"{by[depth, n]['compile_s']:.2f} ({by[depth, n]['policy_runs']})" for n in names]
    lines.append(f"| {depth} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- the manager's plan against depth

DEPTH_FIELDS = ("compile_s", "peak_rss_gib", "grad_temp_bytes", "peak_bytes")


def _policy_json(policies) -> list[dict]:
  return [dataclasses.asdict(p) for p in policies]


def _policies(rows: list[dict]) -> tuple[model.LayerPolicy, ...]:
  return tuple(model.LayerPolicy(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()}) for r in rows)


def _point(shape: str, layers: int, completion: int, attention: str, scan: bool = True):
  """(capacity measurer, its config and stepper, the step's spec, abstract batch) of one point, compile-only."""
  from hilore_jax.capacity import measure as C

  settings = C.Settings()
  mcfg = C.load_shape(shape, settings).replace(attention=attention, num_hidden_layers=layers, scan_layers=scan)
  m = C.Measurer(settings)
  cfg, stepper = m.engine(mcfg, 1)
  batch = C.abstract_batch(settings.rows, settings.prompt_len, completion, settings.beta > 0)
  return m, cfg, stepper, m.spec(cfg, mcfg, completion), batch


def manager_plan(shape: str, layers: int, completion: int, attention: str, method: str, ratio: float):
  """A capacity method's (capacity/measure.py METHODS) plan: the memory manager's at ratio x GC's compiled peak
  (capacity's budget fit: projected op times, for hilore an uncalibrated risk), compile-only; its probe compiles
  are not the measured one."""
  m, cfg, stepper, spec, batch = _point(shape, layers, completion, attention)
  return m.policies(cfg, stepper, spec, batch, method, ratio)


def grad_program(shape: str, layers: int, completion: int, attention: str, policies, scan: bool = True) -> dict:
  """Compile seconds and bytes of one plan's gradient program (the update program, which no plan changes, compiled
  first and not counted)."""
  _, _, stepper, spec, batch = _point(shape, layers, completion, attention, scan)
  spec = dataclasses.replace(spec, policies=tuple(policies))
  stepper.update_program(spec, batch)
  t0 = time.perf_counter()
  step = stepper.get(spec, batch, count=False)
  return {"compile_s": time.perf_counter() - t0, "grad_temp_bytes": step.grad_temp_bytes,
          "peak_bytes": step.peak_bytes, "hlo_instructions": _instructions(step.grad.as_text())}


def _instructions(hlo_text: str) -> int:
  """Instructions of an optimized HLO module (every computation's): compile work's deterministic proxy."""
  return sum(1 for line in hlo_text.splitlines() if " = " in line and not line.lstrip().startswith(("//", "HloModule")))


def child():
  """One grad_program in this process (arguments as JSON on stdin); prints its row with the process's peak RSS."""
  import json
  import resource
  import sys

  a = json.loads(sys.stdin.read())
  row = grad_program(a["shape"], a["layers"], a["completion"], a["attention"], _policies(a["policies"]), a["scan"])
  row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
  print("ROW " + json.dumps(row))


def measure_in_child(shape, layers, completion, attention, policies, scan: bool = True, timeout_s: float = 3600):
  """grad_program in a fresh process, so its peak RSS is the compile's (plus the imports'), not the planner's."""
  import json
  import subprocess
  import sys

  arg = json.dumps({"shape": shape, "layers": layers, "completion": completion, "attention": attention,
                    "policies": _policy_json(policies), "scan": scan})
  out = subprocess.run([sys.executable, "-c", "from experiments.compile_time import run; run.child()"],
                       input=arg, capture_output=True, text=True, timeout=timeout_s)
  rows = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
  if out.returncode or not rows:
    tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit {out.returncode}"]
    return {"error": f"exit {out.returncode}: {tail[0][:300]}"}
  return json.loads(rows[0])


def depth_rows(out_path: str, shape: str, depths, completion: int, attention: str, method: str = "hilore",
               ratio: float = 1.1, unrolled: bool = False, progress=print, repeats: int = 1) -> list[dict]:
  """Per depth: the manager's plan (its runs), and its gradient program's compile seconds (the least of `repeats`
  fresh processes: on a loaded machine the others only add waiting), the compiling processes' peak RSS, the optimized
  program's instructions and compiled bytes, scanned and (unrolled) every layer a plain call. Rows are kept in
  out_path as they come: a rerun measures only what is missing."""
  import json
  import os

  rows = json.load(open(out_path)) if os.path.exists(out_path) else []
  for depth in depths:
    key = {"shape": shape, "layers": depth, "completion": completion, "attention": attention, "method": method,
           "ratio": ratio}
    row = next((r for r in rows if all(r.get(k) == v for k, v in key.items())), None)
    if row is None:
      pols = manager_plan(shape, depth, completion, attention, method, ratio)
      row = {**key, "policies": _policy_json(pols), "policy_runs": len(model.policy_runs(pols)),
             "distinct_policies": len(set(pols))}
      rows.append(row)
    pols = _policies(row["policies"])
    for scan, prefix in ((True, ""), (False, "unrolled_")) if unrolled else ((True, ""),):
      if prefix + "compile_s" not in row and prefix + "error" not in row:
        runs = [measure_in_child(shape, depth, completion, attention, pols, scan) for _ in range(repeats)]
        got = next((r for r in runs if "error" in r), None) or {
            **runs[0], "compile_s": min(r["compile_s"] for r in runs),
            "compile_s_all": [r["compile_s"] for r in runs], "peak_rss_gib": max(r["peak_rss_gib"] for r in runs)}
        row.update({prefix + k: v for k, v in got.items()})
      progress(f"{shape} x{depth} T={completion} {attention} {method}@{ratio} {'unrolled' if prefix else 'scanned'}"
               f" ({row['policy_runs']} runs): " + (row.get(prefix + "error") or
               f"compile {row[prefix + 'compile_s']:.1f} s, peak RSS {row[prefix + 'peak_rss_gib']:.2f} GiB, "
               f"peak {row[prefix + 'peak_bytes'] / 2**30:.3f} GiB"))
      with open(out_path + ".tmp", "w") as f:
        json.dump(rows, f, indent=1)
      os.replace(out_path + ".tmp", out_path)
  return rows


def depth_table(rows: list[dict]) -> str:
  """Markdown: one row per (shape, depth): runs, compile s, peak RSS, compiled peak (and unrolled where measured)."""
  lines = ["| shape | layers | T | attention | plan | runs | compile s | peak RSS GiB | HLO instructions | peak GiB "
           "| unrolled: compile s | peak RSS GiB | HLO instructions | peak GiB | scanned / unrolled peak |",
           "|---|" + "---:|" * 14]
  cells = lambda r, p: ([f"{r[p + 'compile_s']:.1f}", f"{r[p + 'peak_rss_gib']:.2f}",
                         f"{r.get(p + 'hlo_instructions', 0):,}", f"{r[p + 'peak_bytes'] / 2**30:.3f}"]
                        if p + "peak_bytes" in r else [r.get(p + "error", "-")[:40], "-", "-", "-"])
  for r in rows:
    ratio = f"{r['peak_bytes'] / r['unrolled_peak_bytes']:.3f}" if "unrolled_peak_bytes" in r and "peak_bytes" in r \
        else "-"
    lines.append(f"| {r['shape']} | {r['layers']} | {r['completion']} | {r['attention']} | {r['method']}@{r['ratio']} "
                 f"| {r['policy_runs']} | " + " | ".join(cells(r, "") + cells(r, "unrolled_") + [ratio]) + " |")
  return "\n".join(lines)


def constraint_cost(shape: str, layers: int, completion: int, attention: str, method: str = "hilore",
                    ratio: float = 1.1, runs=(0, 1, 2, 3, 4, 8)) -> list[dict]:
  """The cost of memory.plan_runs, compile-only: per value (0: any number of runs) the method's plan at one byte
  allowance (ratio x GC's compiled peak, less GC's: the budget fit's first probe), its runs, its predicted rerun +
  codec seconds per microbatch (the cost model on H200-projected op times; hilore uncalibrated) and its compiled
  peak against the budget; GC's predicted seconds beside them."""
  from hilore_jax.capacity import measure as C
  from hilore_jax.capacity import projection
  from hilore_jax.loop import step_hooks
  from hilore_jax.memory import ManagerState, MemoryManager, budget_bytes

  m, cfg, stepper, spec, batch = _point(shape, layers, completion, attention)
  hooks = step_hooks.memory_hooks(stepper, spec)
  L = spec.model_cfg.num_hidden_layers
  gc_bytes = hooks.compile_peak(model.uniform(L, model.FULL_REMAT), batch)
  budget = budget_bytes(gc_bytes, ratio)
  prof = projection.projected_profile(spec.model_cfg, *hooks.batch_shape(batch), m.settings.group_size)
  policy = C.METHODS[method][0]
  cal = C.uncalibrated(L, cfg.memory.grad_err_tolerance) if policy in ("hilore", "hilore_static") else None
  out = []
  for r in runs:
    mm = MemoryManager(dataclasses.replace(cfg.memory, plan_runs=r).at_budget(ratio, policy), hooks)
    # the allowance given as fitted: the plan is solved at it, with no probe compiles
    mm.load_state(ManagerState(gc_bytes, budget, prof, 0, cal, buckets=[[]], allowance={"0": budget - gc_bytes},
                               verified=[0]), "constraint cost")
    (alloc,) = mm.allocate([batch])
    out.append({"plan_runs": r, "policy_runs": len(model.policy_runs(alloc.policies)),
                "predicted_s": alloc.plan.time_s, "gc_predicted_s": mm.gc_plan().time_s,
                "peak_bytes": hooks.compile_peak(alloc.policies, batch), "budget_bytes": budget})
  return out


def cost_table(rows: list[dict]) -> str:
  """Markdown: per depth and memory.plan_runs, the plan's runs, predicted seconds (and against GC's, against any
  number of runs) and compiled peak against the budget."""
  free = {r["layers"]: r["predicted_s"] for r in rows if r["plan_runs"] == 0}
  lines = ["| layers | plan_runs | runs | predicted ms | vs GC | vs any runs | compiled peak / budget |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    vs_free = f"{r['predicted_s'] / free[r['layers']]:.3f}" if r["layers"] in free else "-"
    lines.append(f"| {r['layers']} | {r['plan_runs'] or 'any'} | {r['policy_runs']} | {1e3 * r['predicted_s']:.2f} | "
                 f"{r['predicted_s'] / r['gc_predicted_s']:.3f} | {vs_free} | "
                 f"{r['peak_bytes'] / r['budget_bytes']:.3f} |")
  return "\n".join(lines)
