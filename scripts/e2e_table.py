"""The end-to-end table of scripts/e2e_side_by_side.sh: per run, the median step (steps 2..N), rollout and update,
the first step's end (seconds since the trainer process imported hilore_jax; TRL's side reports none), the
run's wall time, peak RSS, and what the runs measured of HiLoRe (warm-up, set-up, guard). python scripts/e2e_table.py
OUT"""

import json
import os
import statistics
import sys

RUNS = [("gc-cold", "hilore_jax gc, cold cache"), ("hilore-cold", "hilore_jax hilore 1.10x, cold cache"),
        ("gc-warm", "hilore_jax gc, warm cache"), ("hilore-warm", "hilore_jax hilore 1.10x, warm cache"),
        ("trl", "TRL GRPOTrainer")]


def med(xs):
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


def f(x, spec=".1f"):
  return "n/a" if x is None else format(x, spec)


def main(out: str):
  print("| run | step s | rollout s | update s | first step done s | wall s | peak RSS MiB | schedule s/step "
        "| set-up s | recalibrate s | calibrations | probe compiles | plans from step | guard |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
  rows = {}
  for key, name in RUNS:
    path = os.path.join(out, key, "summary.json")
    if not os.path.exists(path):
      print(f"| {name} | (no summary) ||||||||||||")
      continue
    with open(path) as fh:
      s = json.load(fh)
    steps, body = s["steps"], s["steps"][1:] or s["steps"]
    mpath = os.path.join(out, key, "run", "metrics.jsonl")
    if os.path.exists(mpath):  # the trainer's own rows carry what the peer's summary leaves out (alloc/*)
      with open(mpath) as fh:
        full = {m["step"]: m for m in map(json.loads, fh)}
      steps = [{**full.get(st["step"], {}), **st} for st in steps]
      body = steps[1:] or steps
    first = steps[0].get("time/elapsed_s")  # TRL's script reports no clock from its start: n/a
    warm = [st.get("alloc/warmup") for st in steps]
    plans_from = next((i + 1 for i, st in enumerate(steps) if st.get("alloc/warmup") == 0
                       and not st.get("alloc/guard_gc")), None) if key.startswith("hilore") else None
    guard = "GC" if any(st.get("alloc/guard_gc") for st in steps) else ("" if key.startswith("hilore") else "")
    r = {"step": med([st["step_s"] for st in body]), "rollout": med([st["rollout_s"] for st in body]),
         "update": med([st["update_s"] for st in body]), "first": first, "wall": s["wall_s"]["total"],
         "rss": s["peak_rss_mib"], "schedule": med([st.get("time/schedule_s") for st in body]),
         "setup": sum(st.get("time/memory_setup_s") or 0 for st in steps), "warm": warm,
         "recal": sum(st.get("time/recalibrate_s") or 0 for st in steps),
         # this run's calibrations (set-up's and drift's) and probe compiles, as its last row counts them
         "cals": steps[-1].get("memory/calibrations"), "probes": steps[-1].get("compile/probes")}
    rows[key] = r
    print(f"| {name} | {f(r['step'])} | {f(r['rollout'])} | {f(r['update'])} | {f(r['first'], '.0f')} | "
          f"{f(r['wall'], '.0f')} | {f(r['rss'], '.0f')} | {f(r['schedule'], '.3f')} | {f(r['setup'], '.0f')} | "
          f"{f(r['recal'], '.0f')} | {f(r['cals'], '.0f')} | {f(r['probes'], '.0f')} | {f(plans_from, 'd')} | "
          f"{guard} |")
  trl = rows.get("trl")
  if trl:
    print("\nAgainst TRL (ratio of medians; < 1 is faster than TRL):")
    for key, name in RUNS[:-1]:
      if key in rows:
        r = rows[key]
        print(f"  {name}: step {r['step'] / trl['step']:.2f}x, rollout {r['rollout'] / trl['rollout']:.2f}x, update "
              f"{r['update'] / trl['update']:.2f}x, wall {r['wall'] / trl['wall']:.2f}x, peak RSS "
              f"{r['rss'] / trl['rss']:.2f}x")
  for phase in ("cold", "warm"):
    h, g = rows.get(f"hilore-{phase}"), rows.get(f"gc-{phase}")
    if h and g:
      print(f"hilore / gc, {phase}: step {h['step'] / g['step']:.3f}x, update {h['update'] / g['update']:.3f}x, "
            f"wall {h['wall'] / g['wall']:.3f}x")
  for key, _ in RUNS:
    path = os.path.join(out, key, "run", "metrics.jsonl")
    if os.path.exists(path):
      with open(path) as fh:
        st = [json.loads(line) for line in fh]
      print(f"{key} per step: update s {[round(x['time/update_s'], 1) for x in st]}, rollout s "
            f"{[round(x['time/rollout_s'], 1) for x in st]}, warm-up {[x.get('alloc/warmup') for x in st]}, guard GC "
            f"{[x.get('alloc/guard_gc') for x in st]}, XLA compiles {[x.get('compile/xla_count') for x in st]}, cache "
            f"hits {[x.get('compile/cache_hits') for x in st]}, reward {[round(x['reward/mean'], 3) for x in st]}")


if __name__ == "__main__":
  main(sys.argv[1])
