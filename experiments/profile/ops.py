"""Where a compiled program's time goes on XLA:CPU: per-op wall time from a `jax.profiler` trace, each op put in a
category and sized from the program's optimised HLO.

What jax 0.10.2 writes on CPU (`jax.profiler.trace(dir, create_perfetto_trace=True)`): `plugins/profile/<time>/`
holds `<host>.xplane.pb`, `<host>.trace.json.gz` (Chrome trace JSON, read here) and `perfetto_trace.json.gz`.
XLA:CPU's thunk runtime records one complete ("X") event per executed thunk, on the thread that ran it (the PjRt
client thread or the XLA Eigen pool's), named after its HLO instruction (`ynn_fusion.19`, `dot.190`,
`subtract_exponential_fusion.1`, `copy.28`, `while.3`) with args `hlo_op`, `hlo_module` (the jitted function:
`jit_grad_program`) and `run_id` (one per execution), and an `end: <op>` event when its completion callback runs.
A while loop's event spans its iterations; the body's thunks nest inside it on the same thread. In every trace
seen so far each thunk completed inside its own event (`end:` nested in it), so the event's span is the op's wall
time; one that completes later (its work handed to another thread) counts until its `end:` (`async_ops`).

Attribution: each op gets its event's time minus what ops nested in it on the same thread took (a loop keeps only
its own control time); where ops on different threads overlap, the overlap is split evenly between them, so the
ops' times and the gaps no op covers (the executor between thunks: `executor`) add up to the run's span, first
op's start to last op's end. The ops' categories and bytes come from the program's HLO (experiments/profile/hlo.py).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import math
import os
import statistics

import jax

from experiments.profile.hlo import CATEGORIES as OP_CATEGORIES
from experiments.profile.hlo import HloOp

CATEGORIES = OP_CATEGORIES + ("executor",)


def profiler_options() -> jax.profiler.ProfileOptions:
  """Host events only: no Python function events (they only add overhead on the calling thread) and no HLO protos
  in the xplane (megabytes per trace; the HLO is read from the compiled program instead)."""
  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 0
  opts.enable_hlo_proto = False
  return opts


def trace_file(log_dir: str) -> str:
  """The Chrome-trace JSON a jax.profiler.trace(log_dir) session wrote (the newest, if several)."""
  paths = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")))
  if not paths:
    raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {log_dir}: did the profiler run?")
  return paths[-1]


def op_events(path: str) -> list[dict]:
  """The trace's per-op events (complete events carrying an hlo_op), each carrying `end_ts`, when its `end: <op>`
  completion event started (the thunk executor's record that the op's work is done)."""
  with gzip.open(path, "rt") as f:
    events = sorted((e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
  ends = collections.defaultdict(collections.deque)
  for e in events:
    if e["name"].startswith("end: "):
      ends[e["name"][5:]].append(e["ts"])
  ops = []
  for e in events:
    if "hlo_op" in (e.get("args") or {}):
      q = ends[e["name"]]
      while q and q[0] < e["ts"]:
        q.popleft()
      ops.append({**e, "end_ts": q.popleft() if q else None})
  return ops


def _async(e: dict) -> bool:
  """An op whose work finished after its thunk returned (its completion event starts after its own event ends)."""
  return e.get("end_ts") is not None and e["end_ts"] > e["ts"] + e["dur"] + 1.0


def _self_pieces(events: list[dict]) -> list[tuple[float, float, str]]:
  """(start, end, op) pieces of one thread's events, each event's span less what events nested in it cover."""
  out: list[tuple[float, float, str]] = []
  stack: list[list] = []  # [end, op, cursor]: an open event and how far its own time has been handed out

  def close(upto: float):
    while stack and stack[-1][0] <= upto:
      end, op, cur = stack.pop()
      if end > cur:
        out.append((cur, end, op))
      if stack:
        stack[-1][2] = max(stack[-1][2], end)

  for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
    start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
    close(start)
    if stack:
      parent = stack[-1]
      if start > parent[2]:
        out.append((parent[2], start, parent[1]))
      parent[2] = max(parent[2], start)
      end = min(end, parent[0])  # a child never outlives its parent (timestamps are rounded)
    stack.append([end, e["name"], start])
  close(math.inf)
  return out


def _split_overlaps(pieces: list[tuple[float, float, str]]) -> tuple[dict[str, float], float]:
  """(op -> time, the time any op ran): where pieces overlap (other threads) each gets an even share."""
  bounds = sorted({t for a, b, _ in pieces for t in (a, b)})
  starts = collections.defaultdict(list)
  for a, b, op in pieces:
    starts[a].append((b, op))
  active: list[tuple[float, str]] = []
  times: dict[str, float] = collections.defaultdict(float)
  busy = 0.0
  for t0, t1 in zip(bounds, bounds[1:]):
    active = [(b, op) for b, op in active if b > t0] + starts.get(t0, [])
    if active:
      busy += t1 - t0
      for _, op in active:
        times[op] += (t1 - t0) / len(active)
  return dict(times), busy


def attribute(events: list[dict]) -> list[dict]:
  """One record per execution (run_id) of a module, in time order: its span, the time any op ran, and each op's
  attributed time and execution count (seconds)."""
  runs = collections.defaultdict(list)
  for e in events:
    runs[(e["args"]["hlo_module"], e["args"]["run_id"])].append(e)
  out = []
  for (module, run_id), evs in runs.items():
    threads = collections.defaultdict(list)
    for e in evs:
      if _async(e):  # its work ran elsewhere until its completion: a lane of its own, split with what overlaps
        threads[("async", e["name"], e["ts"])].append({**e, "dur": e["end_ts"] - e["ts"]})
      else:
        threads[e["tid"]].append(e)
    pieces = [p for t in threads.values() for p in _self_pieces(t)]
    times, busy = _split_overlaps(pieces)
    lanes = [e for t in threads.values() for e in t]
    start = min(e["ts"] for e in lanes)
    span = max(e["ts"] + e["dur"] for e in lanes) - start
    out.append({"module": module, "run_id": run_id, "start_us": start, "span_s": span * 1e-6, "busy_s": busy * 1e-6,
                "op_s": {k: v * 1e-6 for k, v in times.items()},
                "count": dict(collections.Counter(e["name"] for e in evs)),
                "threads": len({e["tid"] for e in evs}), "async_ops": sum(map(_async, evs))})
  return sorted(out, key=lambda r: r["start_us"])


def summarise(runs: list[dict], ops: dict[str, HloOp]) -> dict:
  """Per-run means over a program's executions: span, ops (time, executions, category, bytes), time and bytes by
  category; `executor` is the span no op covered, so the categories add up to the span."""
  n = len(runs)
  names = sorted({k for r in runs for k in r["op_s"]} | {k for r in runs for k in r["count"]})
  rows = []
  for name in names:
    op = ops.get(name)
    count = sum(r["count"].get(name, 0) for r in runs) / n
    rows.append({"op": name, "category": op.category if op else "other", "opcode": op.opcode if op else None,
                 "time_s": sum(r["op_s"].get(name, 0.0) for r in runs) / n, "executions": count,
                 "bytes": (op.bytes * count) if op else 0.0, "fused": list(op.fused) if op else []})
  rows.sort(key=lambda r: -r["time_s"])
  span = sum(r["span_s"] for r in runs) / n
  by_cat = {c: {"time_s": 0.0, "bytes": 0.0, "ops": 0} for c in CATEGORIES}
  for r in rows:
    by_cat[r["category"]]["time_s"] += r["time_s"]
    by_cat[r["category"]]["bytes"] += r["bytes"]
    by_cat[r["category"]]["ops"] += 1
  by_cat["executor"]["time_s"] = span - sum(r["busy_s"] for r in runs) / n
  return {"runs": n, "span_s": span, "span_median_s": statistics.median(r["span_s"] for r in runs),
          "ops_s": sum(r["time_s"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
          "threads": max(r["threads"] for r in runs), "async_ops": sum(r["async_ops"] for r in runs) / n,
          "unknown_ops": [r["op"] for r in rows if r["opcode"] is None], "by_category": by_cat, "ops": rows}
