"""The roofline projection's counts, compile-only (the parameters may be abstract: nothing runs), for the bench's
plans or any model shape: matmul FLOPs from the gradient program's jaxpr (capacity/flops.py) and bytes accessed from
XLA's cost analysis of the compiled programs (capacity/roofline.py turns them into projected seconds).

XLA's cost analysis counts a loop body once, so the counted program is the plan's with its loops unrolled: the
layer runs (`unrolled`: every layer a plain call) and the log-prob chunks (one chunk). It keeps the same tensors and
does the same work as the timed program; only the loop structure differs.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from hilore_jax import model, sharding
from hilore_jax.loop import engine, step_hooks
from hilore_jax.capacity import flops, roofline, synthetic
from hilore_jax.config import Config
from hilore_jax.memory import MemoryManager, ManagerState
from hilore_jax.memory import budget as budgets
from hilore_jax.memory import profile
from hilore_jax.model import codec
from hilore_jax.model import units as U
from hilore_jax.rl import train_step

log = logging.getLogger(__name__)


def unrolled(spec: train_step.StepSpec) -> train_step.StepSpec:
  """The same step with every layer a plain call (model.scan_layers off): the same tensors kept, the same work, no
  layer scan for XLA's cost analysis to count once."""
  return dataclasses.replace(spec, model_cfg=spec.model_cfg.replace(scan_layers=False))


def plan_codec_bytes(mcfg: model.ModelConfig, rows: int, seq: int, policies) -> float:
  """Encode + decode traffic of a plan's L units at one device's activation shapes (rows, seq)."""
  sizes, itemsize = U.dims(mcfg, rows, seq), np.dtype(mcfg.compute_dtype).itemsize
  return roofline.codec_bytes((U.numel(k, sizes) * itemsize, codec.code_bytes(U.shape(k, sizes), p.group_size,
                                                                               p.format_of(k)))
                              for p in policies for k in p.lowp)


def counts(stepper: engine.Stepper, spec: train_step.StepSpec, batch, params) -> tuple[roofline.Counts, dict]:
  """A plan's counts (spec carries its policies) and a check: XLA's FLOPs of the unrolled program over the jaxpr's
  matmul FLOPs (below 1, a loop body was still counted once and the bytes are undercounted)."""
  flat = dataclasses.replace(unrolled(spec), logprob_chunk=max(batch.completion_len, 1))
  step = stepper.get(flat, batch, count=False)
  grad_bytes, update_bytes = step.program_costs("bytes accessed")
  matmul = flops.program_flops(lambda p, b: train_step.grads_and_stats(p, b, flat)[0], params, batch)
  rows = -(-batch.rows // (spec.microbatches * sharding.num_batch_shards(stepper.mesh)))
  codec_b = plan_codec_bytes(spec.model_cfg, rows, batch.prompt_len + batch.completion_len, spec.policies)
  ratio = step.program_costs("flops")[0] / max(matmul, 1.0)
  if ratio < 1:
    log.warning("projection: XLA counts %.2fx the matmul FLOPs: a loop was counted once, bytes are undercounted",
                ratio)
  return roofline.Counts(matmul, grad_bytes, update_bytes, codec_b), {"xla_over_matmul_flops": ratio}


def project_row(c: roofline.Counts, check: dict, device: roofline.Device = roofline.H200) -> dict:
  """A row's projected_* fields (seconds, counts and the check)."""
  p = roofline.project(c, device)
  return {"projected_step_s": p["step_s"], "projected_grad_s": p["grad_s"], "projected_update_s": p["update_s"],
          "projected_codec_s": p["codec_s"], "projected_bound": p["bound"], "projected_matmul_flops": c.matmul_flops,
          "projected_bytes": c.grad_bytes + c.update_bytes + c.codec_bytes, **check}


def device_info(device: roofline.Device = roofline.H200) -> dict:
  return {"label": "projection (roofline), not a measurement", **dataclasses.asdict(device)}


def projected_profile(mcfg: model.ModelConfig, rows: int, seq: int, group_size: int,
                      device: roofline.Device = roofline.H200) -> dict:
  """The cost model's op and codec seconds as the roofline projects them on `device` (each op's XLA counts,
  compile-only): to plan for a device that is not here."""
  ops = {op: roofline.program_s(f, b, device) for op, (f, b) in profile.op_costs(mcfg, rows, seq).items()}
  sizes, itemsize = U.dims(mcfg, rows, seq), np.dtype(mcfg.compute_dtype).itemsize
  codecs = {k: {f: roofline.codec_bytes([(U.numel(k, sizes) * itemsize, codec.code_bytes(U.shape(k, sizes),
                                                                                           group_size, f))])
                / device.hbm_bytes_per_s for f in codec.FORMATS} for k in U.LOWP_UNITS}
  return {"ops": ops, "codec": codecs, "offload": {}}


def project_plans(cfg: Config, mcfg: model.ModelConfig, rows: int, prompt_len: int, completion_len: int,
                  plans: dict, device: roofline.Device = roofline.H200, progress=print) -> list[dict]:
  """Projected step time of each plan ({(method, budget ratio or None): per-layer policies}) for any model shape,
  compile-only (abstract parameters, one compile per plan); rows as the bench's, gains over GC and optimal_hr."""
  eng, state = engine.build(cfg, mcfg, 10, abstract=True)
  batch = jax.device_put(synthetic.shape_batch(mcfg, rows, prompt_len, completion_len, cfg.grpo.beta > 0),
                         sharding.batch_sharding(eng.mesh))
  spec = synthetic.step_spec(mcfg, cfg.grpo, cfg.train.logprob_chunk, completion_len)
  out = []
  for (method, ratio), pols in plans.items():
    c, check = counts(eng.stepper, dataclasses.replace(spec, policies=tuple(pols)), batch, state.params)
    out.append({"method": method, "budget_ratio": ratio, **project_row(c, check, device)})
    progress(f"projection: {method} @ {ratio}: {1e3 * out[-1]['projected_step_s']:.3f} ms ({out[-1]['projected_bound']}"
             "-bound)")
  return roofline.add_gains(out)


def planned(cfg: Config, mcfg: model.ModelConfig, rows: int, prompt_len: int, completion_len: int, methods_: list,
            ratios, device: roofline.Device = roofline.H200) -> dict:
  """Plans of uncalibrated methods, compile-only: the manager's budget fit on the compiled step with the cost model's
  op times projected for `device`; {(method, ratio): policies}, none and gc included."""
  eng, state = engine.build(cfg, mcfg, 10, abstract=True)
  batch = jax.device_put(synthetic.shape_batch(mcfg, rows, prompt_len, completion_len, cfg.grpo.beta > 0),
                         sharding.batch_sharding(eng.mesh))
  spec = synthetic.step_spec(mcfg, cfg.grpo, cfg.train.logprob_chunk, completion_len)
  hooks = step_hooks.memory_hooks(eng.stepper, spec)
  L = mcfg.num_hidden_layers
  plans = {("none", None): model.uniform(L, model.NO_REMAT), ("gc", None): model.uniform(L, model.FULL_REMAT)}
  gc_bytes = hooks.compile_peak(plans["gc", None], batch)
  prof = projected_profile(mcfg, *hooks.batch_shape(batch), cfg.memory.group_size, device)
  for method in (m for m in methods_ if m not in ("none", "gc")):
    for ratio in ratios:
      plans[method, ratio] = fit_plan(cfg.memory, hooks, batch, method, ratio, gc_bytes, prof)
  return plans


def fit_plan(mc, hooks, batch, method: str, ratio: float, gc_bytes: int, prof: dict, calibration=None) -> tuple:
  """One method's per-layer policies at `ratio` x GC's compiled peak, fitted on the compiled step (no gradient
  runs): the op times of `prof` (projected_profile), the unit risks of `calibration` (None: an uncalibrated method)."""
  mm = MemoryManager(mc.at_budget(ratio, method), hooks)
  mm.load_state(ManagerState(gc_bytes, budgets.budget_bytes(gc_bytes, ratio), prof, 0, calibration),
                "projected profile")
  (alloc,) = mm.allocate([batch])
  return alloc.policies
