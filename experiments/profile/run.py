"""`python -m experiments.profile.main`: where each memory plan's actor update spends its time on this machine.

The bench's plans (GC, No-GC and the partial plans: rebuilt from a bench run's results.json when its rows carry
their policies, else planned again from the same seed and config) and two controls, GC and No-GC without the layer
scan (`projection.unrolled`: the same computation, every layer a plain call). Each plan's train step
(gradient program, then update program) is timed untraced in interleaved rounds, then run `reps` times under
`jax.profiler.trace` and broken down per op and category (experiments/profile/ops.py). Beside the measurements: XLA's
cost analysis of both programs (loop bodies counted once) and of the plan with its loops unrolled
(capacity/projection.py), compiled temp bytes, the jaxpr's matmul FLOPs and the cost model's predicted rerun seconds.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import time

import jax
import numpy as np

from hilore_jax import model, sharding
from hilore_jax.loop import engine
from hilore_jax import stats
from experiments.profile import hlo as hlo_ops, ops as op_profile, report as profile_report
from experiments.bench import run
from experiments.common import engines, timing
from hilore_jax.capacity import flops, projection, synthetic
from experiments.common.config import BenchConfig
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError
from hilore_jax.rl import train_step

CONTROLS = {"gc_unrolled": "gc", "none_unrolled": "none"}  # control -> the plan whose layers it unrolls
PROGRAMS = {"jit_grad_program": "grad", "jit_update_program": "update"}  # engine.Stepper's jitted functions


@dataclasses.dataclass
class Plan:
  """One profiled program pair: its label, compiled step and the bench's figures about it."""

  label: str
  method: str
  budget_ratio: float | None
  spec: train_step.StepSpec
  compiled: engine.Step
  row: dict  # the bench row: measured figures too when it came from results.json
  control: bool = False
  same_as: list = dataclasses.field(default_factory=list)  # other methods whose plan is this very program


def label(method: str, ratio: float | None) -> str:
  return method if ratio is None else f"{method}@{ratio:g}"


def policies_of(row: dict) -> tuple[model.LayerPolicy, ...]:
  """A results row's per-layer policies (run.py writes them as dicts)."""
  return tuple(model.LayerPolicy(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
               for d in row["policies"])


def check_results(cfg: Config, bc: BenchConfig, results: dict):
  """ConfigError unless the results were measured on this config's model, seed and minibatch shape."""
  saved = results["config"]
  now = {**cfg.to_dict(), "bench": dataclasses.asdict(bc)}
  keys = [("seed",), ("model",), ("grpo",), ("train", "logprob_chunk")] + [
      ("bench", k) for k in ("batch_size", "group_size", "seq_len", "prompt_len", "zero_adv_frac", "logp_noise")]
  differ = []
  for path in keys:
    a, b = saved, now
    for k in path:
      a, b = (a or {}).get(k), (b or {}).get(k)
    if a != b:
      differ.append(".".join(path))
  if differ:
    raise ConfigError(f"--results was measured with other {', '.join(differ)} than this config: pass the config "
                      "and overrides the bench ran with")


def _bench_batch(cfg: Config, bc: BenchConfig, mcfg, params, spec, mesh):
  """The bench's timed minibatch: the first one drawn from cfg.seed (run.prepare draws it first too)."""
  rng = np.random.default_rng(cfg.seed)
  b = synthetic.grpo_batch(mcfg, params, rng, bc.batch_size, bc.prompt_len, bc.seq_len - bc.prompt_len,
                           bc.group_size, bc.zero_adv_frac, bc.logp_noise)
  return jax.device_put(b if spec.use_ref_logp else b.replace(ref_logp=None), sharding.batch_sharding(mesh))


def configure(cfg: Config, bc: BenchConfig, results: dict | None, progress=print):
  """(engine, state, batch, plans): from results' rows when they carry policies, else planned as the bench plans."""
  rows = [r for r in (results or {}).get("rows", []) if r["method"] != run.CONTROL]
  if rows and all(r.get("policies") for r in rows):
    progress(f"profile: {len(rows)} plans rebuilt from results.json")
    mcfg = engine.model_config(cfg)
    eng, state = engines.build(cfg, mcfg)
    spec = synthetic.step_spec(mcfg, cfg.grpo, cfg.train.logprob_chunk, bc.seq_len - bc.prompt_len)
    batch = _bench_batch(cfg, bc, mcfg, state["params"], spec, eng.mesh)
    plans = []
    for r in rows:
      spec_m = dataclasses.replace(spec, policies=policies_of(r))
      step = eng.stepper.get(spec_m, batch, reason="profile")
      same = r.get("peak_bytes") is None or step.peak_bytes == r["peak_bytes"]  # the same program, compiled here
      plans.append(Plan(label(r["method"], r["budget_ratio"]), r["method"], r["budget_ratio"], spec_m, step,
                        {**r, "plan_source": "results", "matches_results": same}))
    return eng, state, batch, plans
  progress("profile: planning as the bench does (same seed, calibration and budget fit)"
           + (": the results' rows carry no policies" if rows else ""))
  s = run.prepare(cfg, bc, progress)
  entries = run.configure_all(cfg, bc, s, progress)
  saved = {(r["method"], r["budget_ratio"]): r for r in rows}
  plans = []
  for e in entries:
    old = saved.get((e.method, e.budget_ratio))
    same = None if old is None else all(old.get(k) == e.row.get(k) for k in ("peak_bytes", "frac_H", "frac_L",
                                                                              "frac_R"))
    measured = {k: old[k] for k in ("step_s", "gains_pct", "gain_vs_gc_pct", "gain_ci_low", "gain_ci_high")
                if old and same and k in old}
    plans.append(Plan(label(e.method, e.budget_ratio), e.method, e.budget_ratio, e.spec, e.compiled,
                      {**e.row, **measured, "plan_source": "replanned", "matches_results": same}))
  return s.eng, s.state, s.batch, plans


def dedupe(plans: list[Plan]) -> list[Plan]:
  """One plan per distinct program (methods that fell back to GC run GC's): the others listed in same_as."""
  out: list[Plan] = []
  for p in plans:
    first = next((q for q in out if q.spec.policies == p.spec.policies), None)
    if first is None:
      out.append(p)
    else:
      first.same_as.append(p.label)
  return out


def add_controls(stepper: engine.Stepper, plans: list[Plan], batch) -> list[Plan]:
  """GC and No-GC with their layers unrolled: the same computation without the layer scan."""
  out = list(plans)
  for name, base in CONTROLS.items():
    b = next((p for p in plans if p.method == base), None)
    if b is None or len(b.spec.policies) < 2:
      continue
    spec = projection.unrolled(b.spec)
    row = {k: b.row.get(k) for k in ("frac_H", "frac_L", "frac_R", "predicted_rerun_s", "flops")}
    out.append(Plan(name, name, None, spec, stepper.get(spec, batch, reason=f"profile {name}"), row, control=True))
  return out


def figures(p: Plan, stepper: engine.Stepper, batch, params) -> dict:
  """A plan's deterministic figures: XLA's counts, temp bytes, matmul FLOPs, the cost model's prediction."""
  c = p.compiled
  (gf, uf), (gb, ub) = c.program_costs("flops"), c.program_costs("bytes accessed")
  counts, check = projection.counts(stepper, p.spec, batch, params)
  pols = p.spec.policies
  # a run of two or more layers with one policy is a loop (model/layers.py; XLA inlines a loop of one) unless
  # model.scan_layers is off (the controls)
  scans = p.spec.model_cfg.scan_layers and any(end - start > 1 for start, end, _ in model.policy_runs(pols))
  return {"layer_scan": scans,
          "xla_flops": {"grad": gf, "update": uf}, "xla_bytes": {"grad": gb, "update": ub},
          "xla_bytes_unrolled": {"grad": counts.grad_bytes, "update": counts.update_bytes},
          "xla_over_matmul_flops_unrolled": check["xla_over_matmul_flops"],
          "temp_bytes": {"grad": c.grad_temp_bytes, "update": c.update_temp_bytes}, "peak_bytes": c.peak_bytes,
          "matmul_flops": p.row.get("flops") or flops.program_flops(
              lambda q, b: train_step.grads_and_stats(q, b, p.spec)[0], params, batch),
          "predicted_rerun_s": p.row.get("predicted_rerun_s"),
          "frac": {k: p.row.get(f"frac_{k}") for k in "HLR"}}


def trace(p: Plan, state, batch, reps: int, log_dir: str, keep_xplane: bool = False):
  """(state, per-program summaries): reps train steps under the profiler (a warm-up first), broken down per op;
  `host_step_s`: each traced step's wall time around the call, which the programs' traced spans fit inside."""
  step = run.call(p.compiled, batch)
  state = step(state)
  shutil.rmtree(log_dir, ignore_errors=True)
  host = []
  with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=op_profile.profiler_options()):
    for _ in range(reps):
      t0 = time.perf_counter()
      state = step(state)
      host.append(time.perf_counter() - t0)
  path = op_profile.trace_file(log_dir)
  runs = op_profile.attribute(op_profile.op_events(path))
  if not keep_xplane:  # TensorBoard's copy of the same events; the JSON and Perfetto traces stay
    for x in glob.glob(os.path.join(os.path.dirname(path), "*.xplane.pb")):
      os.remove(x)
  ops = {"grad": hlo_ops.hlo_ops(p.compiled.grad.as_text()), "update": hlo_ops.hlo_ops(p.compiled.update.as_text())}
  out: dict = {"host_step_s": host}
  for module, prog in PROGRAMS.items():
    mine = [r for r in runs if r["module"] == module]
    if mine:
      out[prog] = op_profile.summarise(mine, ops[prog])
  other = sorted({r["module"] for r in runs} - set(PROGRAMS))
  if other:
    out["other_modules"] = other
  return state, out


MIN_ROUNDS = 5  # a bootstrap CI of fewer paired rounds is too narrow to call a pair resolved


def pair_resolved(gains_a, gains_b, seed: int = 0) -> dict:
  """a's per-round gain minus b's (points, paired within rounds): mean, CI and which is faster when the CI excludes
  0 (1: a, -1: b) over at least MIN_ROUNDS rounds."""
  d = np.asarray(gains_a, float) - np.asarray(gains_b, float)
  lo, hi = stats.bootstrap_ci(d, seed=seed)
  sign = 1 if lo > 0 else -1 if hi < 0 else 0
  return {"diff_pts": float(d.mean()), "ci": [lo, hi], "rounds": len(d), "faster": sign if len(d) >= MIN_ROUNDS else 0}


def orders(plans: list[dict], measured_key: str, predictors: dict[str, str], seed: int = 0) -> dict:
  """For every pair of plans with per-round gains under measured_key: whether the measurement resolves which is
  faster, and whether each predictor (lower is faster) orders the resolved pairs the same way."""
  have = [p for p in plans if p.get(measured_key)]
  pairs, agree = [], {k: [0, 0, 0] for k in predictors}  # agree, disagree, tie
  for i, a in enumerate(have):
    for b in have[i + 1:]:
      r = pair_resolved(a[measured_key], b[measured_key], seed)
      r["pair"] = [a["label"], b["label"]]
      if r["faster"]:
        fast, slow = (a, b) if r["faster"] > 0 else (b, a)
        for name, key in predictors.items():
          f, s = fast.get(key), slow.get(key)
          if f is None or s is None:
            continue
          verdict = 2 if abs(f - s) <= 1e-12 * max(abs(f), abs(s), 1e-30) else 0 if f < s else 1
          agree[name][verdict] += 1
          r[name] = ("agrees", "disagrees", "tie")[verdict]
      pairs.append(r)
  return {"pairs": pairs, "resolved": sum(1 for r in pairs if r["faster"]),
          "predictors": {k: {"agree": v[0], "disagree": v[1], "tie": v[2]} for k, v in agree.items()}}


PREDICTORS = {"cost model (predicted rerun s)": "predicted_rerun_s", "matmul FLOPs (jaxpr)": "matmul_flops",
              "XLA bytes, loops unrolled": "xla_bytes_unrolled_total",
              "traced bytes (executed thunks, estimate)": "traced_bytes_total",
              "traced step s (measured, profiler on)": "traced_step_s"}


def _bench_figures(row: dict) -> dict:
  """What the bench measured of a plan, where that was this very program (else only where the plan came from)."""
  ok = row.get("matches_results") is not False
  keys = ("step_s", "gain_vs_gc_pct", "gain_ci_low", "gain_ci_high") if ok else ()
  return {"bench": {**{k: row.get(k) for k in keys}, "plan_source": row.get("plan_source"),
                    "matches_results": row.get("matches_results")},
          "bench_gains_pct": row.get("gains_pct") if ok else None}


def run_profile(cfg: Config, bc: BenchConfig, out_dir: str, reps: int = 5, results: dict | None = None,
                keep_xplane: bool = False, progress=print) -> dict:
  """Profile every plan and write profile.json and profile.md into out_dir."""
  if results is not None:
    check_results(cfg, bc, results)
  os.makedirs(out_dir, exist_ok=True)
  eng, state, batch, plans = configure(cfg, bc, results, progress)
  plans = add_controls(eng.stepper, dedupe(plans), batch)
  params = state["params"]
  out = []
  for p in plans:
    progress(f"profile: {p.label}: compile-only counts")
    out.append({"label": p.label, "method": p.method, "budget_ratio": p.budget_ratio, "control": p.control,
                "same_as": p.same_as, **figures(p, eng.stepper, batch, params),
                **_bench_figures(p.row)})
  # untraced, interleaved: the wall time beside the trace (the profiler adds a little per op)
  progress(f"profile: timing {len(plans)} plans untraced, {reps} interleaved rounds")
  rounds = timing.Rounds(reps, 100.0, float("inf"), warmup_rounds=1)
  base = next((i for i, p in enumerate(plans) if p.method == "gc"), None)
  times, state, timed = timing.interleave([run.call(p.compiled, batch) for p in plans], state, rounds, None,
                                          cfg.seed + 1, progress=progress)
  for r, t in zip(out, times):
    r["wall_s"] = t
    r["wall_median_s"] = float(np.median(t))
    r["wall_gains_pct"] = None if base is None else stats.paired_gain_pct(t, times[base]).tolist()
  for p, r in zip(plans, out):
    progress(f"profile: {p.label}: {reps} steps under jax.profiler.trace")
    state, r["trace"] = trace(p, state, batch, reps, os.path.join(out_dir, "traces", p.label), keep_xplane)
    r["traced_step_s"] = sum(r["trace"][k]["span_s"] for k in ("grad", "update") if k in r["trace"])
    r["traced_bytes_total"] = sum(r["trace"][k]["bytes"] for k in ("grad", "update") if k in r["trace"])
    r["xla_bytes_unrolled_total"] = sum(r["xla_bytes_unrolled"].values())
  result = {"machine": run.machine(), "config": {**cfg.to_dict(), "bench": dataclasses.asdict(bc)}, "reps": reps,
            "timing": timed, "plans": out,
            "orders": {"wall (this run, untraced)": orders(out, "wall_gains_pct", PREDICTORS, cfg.seed),
                       "bench (results.json)": orders(out, "bench_gains_pct", PREDICTORS, cfg.seed)}}
  profile_report.write_outputs(result, out_dir)
  return result
