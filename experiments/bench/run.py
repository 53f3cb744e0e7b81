"""The memory-method benchmark: every method's actor update (GRPO loss, backward, optimizer) on the same synthetic
minibatch, model and budget rule, timed in interleaved rounds until the gains are known to a set precision, beside a
control (GC's program compiled a second time: the run's noise floor) and deterministic figures (matmul FLOPs, the
cost model's predicted rerun time, compiled peak, optionally a roofline projection), with gradient errors against
the exact gradient; risk diagnostics only when asked for."""

from __future__ import annotations

import dataclasses
import os
import platform
import time

import jax
import numpy as np

from hilore_jax import model, sharding, stats
from hilore_jax.loop import engine, step_hooks
from hilore_jax.capacity import flops, projection, roofline, synthetic
from experiments.bench import report, unit_risk
from experiments.common import engines, timing
from experiments.common.config import BenchConfig
from hilore_jax.config import Config
from hilore_jax.memory import MemoryManager, calibration, methods, profile, riskfit
from hilore_jax.rl import train_step

ROW_KEYS = ("method", "budget_ratio", "peak_bytes", "tokens_per_s", "gain_vs_gc_pct", "gain_ci_low", "gain_ci_high",
            "active_constraint", "solver", "grad_rel_err_mean", "grad_rel_err_max", "grad_cos", "frac_H", "frac_L",
            "frac_R", "schedule_overhead_pct", "compiles", "flops", "xla_flops", "bytes_accessed", "predicted_rerun_s",
            "beats_floor")
CONTROL = "gc_control"


@dataclasses.dataclass
class Entry:
  """One (method, budget) configuration: its compiled step and what was measured about it."""

  method: str
  budget_ratio: float | None
  spec: train_step.StepSpec
  compiled: object
  row: dict
  schedule_s: float = 0.0
  times: list = dataclasses.field(default_factory=list)


def machine() -> dict:
  dev = jax.devices()[0]
  return {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
          "backend": jax.default_backend(), "device": dev.device_kind, "devices": jax.device_count(),
          "cpus": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def control_step(eng: engine.Engine, state, cfg: Config, spec, batch) -> engine.Step:
  """spec's step compiled again, on its own: the control's program is GC's, its executables are not."""
  # a fresh Stepper builds new jax.jit wrappers of new functions for both programs (gradient and update), and JAX's
  # in-memory caches key on those functions and on the traced jaxpr and lowered module objects, so none can hand
  # back the first compilation's executables. With the persistent compilation cache on, XLA's binary may be loaded
  # from disk rather than rebuilt: still a separately loaded executable of the same program
  stepper = engine.Stepper(eng.mesh, eng.optimizer, state, eng.state_shardings, cfg.optimizer.kl_control)
  return stepper.get(spec, batch, reason=f"bench {CONTROL}")


def call(compiled: engine.Step, batch):
  """compiled's train step on batch as a function of the state, blocking until its results are ready."""
  def step(state):
    state, m = compiled(state, batch)
    jax.block_until_ready((state, m))
    return state
  return step


def _median_s(fn, reps: int = 50) -> float:
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


@dataclasses.dataclass
class Setup:
  """What every configuration of one bench run shares: engine and state, the step, the minibatches (the timed one,
  calibration's, the held-out ones), their exact gradients, the calibration and the cost model's end plans."""

  eng: engine.Engine
  state: dict
  spec: train_step.StepSpec
  hooks: object
  batch: object
  cal_batches: list
  risk_batches: list
  err_batches: list  # the timed minibatch and the held-out ones
  exact: list  # the exact gradient of each of err_batches
  calib: object
  predicted: dict  # the cost model's seconds of No-GC and GC
  setup_s: dict


def prepare(cfg: Config, bc: BenchConfig, progress=print) -> Setup:
  """The run's engine, minibatches (drawn from cfg.seed), exact gradients and calibration."""
  mcfg = engine.model_config(cfg)
  eng, state = engines.build(cfg, mcfg)
  mesh, stepper = eng.mesh, eng.stepper
  completion = bc.seq_len - bc.prompt_len
  spec = synthetic.step_spec(mcfg, cfg.grpo, cfg.train.logprob_chunk, completion)
  hooks = step_hooks.memory_hooks(stepper, spec)
  rng = np.random.default_rng(cfg.seed)
  K = cfg.memory.calib_batches
  progress(f"bench: building {1 + K + bc.risk_batches} synthetic GRPO minibatches of {bc.batch_size} x {bc.seq_len}")
  batches = [synthetic.grpo_batch(mcfg, state["params"], rng, bc.batch_size, bc.prompt_len, completion, bc.group_size,
                                  bc.zero_adv_frac, bc.logp_noise) for _ in range(1 + K + bc.risk_batches)]
  if not spec.use_ref_logp:
    batches = [b.replace(ref_logp=None) for b in batches]
  batches = [jax.device_put(b, sharding.batch_sharding(mesh)) for b in batches]
  batch, cal_batches, risk_batches = batches[0], batches[1:1 + K], batches[1 + K:]
  params, setup_s = state["params"], {}
  # the reference: full checkpointing in float32 whatever the compute dtype, on the timed and held-out batches
  ref_hooks = step_hooks.memory_hooks(stepper, dataclasses.replace(spec, model_cfg=mcfg.replace(dtype="float32")))
  exact = [calibration.exact_gradient(ref_hooks, params, b, probe=False) for b in [batch] + risk_batches]
  calib = None
  if any(m in methods.CALIBRATED for m in bc.methods):
    mc = cfg.memory
    progress(f"bench: calibrating risk on {K} batches (per-unit gradient errors; memory.calib_rows={mc.calib_rows}, "
             f"memory.calib_layers={mc.calib_layers})")
    t1 = time.perf_counter()
    m0 = MemoryManager(dataclasses.replace(cfg.memory, policy="hilore"), hooks)
    m0.setup(params, cal_batches, 0)
    calib = m0.state.calibration
    setup_s["calibration"] = time.perf_counter() - t1
    progress(f"bench: calibration took {setup_s['calibration']:.0f}s, delta {calib.delta:.3g}, "
             f"measured {calib.calibration_error:.3g}")
  return Setup(eng, state, spec, hooks, batch, cal_batches, risk_batches, [batch] + risk_batches, exact, calib,
               _end_plans(cfg, hooks, batch), setup_s)


def configure_all(cfg: Config, bc: BenchConfig, s: Setup, progress=print) -> list[Entry]:
  """Every (method, budget) configuration, planned and compiled in bc.methods' order (none and GC once)."""
  entries: list[Entry] = []
  for method in bc.methods:
    for ratio in ([None] if method in ("none", "gc") else bc.budget_ratios):
      entries.append(_configure(cfg, method, ratio, s.spec, s.hooks, s.eng.stepper, s.state["params"], s.batch,
                                s.calib, s.err_batches, s.exact, s.predicted))
      e = entries[-1]
      progress(f"bench: {method} @ {ratio}: peak {e.row['peak_bytes'] / 2**20:.1f} MiB, H/L/R "
               f"{e.row['frac_H']:.2f}/{e.row['frac_L']:.2f}/{e.row['frac_R']:.2f}, "
               f"grad err {e.row['grad_rel_err_mean']:.2e}")
  return entries


def run(cfg: Config, bc: BenchConfig, out_dir: str, progress=print) -> dict:
  """Run the benchmark and write results.json, results.md, frontier.png (and risk.md when asked) into out_dir."""
  os.makedirs(out_dir, exist_ok=True)
  t0 = time.perf_counter()
  s = prepare(cfg, bc, progress)
  eng, state, stepper, hooks, batch, params = s.eng, s.state, s.eng.stepper, s.hooks, s.batch, s.state["params"]
  mcfg, calib, setup_s, exact = hooks.model_cfg, s.calib, s.setup_s, s.exact
  t1 = time.perf_counter()
  entries = configure_all(cfg, bc, s, progress)
  gc = next((e for e in entries if e.method == "gc"), None)
  if gc is not None:  # the control: GC's program in its own executables, timed like any other row
    step = control_step(eng, state, cfg, gc.spec, batch)
    entries.append(Entry(CONTROL, None, gc.spec, step, {**gc.row, "method": CONTROL, "compiles": 1,
                                                        "probe_compiles": 0, "control": True}))
  setup_s["configure"] = time.perf_counter() - t1

  # before timing: the timed steps donate (and so delete) the parameters they are given
  t1 = time.perf_counter()
  mc, units = cfg.memory, calibration.lowp_units(mcfg.num_hidden_layers, cfg.memory.lowp_kinds)
  all_l = calibration.lowp_policies(mcfg.num_hidden_layers, units, mc.group_size, mc.lowp_format)
  by = {e.method: e for e in entries}
  regime = {"tolerance": mc.grad_err_tolerance, "lowp_format": mc.lowp_format,
            "nogc_over_gc_temp": (by["none"].row["peak_bytes"] / by["gc"].row["peak_bytes"]
                                  if {"none", "gc"} <= set(by) else None),
            "all_l_grad_err": float(np.mean([calibration.relative_error(hooks.gradient(params, b, all_l), ref)
                                             for b, ref in zip(s.err_batches, exact)]))}
  progress(f"bench: regime {regime}")
  risk_rows, risk_fit = _diagnostics(cfg, bc, hooks, params, calib, s.cal_batches, s.risk_batches, exact[1:],
                                       progress)
  setup_s["diagnostics"] = time.perf_counter() - t1
  if bc.roofline:
    t1 = time.perf_counter()
    progress(f"bench: roofline projection for one {roofline.H200.name} (compile-only, one compile per plan)")
    for e in entries:
      if e.method != CONTROL:
        e.row.update(projection.project_row(*projection.counts(stepper, e.spec, batch, params)))
    roofline.add_gains([e.row for e in entries if e.method != CONTROL])
    setup_s["projection"] = time.perf_counter() - t1
  setup_s["before_timing"] = time.perf_counter() - t0

  rounds = timing.Rounds(bc.reps, bc.ci_halfwidth_pct, bc.time_cap_s, bc.warmup_rounds, bc.pause_python_gc)
  progress(f"bench: timing {len(entries)} configurations, interleaved: at least {bc.reps} rounds, then until every "
           f"gain CI is within +/-{bc.ci_halfwidth_pct:g} points or {bc.time_cap_s:g} s")
  base = next((i for i, e in enumerate(entries) if e.method == "gc"), None)
  times, state, timed = timing.interleave([call(e.compiled, batch) for e in entries], state, rounds, base, cfg.seed + 1,
                                          progress=progress)
  progress(f"bench: {timed['rounds']} rounds in {timed['elapsed_s']:.0f}s, stopped by {timed['stopped_by']}")
  for e, t in zip(entries, times):
    e.times = t
  floor = _summarise(entries, gc, bc.batch_size * bc.seq_len, cfg.seed)
  result = {"machine": machine(), "config": {**cfg.to_dict(), "bench": dataclasses.asdict(bc)},
            "rows": [e.row for e in entries], "regime": regime, "noise_floor_pct": floor, "timing": timed,
            "setup_s": setup_s, "projection": projection.device_info() if bc.roofline else None,
            "calibration": dataclasses.asdict(calib) if calib else None, "risk": risk_rows, "risk_fit": risk_fit}
  report.write_outputs(result, out_dir)
  return result


def _summarise(entries: list[Entry], gc: Entry | None, tokens: int, seed: int) -> dict | None:
  """Each row's time, throughput and paired gain over GC; the control's noise floor and which rows beat it."""
  # deterministic companion of the timings: the share of GC's extra (recompute) FLOPs a plan removes
  f_gc = gc.row["flops"] if gc else None
  f_none = next((e.row["flops"] for e in entries if e.method == "none"), None)
  for e in entries:
    step_s = float(np.median(e.times))
    e.row["step_s"] = step_s
    e.row["tokens_per_s"] = tokens / step_s
    if gc is not None:  # per-round ratios to GC, paired within the round they were interleaved in
      gains = stats.paired_gain_pct(e.times, gc.times)
      lo, hi = stats.bootstrap_ci(gains, seed=seed)
      e.row.update(gain_vs_gc_pct=float(np.mean(gains)), gain_ci_low=lo, gain_ci_high=hi,
                   gains_pct=[float(g) for g in gains])
    e.row["schedule_overhead_pct"] = 100 * e.schedule_s / step_s
    if f_gc is not None and f_none is not None and f_gc > f_none:
      e.row["recompute_removed_pct"] = 100 * (f_gc - e.row["flops"]) / (f_gc - f_none)
  control = next((e for e in entries if e.method == CONTROL), None)
  # rows the stepper gave one executable (the same plan) measure noise too
  floor = None if control is None else stats.run_floor(control.row["gains_pct"], [
      (f"{e.method}@{e.budget_ratio}", id(e.compiled), e.row["gains_pct"]) for e in entries
      if e.method != CONTROL and "gains_pct" in e.row], seed)
  for e in entries:
    e.row["beats_floor"] = e.method not in ("gc", CONTROL) and stats.beats_floor(e.row.get("gain_ci_low"), floor)
  return floor


def _end_plans(cfg: Config, hooks, batch) -> dict:
  """The cost model's predicted rerun + codec seconds of No-GC and GC, from the profile the managers plan with."""
  rows, seq = hooks.batch_shape(batch)
  mc, mcfg = cfg.memory, hooks.model_cfg
  prof = profile.profile_ops(mcfg, rows, seq, mc.group_size)
  units = profile.enumerate_units(mcfg, rows, seq, mc.group_size, prof, mc.lowp_format)
  return {m: methods.plan(m, units, prof["ops"], 0).time_s for m in ("none", "gc")}


def _diagnostics(cfg, bc, hooks, params, calib, cal_batches, risk_batches, exact, progress) -> tuple[dict, dict]:
  """The set-risk fit (bench.risk_sets) and the per-unit risk table (bench.unit_risk_table): only when asked."""
  risk_rows, risk_fit = {}, {}
  if not risk_batches or calib is None:
    return risk_rows, risk_fit
  mc, units = cfg.memory, calibration.lowp_units(hooks.model_cfg.num_hidden_layers, cfg.memory.lowp_kinds)
  if bc.risk_sets:
    # the set-risk model as the allocator uses it: calibration's per-unit errors and coherence, predicting the
    # measured error of random L sets on held-out batches
    progress(f"bench: set-risk fit on {bc.risk_sets} random L sets x {len(risk_batches)} held-out batches")
    sets = riskfit.random_sets(len(units), bc.risk_sets, np.random.default_rng(cfg.seed + 2))
    set_err = np.stack([calibration.set_errors(hooks, params, b, units, sets, mc.group_size, mc.lowp_format, ref)
                        for b, ref in zip(risk_batches, exact)])
    static = np.asarray(calib.static_error)
    risk_fit = {"coherence": calib.coherence, "calibration": calib.set_fit,
                "held_out": riskfit.set_fit(static, sets, set_err.mean(0), calib.coherence),
                "set_sizes": [len(s) for s in sets], "measured": set_err.mean(0).tolist(),
                "predicted_linear": [calib.coherence * float(static[s].sum()) for s in sets]}
  if bc.unit_risk_table:
    progress(f"bench: per-unit risk-prediction table on {len(risk_batches)} held-out batches")
    err_ev = np.stack([calibration.measure_unit_errors(hooks, params, b, units, mc.group_size, mc.lowp_format, ref)
                       for b, ref in zip(risk_batches, exact)])
    risk_rows = unit_risk.risk_report(hooks, params, cal_batches, risk_batches, units, mc.group_size,
                                        mc.lowp_format, err_cal=np.asarray(calib.unit_errors), err_ev=err_ev)
  return risk_rows, risk_fit


def _configure(cfg, method, ratio, spec, hooks, stepper, params, batch, calib, err_batches, exact,
               predicted: dict) -> Entry:
  """Plan, compile and measure one (method, budget) configuration."""
  mcfg = spec.model_cfg
  sched, floor_plan = 0.0, None
  before, probes = stepper.compile_count, stepper.probe_compiles
  if method in ("none", "gc"):
    pol = model.NO_REMAT if method == "none" else model.FULL_REMAT
    spec_m = dataclasses.replace(spec, policies=model.uniform(mcfg.num_hidden_layers, pol))
    fr = {"frac_H": 1.0 if method == "none" else 0.0, "frac_L": 0.0, "frac_R": 0.0 if method == "none" else 1.0}
    budget, active, gap, rerun_s = None, "none", None, predicted[method]
  else:
    mc = cfg.memory.at_budget(ratio, method)
    mm = MemoryManager(mc, hooks)
    mm.setup(params, [batch], 0, calibration_state=calib)
    (alloc,) = mm.allocate([batch])
    spec_m = dataclasses.replace(spec, policies=alloc.policies)
    fr = {k: alloc.metrics[f"alloc/{k}"] for k in ("frac_H", "frac_L", "frac_R")}
    budget, active = alloc.metrics["memory/budget_bytes"], alloc.active_constraint
    gap = 100 * alloc.metrics["alloc/greedy_gap"] if method in methods.SOLVED else None
    rerun_s, floor_plan = alloc.plan.time_s, alloc.bucket in mm.state.risk_free
    # what a training step pays to choose its policy once compiled: exposure level + cached plan lookup
    sched = _median_s(lambda: mm.allocate([batch]))
  compiled = stepper.get(spec_m, batch, reason=f"bench {method} @ {ratio}")
  compiles = stepper.compile_count - before
  errs, coss = [], []
  for b, ref in zip(err_batches, exact):
    g = hooks.gradient(params, b, spec_m.policies)
    errs.append(calibration.relative_error(g, ref))
    coss.append(calibration.cosine(g, ref))
  row = {"method": method, "budget_ratio": ratio, "peak_bytes": int(compiled.peak_bytes), "budget_bytes": budget,
         "tokens_per_s": None, "gain_vs_gc_pct": None, "gain_ci_low": None, "gain_ci_high": None,
         "active_constraint": active, "greedy_gap_pct": gap,
         "solver": (cfg.memory.solver if method in methods.SOLVED else "none" if method in ("none", "gc") else
                    "heuristic"),
         "grad_rel_err_mean": float(np.mean(errs)), "grad_rel_err_max": float(np.max(errs)),
         "grad_cos": float(np.min(coss)), **fr, "schedule_overhead_pct": None,
         "same_as_gc": method != "none" and all(p == model.FULL_REMAT for p in spec_m.policies),
         "compiles": compiles, "probe_compiles": stepper.probe_compiles - probes,
         "flops": flops.program_flops(lambda p, b: hooks.gradient(p, b, spec_m.policies), params, batch),
         "xla_flops": compiled.flops, "bytes_accessed": compiled.bytes_accessed,
         # the cost model's prediction (what the solvers minimise): rerun + codec seconds above No-GC's step
         "predicted_rerun_s": rerun_s,
         "predicted_removed_pct": (100 * (predicted["gc"] - rerun_s) / (predicted["gc"] - predicted["none"])
                                   if predicted["gc"] > predicted["none"] else None),
         "risk_free_floor": floor_plan, "beats_floor": None,
         "policies": [dataclasses.asdict(p) for p in spec_m.policies]}  # to rebuild the plan (bench_profile)
  return Entry(method, ratio, spec_m, compiled, row, sched)
