"""What one device holds for a whole GRPO step at a completion length T, compile-only (abstract parameters: nothing
is allocated or run): the gradient program with a method's plan, the update program (AdamW), and the log-prob
forward the old and the reference log-probs run.

A program's footprint is XLA's memory analysis of it (arguments + outputs + temp - what outputs alias), plus what
stays resident on the device without being its argument: the optimizer state beside the gradient and the forward
programs, the reference weights (a KL term) beside every program, and the policy's weights beside the forward when it
runs on the reference's. The step's device bytes are the largest footprint; `peak_bytes` is the repo's compiled peak
of the step (engine.Step.peak_bytes: the larger program's temp plus the gradients, beyond the state), which budget
ratios are multiples of. Plans come from the manager's budget fit on the compiled step (projection.py), with the
H200-projected op times and, for hilore, no calibration: every unit's risk is 0, so its plan is bounded by memory
alone (`uncalibrated`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import numpy as np

from hilore_jax import model, optim, sharding
from hilore_jax.loop import engine, step_hooks
from hilore_jax.capacity import projection
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.memory.state import Calibration
from hilore_jax.model import units as U
from hilore_jax.model.config import LoraSpec, ModelConfig, from_hf_dict
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import Packing, UpdateBatch

SHAPES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                          "shapes")
# capacity method -> (memory.policy, budget ratios; None: the method has no budget). gc_int8: GC with int8 codes
# (every unit of the layers that fit, GACT/ALAM-style): the layer input alone as int8 under a full recompute is no
# LayerPolicy (the recompute starts from the layer's exact input)
METHODS = {"nogc": ("none", (None,)), "gc": ("gc", (None,)), "sac": ("sac", (1.0, 1.1)),
           "optimal_hr": ("optimal_hr", (1.0, 1.1)), "hilore": ("hilore", (1.0, 1.1)),
           "gc_int8": ("uniform_int8_gc", (1.0, 1.1))}


@dataclasses.dataclass(frozen=True)
class Settings:
  """What every compiled point shares (the cache is keyed by them)."""

  prompt_len: int = 256
  rows: int = 8  # one group of G = 8 completions per microbatch
  # rows a microbatch's forward and backward hold at a time (the token budget's lever); None: every row at once
  microbatch_rows: int | None = None
  beta: float = 0.04  # a KL term: reference log-probs in the batch, the reference weights resident
  logprob_chunk: int = 128
  dtype: str = "bfloat16"  # compute; params and AdamW state float32
  param_dtype: str = "float32"
  group_size: int = 64  # int8 codes' group
  budget_probes: int = 2  # compiles per plan's budget fit
  grid: int = 64  # the search's step in completion tokens
  max_completion: int | None = None  # and its cap; None: the shape's max_position_embeddings - prompt_len
  # LoRA (python -m train.capacity --lora RANK): adapters of this rank on all seven projections (alpha 2 x rank),
  # the base frozen in param_dtype, AdamW over the adapters, the reference the base itself; 0: full fine-tuning
  lora_rank: int = 0
  # the rows' completions end to end in packed buffers (rl/packing.py: one buffer row of rows x T / devices
  # positions per device), each group's prompt once in a table; False: rows padded to prompt + T, every row its own
  packed: bool = False
  # model.mlp_chunk_len: a recomputed MLP's backward over chunks of the sequence of this many positions (0: whole)
  mlp_chunk_len: int = ModelConfig.mlp_chunk_len
  # memory.plan_runs: a solved method's plan has at most this many runs of layers with one policy (0: any)
  plan_runs: int = MemoryConfig.plan_runs

  def __post_init__(self):
    if self.microbatch_rows is not None and (self.microbatch_rows <= 0 or self.rows % self.microbatch_rows):
      raise ConfigError(f"--microbatch-rows must divide the {self.rows} rows of a group, got {self.microbatch_rows}")
    if self.mlp_chunk_len < 0:
      raise ConfigError(f"--mlp-chunk-len must be >= 0 (0: the MLP never chunked), got {self.mlp_chunk_len}")
    if self.plan_runs < 0:
      raise ConfigError(f"--plan-runs must be >= 0 (0: any number of runs), got {self.plan_runs}")

  def programs(self) -> dict:
    """The fields the compiled programs depend on (the point cache's settings): not the search's grid or cap."""
    return {k: v for k, v in vars(self).items() if k not in ("grid", "max_completion")}


# settings fields added since a cache or result was written, with the value those files measured under
LEGACY = {"mlp_chunk_len": 0, "plan_runs": 4}


def with_legacy(settings: dict) -> dict:
  """Recorded settings with every field added since filled in as the programs then ran (LEGACY)."""
  return {**LEGACY, **settings}


def shape_names() -> list[str]:
  return sorted(f[:-5] for f in os.listdir(SHAPES_DIR) if f.endswith(".json"))


def load_shape(name: str, settings: Settings = Settings()) -> model.ModelConfig:
  """A model shape from configs/shapes/<name>.json (the fields of its HF config.json) or a config.json path."""
  path = name if name.endswith(".json") else os.path.join(SHAPES_DIR, f"{name}.json")
  if not os.path.exists(path):
    raise ConfigError(f"unknown shape {name!r}: known shapes are {', '.join(shape_names())} (or a config.json path)")
  with open(path) as f:
    d = json.load(f)
  cfg = from_hf_dict(d, settings.dtype, settings.param_dtype).replace(mlp_chunk_len=settings.mlp_chunk_len)
  return cfg.replace(lora=LoraSpec(settings.lora_rank, 2.0 * settings.lora_rank)) if settings.lora_rank else cfg


def uncalibrated(num_layers: int, delta: float = 0.01) -> Calibration:
  """A calibration that measured nothing: every L unit's predicted risk 0 (hilore then plans by memory and time)."""
  n = num_layers * len(U.LOWP_UNITS)
  zeros = [0.0] * n
  return Calibration([1.0] * n, zeros, zeros, delta, 0.0, 0.0, 0.0, {}, 0, score_max=zeros)


def abstract_batch(rows: int, prompt_len: int, completion_len: int, with_ref: bool,
                   packed_devices: int = 0) -> UpdateBatch:
  """An update minibatch's shapes: old log-probs carried, reference ones with a KL term; packed_devices > 0: its
  rows as one packed microbatch (rl/packing.py) of that many buffer rows holding the rows' completions (every one
  at T) end to end, with a table of one prompt per group of G = 8 rows."""
  i32 = lambda *s: jax.ShapeDtypeStruct(s, np.int32)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, np.float32)
  batch = UpdateBatch(i32(rows, prompt_len), i32(rows, prompt_len), i32(rows, completion_len),
                      i32(rows, completion_len), f32(rows), old_logp=f32(rows, completion_len), on_policy=i32(rows),
                      ref_logp=f32(rows, completion_len) if with_ref else None)
  if not packed_devices:
    return batch
  S, table = packed_devices, -(-rows // 8)
  buf = lambda: i32(S, -(-rows * completion_len // S))
  return batch.replace(prompt_table=i32(table, prompt_len), prompt_table_mask=i32(table, prompt_len),
                       prompt_index=i32(rows), packing=Packing(buf(), buf(), buf(), buf()))


def footprint(compiled) -> int:
  """arguments + outputs + temp - aliased bytes of a compiled program, per device."""
  m = compiled.memory_analysis()
  get = lambda k: int(getattr(m, k, 0) or 0)
  return (get("argument_size_in_bytes") + get("output_size_in_bytes") + get("temp_size_in_bytes")
          - get("alias_size_in_bytes"))


def device_bytes(tree) -> int:
  """Bytes of one device's shards of an abstract tree that carries shardings."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def make_mesh(devices: int):
  """An fsdp mesh over the first `devices` devices (the rest of a forced-device process stays idle)."""
  if devices > jax.device_count():
    raise ConfigError(f"{devices} devices asked for, {jax.device_count()} present: set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={devices} before JAX starts (train.capacity does)")
  return jax.make_mesh((1, devices), (sharding.DATA, sharding.FSDP), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:devices])


class Measurer:
  """Compiles points (shape, method, ratio, attention, devices, T); one engine per (shape, attention, devices)."""

  def __init__(self, settings: Settings = Settings()):
    self.settings = settings
    self._engines: dict[tuple, tuple] = {}

  def config(self) -> Config:
    s = self.settings
    return Config(grpo=GRPOConfig(beta=s.beta), memory=MemoryConfig(group_size=s.group_size, buckets=1,
                                                                     budget_probes=s.budget_probes, cache=False,
                                                                     plan_runs=s.plan_runs))

  def engine(self, mcfg: model.ModelConfig, devices: int):
    """The engine of one (shape and kernel, devices), the last one only: every XLA:CPU executable holds mapped code,
    and a grid's hundreds of probes would exhaust the process's maps (engine.Stepper's probe cache says more)."""
    key = (mcfg, devices)
    if key not in self._engines:
      self._engines.clear()
      cfg = self.config()
      mesh = make_mesh(devices)
      lr = optim.schedule(cfg.optimizer, 1000)
      opt = optim.make_optimizer(cfg.optimizer, 1000, lr)
      params = jax.eval_shape(lambda k: model.stacked(model.init_params(mcfg, k, cfg.model.init_std)),
                              jax.random.PRNGKey(0))  # the train layout, as engine.build holds it
      state, state_sh = engine.init_state(mesh, opt, params, None)
      stepper = engine.Stepper(mesh, opt, state, state_sh, probe_cache=4)
      self._engines[key] = (cfg, stepper)
    return self._engines[key]

  def spec(self, cfg: Config, mcfg: model.ModelConfig, completion_len: int) -> train_step.StepSpec:
    grpo = dataclasses.replace(cfg.grpo, max_completion_len=completion_len)
    s = self.settings
    return train_step.StepSpec(mcfg, grpo, model.uniform(mcfg.num_hidden_layers, model.NO_REMAT),
                               s.rows // (s.microbatch_rows or s.rows), s.logprob_chunk, use_old_logp=True,
                               use_ref_logp=s.beta > 0)

  def policies(self, cfg, stepper, spec, batch, method: str, ratio: float | None):
    L = spec.model_cfg.num_hidden_layers
    policy = METHODS[method][0]
    if policy in ("none", "gc"):
      return model.uniform(L, model.NO_REMAT if policy == "none" else model.FULL_REMAT)
    hooks = step_hooks.memory_hooks(stepper, spec)
    gc_bytes = hooks.compile_peak(model.uniform(L, model.FULL_REMAT), batch)
    prof = projection.projected_profile(spec.model_cfg, *hooks.batch_shape(batch), self.settings.group_size)
    cal = uncalibrated(L, cfg.memory.grad_err_tolerance) if policy in ("hilore", "hilore_static") else None
    return projection.fit_plan(cfg.memory, hooks, batch, policy, ratio, gc_bytes, prof, cal)

  def forward(self, stepper, spec, batch):
    """The old / reference log-prob program (as Stepper.logprobs compiles it), compiled only."""
    seqs = batch.sequences()
    fwd_spec = dataclasses.replace(spec, policies=())
    batch_sh = stepper.batch_shardings(seqs)
    fn = jax.jit(lambda p, b: train_step.sequence_logprobs(fwd_spec, p, b),
                 in_shardings=(stepper.state_shardings.params, batch_sh),
                 out_shardings=sharding.batch_sharding(stepper.mesh))
    return fn.lower(stepper.state_abstract.params, engine.abstract(seqs, batch_sh)).compile()

  def measure(self, mcfg: model.ModelConfig, method: str, ratio: float | None, devices: int,
              completion_len: int) -> dict:
    """One point's record: device_bytes (the step's largest footprint), peak_bytes and each program's bytes."""
    t0 = time.perf_counter()
    s = self.settings
    cfg, stepper = self.engine(mcfg, devices)
    spec = self.spec(cfg, mcfg, completion_len)
    batch = abstract_batch(s.rows, s.prompt_len, completion_len, s.beta > 0, devices if s.packed else 0)
    pols = self.policies(cfg, stepper, spec, batch, method, ratio)
    step = stepper.get(dataclasses.replace(spec, policies=tuple(pols)), batch, count=False)
    opt_b = device_bytes(stepper.state_abstract.opt_state)
    # a KL term's reference weights: a copy of the params, or with LoRA the frozen base the params hold already
    ref_b = device_bytes(stepper.state_abstract.params) if s.beta > 0 and not mcfg.lora else 0
    parts = {"grad": footprint(step.grad) + opt_b + ref_b, "update": footprint(step.update) + ref_b,
             "forward": footprint(self.forward(stepper, spec, batch)) + opt_b + ref_b}
    fr = {c: sum(getattr(p, a) != () for p in pols) / len(pols) for c, a in (("L", "lowp"), ("H", "save"))}
    return {"device_bytes": max(parts.values()), "peak_bytes": step.peak_bytes, "programs": parts,
            "remat_layers": sum(p.remat for p in pols), "layers_with_L": fr["L"], "layers_with_H": fr["H"],
            "seconds": round(time.perf_counter() - t0, 2)}
