"""Trainer configuration: YAML plus dotted overrides become one frozen, validated dataclass tree."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

import yaml

from hilore_jax import grpo
from hilore_jax.model_config import ModelConfig
from hilore_jax.exposure import ExposureSwitches
from hilore_jax.tasks import ArithmeticSpec

_ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("dtype", "param_dtype"))


def _choice(key: str, value, choices):
  if value not in choices:
    raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")


def _positive(key: str, value, allow_zero=False):
  if value < 0 or (value == 0 and not allow_zero):
    raise ValueError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """model.path (a local HF checkpoint) or HF-named shape fields for a randomly initialised model."""

  path: str | None = None
  init_std: float = 0.02
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  arch: tuple[tuple[str, Any], ...] = ()  # HF-named fields (hidden_size, ...), given flat under model.

  def __post_init__(self):
    if self.path and self.arch:
      keys = [k for k, _ in self.arch if k not in ("bos_token_id", "eos_token_id", "pad_token_id")]
      if keys:
        raise ValueError(f"model.path is set: shape fields {keys} come from the checkpoint, remove them")
    if not self.path:
      self.model_config()  # validate the shape at the boundary

  def model_config(self) -> ModelConfig:
    if self.path:
      from hilore_jax.hf import load_config
      cfg = load_config(self.path, self.param_dtype, self.dtype)
      return cfg.replace(**dict(self.arch))
    return ModelConfig(**dict(self.arch), dtype=self.dtype, param_dtype=self.param_dtype)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  kind: str = "arithmetic"  # arithmetic | gsm8k | math
  seed: int = 0  # shuffling of dataset tasks
  arithmetic: ArithmeticSpec = ArithmeticSpec()  # task.arithmetic.max_value, ... (the synthetic task's knobs)
  train_path: str | None = None  # gsm8k / math JSONL
  test_path: str | None = None
  skip_malformed: bool = False
  prompt_template: str = "{question}\n"

  def __post_init__(self):
    _choice("task.kind", self.kind, ("arithmetic", "gsm8k", "math"))
    if self.kind != "arithmetic" and not (self.train_path and self.test_path):
      raise ValueError(f"task.kind={self.kind} needs task.train_path and task.test_path (JSONL files)")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  num_prompts: int = 16  # prompts per step
  num_generations: int = 8  # G completions per prompt
  max_prompt_len: int = 16
  max_new_tokens: int = 8
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    _positive("rollout.num_prompts", self.num_prompts)
    if self.num_generations < 2:
      raise ValueError(f"rollout.num_generations must be > 1, got {self.num_generations}")
    _positive("rollout.max_prompt_len", self.max_prompt_len)
    _positive("rollout.max_new_tokens", self.max_new_tokens)
    _positive("rollout.temperature", self.temperature)
    if not 0 < self.top_p <= 1:
      raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  advantage: str = "grpo"
  std_scale: str = "group"
  loss_agg: str = "token-mean"
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float | None = None
  beta: float = 0.0
  kl_estimator: str = "k3"
  num_iterations: int = 1
  filter_zero_std: bool = True

  def __post_init__(self):
    _choice("grpo.advantage", self.advantage, grpo.ADVANTAGES)
    _choice("grpo.std_scale", self.std_scale, grpo.STD_SCALES)
    _choice("grpo.loss_agg", self.loss_agg, grpo.LOSS_AGGS)
    _choice("grpo.kl_estimator", self.kl_estimator, grpo.KL_ESTIMATORS)
    _positive("grpo.num_iterations", self.num_iterations)
    self.loss_config(1)  # range checks of the objective


  def loss_config(self, max_completion_len: int) -> grpo.LossConfig:
    return grpo.LossConfig(self.loss_agg, self.eps_low, self.eps_high, self.dual_clip, self.beta,
                           self.kl_estimator, max_completion_len)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  lr: float = 1e-5
  schedule: str = "constant"  # constant | cosine (after linear warmup)
  warmup_steps: int = 0
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0

  def __post_init__(self):
    _choice("optimizer.schedule", self.schedule, ("constant", "cosine"))
    _positive("optimizer.lr", self.lr)
    _positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)
    _positive("optimizer.max_grad_norm", self.max_grad_norm, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 100
  minibatch_size: int = 0  # sequences per optimizer update; 0: the whole batch
  microbatch_size: int = 0  # sequences per gradient-accumulation slice; 0: the whole minibatch
  logprob_chunk: int = 128
  resume: bool = False
  warmstart_steps: int = 0  # supervised steps on task answers before GRPO (from scratch models)
  warmstart_lr: float = 1e-3
  warmstart_batch_size: int = 64

  def __post_init__(self):
    _positive("train.steps", self.steps)
    _positive("train.minibatch_size", self.minibatch_size, allow_zero=True)
    _positive("train.microbatch_size", self.microbatch_size, allow_zero=True)
    _positive("train.logprob_chunk", self.logprob_chunk)
    _positive("train.warmstart_steps", self.warmstart_steps, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  num_examples: int = 200
  pass_k: int = 4
  temperature: float = 1.0
  batch_size: int = 128
  at_start: bool = True
  at_end: bool = True

  def __post_init__(self):
    _positive("eval.num_examples", self.num_examples)
    _positive("eval.pass_k", self.pass_k)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # -1: all devices not used by fsdp
  fsdp: int = 1
  distributed: bool = False  # call jax.distributed.initialize() (multi-host)
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None

  def __post_init__(self):
    if self.data == 0 or self.data < -1:
      raise ValueError(f"mesh.data must be > 0 or -1, got {self.data}")
    _positive("mesh.fsdp", self.fsdp)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 50
  keep: int = 3
  export_hf: bool = True

  def __post_init__(self):
    _positive("checkpoint.every", self.every)
    _positive("checkpoint.keep", self.keep)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  progress: bool = True
  tensorboard: bool = False
  plot: bool = True


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  # none: keep every activation; gc: recompute every layer; hilore: H/L/R(/O) per unit by exposure; the rest are
  # the benchmark's baselines (sac, optimal_hr, uniform_int8, greedy_bits, adacc_style), see hilore_jax/methods.py
  policy: str = "none"
  budget_ratio: float = 1.05  # memory budget as a multiple of the GC step's temp bytes
  budget_bytes: int | None = None  # absolute budget (overrides budget_ratio)
  grad_err_tolerance: float = 0.01  # relative gradient error the risk budget is calibrated to
  buckets: int = 4  # hilore: exposure buckets, one allocation (and compiled step) each
  refresh_every: int = 0  # recalibrate every N steps (0: only at the start)
  group_size: int = 64  # L codes: one scale per group along the last axis
  lowp_format: str = "int8"  # L codes: int8 | fp8_e4m3 | int4 | bf16
  calib_batches: int = 2  # K: minibatches the risk calibration measures
  offload: bool = False  # allow O (offload to host memory); GPU/TPU only
  budget_probes: int = 4  # compiles per bucket to fit the plan's byte allowance to the compiled peak
  exposure: ExposureSwitches = ExposureSwitches()  # memory.exposure.ratio_clip=false etc. (ablations)

  def __post_init__(self):
    from hilore_jax import codec, methods

    _choice("memory.policy", self.policy, methods.METHODS)
    _choice("memory.lowp_format", self.lowp_format, codec.FORMATS)
    _positive("memory.calib_batches", self.calib_batches)
    _positive("memory.budget_probes", self.budget_probes)
    if self.budget_ratio < 1.0:
      raise ValueError(f"memory.budget_ratio must be >= 1.0 (full checkpointing is the floor), got "
                       f"{self.budget_ratio}")
    _positive("memory.grad_err_tolerance", self.grad_err_tolerance)
    _positive("memory.buckets", self.buckets)
    _positive("memory.refresh_every", self.refresh_every, allow_zero=True)
    _positive("memory.group_size", self.group_size)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """`python -m train.bench`: the actor update of every method on synthetic GRPO minibatches."""

  batch_size: int = 8  # rows per minibatch (groups x group_size)
  group_size: int = 4  # responses per prompt
  seq_len: int = 256  # prompt + completion tokens
  prompt_len: int = 64
  budget_ratios: tuple[float, ...] = (1.00, 1.05, 1.10)
  methods: tuple[str, ...] = ("none", "gc", "sac", "optimal_hr", "uniform_int8", "greedy_bits", "adacc_style",
                              "hilore")
  reps: int = 9  # timed steps per method (interleaved; medians)
  zero_adv_frac: float = 0.25  # share of groups whose rewards are all equal
  logp_noise: float = 0.3  # old log-probs = current + N(0, this): some ratios clip
  risk_batches: int = 4  # held-out batches for the risk-prediction table

  def __post_init__(self):
    from hilore_jax import methods

    for k in ("batch_size", "group_size", "seq_len", "prompt_len", "reps"):
      _positive(f"bench.{k}", getattr(self, k))
    if self.batch_size % self.group_size:
      raise ValueError(f"bench.batch_size ({self.batch_size}) must be a multiple of bench.group_size "
                       f"({self.group_size})")
    if not 0 < self.prompt_len < self.seq_len:
      raise ValueError(f"bench.prompt_len must be in (0, bench.seq_len={self.seq_len}), got {self.prompt_len}")
    for r in self.budget_ratios:
      if r < 1.0:
        raise ValueError(f"bench.budget_ratios must be >= 1.0 (full checkpointing is the floor), got {r}")
    for m in self.methods:
      _choice("bench.methods", m, methods.METHODS)
    _positive("bench.risk_batches", self.risk_batches, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = 0
  out_dir: str = "runs/default"
  tokenizer: str | None = None  # a local directory, 'char', or None: model.path if set, else 'char'
  model: ModelSection = ModelSection()
  task: TaskConfig = TaskConfig()
  rollout: RolloutConfig = RolloutConfig()
  grpo: GRPOConfig = GRPOConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  train: TrainConfig = TrainConfig()
  eval: EvalConfig = EvalConfig()
  mesh: MeshConfig = MeshConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  logging: LoggingConfig = LoggingConfig()
  memory: MemoryConfig = MemoryConfig()
  bench: BenchConfig = BenchConfig()

  def __post_init__(self):
    batch = self.rollout.num_prompts * self.rollout.num_generations
    mb = self.train.minibatch_size or batch
    if batch % mb:
      raise ValueError(f"train.minibatch_size ({mb}) must divide the rollout batch "
                       f"(num_prompts * num_generations = {batch})")
    if mb % (self.train.microbatch_size or mb):
      raise ValueError(f"train.microbatch_size ({self.train.microbatch_size}) must divide "
                       f"train.minibatch_size ({mb})")

  @property
  def minibatch_size(self) -> int:
    return self.train.minibatch_size or self.rollout.num_prompts * self.rollout.num_generations

  @property
  def tokenizer_path(self) -> str:
    return self.tokenizer or self.model.path or "char"

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    arch = d["model"].pop("arch")
    d["model"].update(dict(arch))
    return d

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, default=list)


# ----------------------------------------------------------------------------- loading


def _coerce(key: str, value, tp):
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
      return None
    return _coerce(key, value, args[0])
  if origin is tuple:
    if isinstance(value, str):
      value = [value]
    if not isinstance(value, (list, tuple)):
      raise ValueError(f"{key} must be a list, got {value!r}")
    inner = typing.get_args(tp)[0]
    return tuple(_coerce(key, v, inner) for v in value)
  if tp is bool:
    if not isinstance(value, bool):
      raise ValueError(f"{key} must be true or false, got {value!r}")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{key} must be an integer, got {value!r}")
    return value
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ValueError(f"{key} must be a string, got {value!r}")
    return value
  return value


def _build(cls, d: dict, prefix: str):
  if not isinstance(d, dict):
    raise ValueError(f"config section {prefix.rstrip('.') or '<root>'} must be a mapping, got {d!r}")
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  kwargs: dict[str, Any] = {}
  if cls is ModelSection:
    arch = {k: d.pop(k) for k in list(d) if k in _ARCH_FIELDS}
    mc_hints = typing.get_type_hints(ModelConfig)
    kwargs["arch"] = tuple(sorted((k, _coerce(prefix + k, v, mc_hints[k]) if k != "rope_scaling" else v)
                                  for k, v in arch.items()))
    fields = fields - {"arch"}
  for key, value in d.items():
    if key not in fields:
      valid = sorted(fields | (set(_ARCH_FIELDS) if cls is ModelSection else set()))
      raise ValueError(f"unknown config key '{prefix}{key}'; valid keys here: {valid}")
    tp = hints[key]
    if dataclasses.is_dataclass(tp):
      kwargs[key] = _build(tp, dict(value or {}), f"{prefix}{key}.")
    else:
      kwargs[key] = _coerce(prefix + key, value, tp)
  return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
  """['train.steps=20', 'out_dir=/tmp/x'] -> nested dict (values parsed as YAML scalars)."""
  out: dict = {}
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
      if not isinstance(node, dict):
        raise ValueError(f"override {item!r}: {p} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
  return out


def _merge(base: dict, extra: dict) -> dict:
  for k, v in extra.items():
    if isinstance(v, dict) and isinstance(base.get(k), dict):
      _merge(base[k], v)
    else:
      base[k] = v
  return base


def from_dict(d: dict) -> Config:
  return _build(Config, d, "")


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
  """YAML file (may be None) + dotted overrides -> validated Config."""
  d = {}
  if path:
    with open(path) as f:
      d = yaml.safe_load(f) or {}
    if not isinstance(d, dict):
      raise ValueError(f"{path}: the top level must be a mapping")
  return from_dict(_merge(d, parse_overrides(list(overrides))))
