"""A pretrained model's memory and L error: every method's compiled peak at fixed token shapes (compile only), the
breakdown of a step's bytes and LoGRA's state there; each unit kind's gradient error as L (int8, fp8, int4) on the
model's own rollouts, beside a tiny random model's on synthetic minibatches; and what the manager's set-up costs.

Compile-only figures are deterministic (XLA's memory analysis of the programs the trainer would run). Allocations at
the large shapes take their unit risks from the calibration on the rollouts (the shape a run calibrates on), with
exposure off (one static bucket): the table is about bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model
from hilore_jax.loop import engine, step_hooks
from hilore_jax.capacity import synthetic
from experiments.common.config import RealBenchConfig
from experiments.common import engines
from experiments.common.engines import nbytes
from hilore_jax.config import Config
from hilore_jax.memory import MemoryManager, calibration
from hilore_jax.rl import train_step
from hilore_jax.rl.update_batch import UpdateBatch

log = logging.getLogger(__name__)
MiB = 2**20


def parse_shape(text: str) -> tuple[int, int]:
  """'8x1024' -> (rows, tokens per row)."""
  rows, seq = text.lower().split("x")
  return int(rows), int(seq)


def abstract_batch(rows: int, seq: int, prompt_fraction: float, with_ref: bool) -> UpdateBatch:
  """Shapes of an update minibatch of rows x seq tokens (old log-probs carried; reference ones with a KL term)."""
  P = max(1, int(round(seq * prompt_fraction)))
  N = seq - P
  i32 = lambda *s: jax.ShapeDtypeStruct(s, np.int32)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, np.float32)
  return UpdateBatch(i32(rows, P), i32(rows, P), i32(rows, N), i32(rows, N), f32(rows), old_logp=f32(rows, N),
                     on_policy=i32(rows), ref_logp=f32(rows, N) if with_ref else None)


def rollout_minibatches(trainer, count: int) -> list:
  """`count` update minibatches of the policy's own rollouts, old and reference log-probs filled in, no update."""
  out, step = [], 0
  while len(out) < count and step < 8 * count:
    roll = trainer.next_rollout()
    plan = trainer.plan_update(roll, np.random.default_rng([trainer.config.seed, step]), step)
    out += trainer.add_logprobs(plan).batches
    step += 1
  return out[:count]


# ----------------------------------------------------------------------------- L error


def l_error_rows(hooks, params_of, batches, units, formats, group_size: int, layers) -> dict:
  """Per format: per-kind median of the measured units' relative gradient errors (each unit alone as L), and every
  unit L at once, over the minibatches (params_of(i): the params minibatch i is measured at)."""
  out = {}
  for fmt in formats:
    per_kind: dict[str, list[float]] = {}
    all_l = []
    for i, b in enumerate(batches):
      p = params_of(i)
      exact = calibration.exact_gradient(hooks, p, b, fmt, group_size)
      if float(calibration.norm(exact)) == 0:
        continue
      chosen = [j for j, (layer, _) in enumerate(units) if layers is None or layer in layers]
      err = calibration.set_errors(hooks, p, b, units, [[j] for j in chosen], group_size, fmt, exact)
      for j, e in zip(chosen, err):
        per_kind.setdefault(units[j][1], []).append(float(e))
      all_l.append(float(calibration.set_errors(hooks, p, b, units, [list(range(len(units)))], group_size, fmt,
                                                exact)[0]))
    out[fmt] = {"per_kind_median": {k: float(np.median(v)) for k, v in per_kind.items()},
                "per_kind_max": {k: float(np.max(v)) for k, v in per_kind.items()},
                "all_l": float(np.median(all_l)) if all_l else float("nan"), "minibatches": len(all_l)}
  return out


def tiny_l_error(cfg: Config, br: RealBenchConfig, formats) -> dict:
  """The same measurement on the tiny random model of configs/bench_binding.yaml's shape, synthetic minibatches."""
  tiny = model.ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2)
  params = model.init_params(tiny, jax.random.PRNGKey(cfg.seed), 0.05)
  spec = train_step.StepSpec(tiny, dataclasses.replace(cfg.grpo, max_completion_len=384),
                             model.uniform(6, model.NO_REMAT), 1, 128, use_old_logp=True)
  hooks = step_hooks.memory_hooks(None, spec)
  rng = np.random.default_rng(cfg.seed)
  batches = [synthetic.grpo_batch(tiny, params, rng, 4, 128, 384, 2).replace(ref_logp=None)
             for _ in range(br.lerror_minibatches)]
  return l_error_rows(hooks, lambda i: params, batches, calibration.lowp_units(6), formats, cfg.memory.group_size,
                      None)


# ----------------------------------------------------------------------------- memory


def memory_rows(cfg: Config, br: RealBenchConfig, ratios, cal, progress=print) -> list[dict]:
  """Every (shape, method, budget): compiled peak, the plan's H/L/R shares and the step's byte breakdown."""
  mcfg = engine.model_config(cfg)
  eng, state = engines.build(cfg, mcfg, abstract=True)
  rows = []
  for text in br.shapes:
    B, T = parse_shape(text)
    batch = abstract_batch(B, T, br.prompt_fraction, cfg.grpo.beta > 0)
    N = batch.completion_len
    spec = train_step.StepSpec(mcfg, dataclasses.replace(cfg.grpo, max_completion_len=N),
                               model.uniform(mcfg.num_hidden_layers, model.NO_REMAT), 1, cfg.train.logprob_chunk,
                               use_old_logp=True, use_ref_logp=cfg.grpo.beta > 0)
    hooks = step_hooks.memory_hooks(eng.stepper, spec)
    base = {"shape": text, "params_bytes": nbytes(state["params"]), "opt_state_bytes": nbytes(state["opt_state"]),
            # one chunk's float32 logits and their gradient are what the chunked log-prob holds at a time
            "logits_chunk_bytes": 2 * B * min(cfg.train.logprob_chunk, N) * mcfg.vocab_size * 4}
    for method in br.methods:
      for ratio in ([None] if method in ("none", "gc") else ratios):
        t0 = time.perf_counter()
        if method in ("none", "gc"):
          pols = model.uniform(mcfg.num_hidden_layers, model.NO_REMAT if method == "none" else model.FULL_REMAT)
          fr, budget = {"frac_H": float(method == "none"), "frac_L": 0.0, "frac_R": float(method == "gc")}, None
        else:
          mc = dataclasses.replace(cfg.memory.at_budget(ratio, method), buckets=1)
          mm = MemoryManager(mc, hooks)
          mm.setup(None, [batch], 0, calibration_state=cal)
          (alloc,) = mm.allocate([batch])
          pols, budget = alloc.policies, mm.state.budget_bytes
          fr = {k: alloc.metrics[f"alloc/{k}"] for k in ("frac_H", "frac_L", "frac_R")}
        step = eng.stepper.get(dataclasses.replace(spec, policies=pols), batch, count=False)
        row = {**base, "method": method, "budget_ratio": ratio, "budget_bytes": budget, "peak_bytes": step.peak_bytes,
               "grad_bytes": step.grad_bytes, "grad_temp_bytes": step.grad_temp_bytes,
               "update_temp_bytes": step.update_temp_bytes, **fr, "seconds": time.perf_counter() - t0}
        rows.append(row)
        progress(f"memory {text} {method}@{ratio}: peak {row['peak_bytes'] / MiB:.1f} MiB"
                 + (f" (budget {budget / MiB:.1f})" if budget else "") + f", {row['seconds']:.0f}s")
  return rows


def logra_rows(cfg: Config, br: RealBenchConfig, progress=print) -> list[dict]:
  """Optimizer state and update-program temp of AdamW vs LoGRA (rank br.logra_rank) at the first shape, GC plan."""
  mcfg = engine.model_config(cfg)
  B, T = parse_shape(br.shapes[0])
  batch = abstract_batch(B, T, br.prompt_fraction, cfg.grpo.beta > 0)
  out = []
  for name, oc in (("adamw", dataclasses.replace(cfg.optimizer, kind="adamw")),
                   (f"logra r={br.logra_rank}", dataclasses.replace(
                       cfg.optimizer, kind="logra", logra=dataclasses.replace(cfg.optimizer.logra,
                                                                              rank=br.logra_rank)))):
    eng, state = engines.build(dataclasses.replace(cfg, optimizer=oc), mcfg, abstract=True)
    spec = train_step.StepSpec(mcfg, dataclasses.replace(cfg.grpo, max_completion_len=batch.completion_len),
                               model.uniform(mcfg.num_hidden_layers, model.FULL_REMAT), 1, cfg.train.logprob_chunk,
                               use_old_logp=True, use_ref_logp=cfg.grpo.beta > 0)
    step = eng.stepper.get(spec, batch, count=False)
    out.append({"optimizer": name, "shape": br.shapes[0], "params_bytes": nbytes(state["params"]),
                "opt_state_bytes": nbytes(state["opt_state"]), "peak_bytes": step.peak_bytes,
                "update_temp_bytes": step.update_temp_bytes,
                "total_bytes": nbytes(state["params"]) + nbytes(state["opt_state"]) + step.peak_bytes})
    progress(f"logra: {name} state {out[-1]['opt_state_bytes'] / MiB:.1f} MiB, total "
             f"{out[-1]['total_bytes'] / MiB:.1f} MiB")
  return out


# ----------------------------------------------------------------------------- the run


def setup_cost(cfg: Config, trainer, hooks, spec, batches, progress=print) -> tuple[dict, MemoryManager]:
  """What a run pays before its first hilore step on this shape (GC compile, op profile, calibration's probe
  gradients, the first bucket's budget-fit compiles), against what one step of the run costs."""
  probes = []
  counted = dataclasses.replace(hooks, probe_gradient=lambda *a: probes.append(1) or hooks.probe_gradient(*a))
  mm = MemoryManager(dataclasses.replace(cfg.memory, policy="hilore"), counted)
  compiles = trainer.stepper.probe_compiles
  t = time.perf_counter()
  mm.setup(trainer.state["params"], batches[:cfg.memory.calib_batches], 0)
  out = {"setup_s": time.perf_counter() - t, "probe_gradients": len(probes)}
  t = time.perf_counter()
  mm.allocate(batches[:1])
  out["first_fit_s"] = time.perf_counter() - t
  out["probe_compiles"] = trainer.stepper.probe_compiles - compiles
  # one step of the run: a rollout and its updates (the GC step's time; a plan's differs by its recompute)
  t = time.perf_counter()
  trainer.next_rollout()
  out["rollout_s"] = time.perf_counter() - t
  gc = dataclasses.replace(spec, policies=model.uniform(trainer.model_cfg.num_hidden_layers, model.FULL_REMAT))
  step = trainer.stepper.get(gc, batches[0])
  state, m = step(trainer.state, batches[0])
  jax.block_until_ready(m)
  t = time.perf_counter()
  state, m = step(state, batches[0])
  jax.block_until_ready(m)
  trainer.state = state
  out["update_s"] = time.perf_counter() - t
  out["updates_per_step"] = trainer.updates_per_step
  out["step_s"] = out["rollout_s"] + out["updates_per_step"] * out["update_s"]
  out["share_of_100_steps_pct"] = 100 * (out["setup_s"] + out["first_fit_s"]) / (100 * out["step_s"])
  progress(f"set-up {out['setup_s']:.0f}s ({out['probe_gradients']} probe gradients) + first fit "
           f"{out['first_fit_s']:.0f}s ({out['probe_compiles']} compiles); a step {out['step_s']:.1f}s: "
           f"{out['share_of_100_steps_pct']:.1f}% of a 100-step run")
  return out, mm


def _write(out_dir: str, result: dict):
  """real_model.json and .md of what has been measured so far (atomically: an interrupted run keeps the last)."""
  from experiments.real_model import report as real_report

  for name, text in (("real_model.json", json.dumps(result, indent=1, default=float)),
                     ("real_model.md", real_report.report(result))):
    tmp = os.path.join(out_dir, f".{name}.tmp")
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, os.path.join(out_dir, name))


def run(cfg: Config, br: RealBenchConfig, out_dir: str, ratios=(1.00, 1.10), progress=print) -> dict:
  """Rollouts of the model on its task, then br.parts in order (set-up cost, L-error table, memory table, LoGRA);
  real_model.json and real_model.md are rewritten after each part."""
  from hilore_jax.loop.trainer import Trainer

  os.makedirs(out_dir, exist_ok=True)
  result = {"config": {**cfg.to_dict(), "bench_real": dataclasses.asdict(br)},
            "tolerance": cfg.memory.grad_err_tolerance}
  if {"setup", "l_error", "memory"} & set(br.parts):  # each needs the model's rollouts
    trainer = Trainer(dataclasses.replace(cfg, out_dir=os.path.join(out_dir, "rollouts"),
                                          memory=dataclasses.replace(cfg.memory, policy="none")))
    t0 = time.perf_counter()
    batches = rollout_minibatches(trainer, br.lerror_minibatches + cfg.memory.calib_batches)
    progress(f"{len(batches)} rollout minibatches of {batches[0].rows} x "
             f"{batches[0].prompt_len + batches[0].completion_len} tokens in {time.perf_counter() - t0:.0f}s")
    spec = trainer.spec  # the run's own step: old log-probs only where the run has several updates per rollout
    hooks = step_hooks.memory_hooks(trainer.stepper, spec)
    params = jax.tree.map(jnp.copy, trainer.state["params"])  # the timed steps below donate the state's
    L = trainer.model_cfg.num_hidden_layers
    layers = calibration.probed_layers(L, cfg.memory.calib_layers)
    held = [calibration.calibration_rows(b, cfg.memory.calib_rows) for b in batches[cfg.memory.calib_batches:]]
    if {"setup", "memory"} & set(br.parts):  # the L-error table needs no calibration
      setup, mm = setup_cost(cfg, trainer, hooks, spec, batches, progress)
      result["calibration"] = {"delta": mm.state.calibration.delta, "coherence": mm.state.calibration.coherence,
                               "probed_layers": layers, "rows": held[0].rows, "batches": cfg.memory.calib_batches}
    if "setup" in br.parts:
      result["setup"] = setup
      _write(out_dir, result)
  if "l_error" in br.parts:
    progress("L error per unit kind and format on the rollouts")
    result["l_error"] = l_error_rows(hooks, lambda i: params, held, calibration.lowp_units(L), br.formats,
                                     cfg.memory.group_size, layers)
    result["l_error_where"] = {"layers": layers, "rows": held[0].rows, "minibatches": len(held)}
    result["l_error_tiny"] = tiny_l_error(cfg, br, br.formats)
    _write(out_dir, result)
  if "memory" in br.parts:
    progress("memory of every method at the fixed shapes (compile only)")
    result["memory"] = memory_rows(cfg, br, ratios, mm.state.calibration, progress)
    _write(out_dir, result)
  if "logra" in br.parts:
    result["logra"] = logra_rows(cfg, br, progress)
    _write(out_dir, result)
  return result
