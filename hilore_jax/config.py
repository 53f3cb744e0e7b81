"""The trainer's configuration: the wings' sections composed into one frozen, typed Config, validated at the
boundary, and its loading from YAML plus dotted overrides. Each wing owns its settings (model/config.py, ...); this
module adds what the run itself needs, the checks that span sections, and the loader. Over 320 lines on purpose: the
model wing's sections (model, lora) live here because model/ imports nothing of the package's errors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from typing import Any, Sequence

import yaml

from hilore_jax.errors import ConfigError, check_choice, check_positive, check_range
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.model.config import DTYPES, LORA_TARGETS, LoraSpec, ModelConfig
from hilore_jax.optim.config import OptimizerConfig
from hilore_jax.rl.config import EvalConfig, GRPOConfig, ReplayConfig, RolloutConfig, TrainConfig
from hilore_jax.tasks.config import TaskConfig

# how attention and the layer stack run, not the shape
_KERNEL_FIELDS = ("attention", "attention_block_q", "attention_block_k", "scan_layers", "mlp_chunk_len")
_ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                     if f.name not in ("dtype", "param_dtype", "lora") + _KERNEL_FIELDS)


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """model.path (a local HF checkpoint) or HF-named shape fields for a randomly initialised model."""

  path: str | None = None
  init_std: float = 0.02
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  attention: str = "xla"  # xla | dot_product_attention (jax.nn's fused kernel: cuDNN on GPU) | blockwise (any backend)
  attention_block_q: int = ModelConfig.attention_block_q  # blockwise's block sizes (ModelConfig holds the defaults)
  attention_block_k: int = ModelConfig.attention_block_k
  scan_layers: bool = ModelConfig.scan_layers  # false: every layer a plain call (a control: the loop form's cost)
  mlp_chunk_len: int = ModelConfig.mlp_chunk_len  # a recomputed MLP's chunk of the sequence in backward (0: whole)
  arch: tuple[tuple[str, Any], ...] = ()  # HF-named fields (hidden_size, ...), given flat under model.

  def __post_init__(self):
    check_positive("model.init_std", self.init_std)
    arch = dict(self.arch)
    for key in ("head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings"):
      if arch.get(key) is not None:
        check_positive(f"model.{key}", arch[key])
    if not isinstance(arch.get("rope_scaling") or {}, dict):
      raise ConfigError(f"model.rope_scaling must be a mapping (HF's rope_scaling) or null, got "
                        f"{arch['rope_scaling']!r}")
    if self.path and self.arch:
      keys = [k for k, _ in self.arch if k not in ("bos_token_id", "eos_token_id", "pad_token_id")]
      if keys:
        raise ConfigError(f"model.path is set: shape fields {keys} come from the checkpoint, remove them")
    try:
      if not self.path:
        self.shape_config()  # validate the shape at the boundary
      else:
        ModelConfig(dtype=self.dtype, param_dtype=self.param_dtype, **self.kernel())  # numerics alone
    except ValueError as e:
      raise ConfigError(str(e) if str(e).startswith("model.") else f"model: {e}") from None

  def shape_config(self) -> ModelConfig:
    """The model config of a randomly initialised model (model.path unset)."""
    return ModelConfig(**dict(self.arch), dtype=self.dtype, param_dtype=self.param_dtype, **self.kernel())

  def kernel(self) -> dict[str, Any]:
    """The attention kernel's ModelConfig fields (applied to a checkpoint's config too)."""
    return {f: getattr(self, f) for f in _KERNEL_FIELDS}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """lora.*: train low-rank adapters on a frozen base instead of every parameter (model/lora.py); rank 0: off."""

  rank: int = 0
  alpha: float = 8.0  # the adapter's output is scaled by alpha / rank (peft's lora_alpha, its default 8)
  targets: tuple[str, ...] = LORA_TARGETS  # q, k, v, o, gate, up, down (peft's q_proj, ..., down_proj)
  dropout: float = 0.0  # on the adapter's input in the gradient program (peft's lora_dropout)
  base_dtype: str | None = None  # the frozen base's storage dtype; None: model.param_dtype. Adapters: float32
  init_from: str | None = None  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)

  def __post_init__(self):
    if self.rank < 0:
      raise ConfigError(f"lora.rank must be >= 0 (0: off), got {self.rank}")
    if self.base_dtype is not None:
      check_choice("lora.base_dtype", self.base_dtype, tuple(DTYPES))
    try:
      LoraSpec(max(self.rank, 1), self.alpha, self.targets, self.dropout)  # alpha, targets and dropout, even off
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if self.init_from and not self.rank:
      raise ConfigError("lora.init_from needs lora.rank > 0 (the adapter directory's rank)")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  def spec(self) -> LoraSpec | None:
    """The model's adapters (ModelConfig.lora), None when off."""
    return LoraSpec(self.rank, self.alpha, self.targets, self.dropout) if self.rank else None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # -1: all devices not used by fsdp
  fsdp: int = 1
  distributed: bool = False  # call jax.distributed.initialize() (multi-process)
  coordinator_address: str | None = None  # None: read from the cluster environment
  num_processes: int | None = None
  process_id: int | None = None

  def __post_init__(self):
    if self.data == 0 or self.data < -1:
      raise ConfigError(f"mesh.data must be > 0 or -1, got {self.data}")
    check_positive("mesh.fsdp", self.fsdp)
    if self.num_processes is not None:
      check_positive("mesh.num_processes", self.num_processes)
    if self.process_id is not None:
      check_range("mesh.process_id", self.process_id, 0, (self.num_processes or 1 << 30) - 1)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 50
  keep: int = 3
  export_hf: bool = True

  def __post_init__(self):
    check_positive("checkpoint.every", self.every)
    check_positive("checkpoint.keep", self.keep)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  progress: bool = True
  tensorboard: bool = False
  plot: bool = True
  samples_every: int = 10  # append one prompt's group of decoded completions to samples.jsonl every N steps; 0: off

  def __post_init__(self):
    check_positive("logging.samples_every", self.samples_every, allow_zero=True)


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
  replay: ReplayConfig = ReplayConfig()
  lora: LoraConfig = LoraConfig()

  def __post_init__(self):
    check_positive("seed", self.seed, allow_zero=True)  # numpy's per-step shuffle seeds take no negatives
    if not self.out_dir:
      raise ConfigError("out_dir must not be empty")
    batch = self.rollout.num_prompts * self.rollout.num_generations
    mb = self.train.minibatch_size or batch
    if batch % mb:
      raise ConfigError(f"train.minibatch_size ({mb}) must divide the rollout batch "
                        f"(num_prompts * num_generations = {batch})")
    if mb % (self.train.microbatch_size or mb):
      raise ConfigError(f"train.microbatch_size ({self.train.microbatch_size}) must divide "
                        f"train.minibatch_size ({mb})")
    row = self.rollout.max_prompt_len + self.rollout.max_new_tokens
    text = (f"one row at the cap: rollout.max_prompt_len + rollout.max_new_tokens = {self.rollout.max_prompt_len} + "
            f"{self.rollout.max_new_tokens} = {row} tokens")
    if self.train.packing and self.train.share_prompt:  # a packed buffer holds completions only
      row = self.rollout.max_new_tokens
      text = f"one packed completion at the cap: rollout.max_new_tokens = {row} tokens"
    for key in ("max_tokens_per_microbatch", "max_tokens_per_logprob_pass"):
      if 0 < getattr(self.train, key) < row:
        raise ConfigError(f"train.{key} ({getattr(self.train, key)}) is smaller than {text}")
    G = self.rollout.num_generations
    if self.replay.group_size not in (0, G):
      raise ConfigError(f"replay.group_size ({self.replay.group_size}) must equal rollout.num_generations ({G}) "
                        f"or be 0")
    if self.replay.group_size != G:  # validated again with G: naive mode's capacity must hold whole groups
      object.__setattr__(self, "replay", dataclasses.replace(self.replay, group_size=G))
    if self.grpo.old_logp == "sampler" and (self.rollout.top_k or self.rollout.top_p < 1.0):
      raise ConfigError(f"grpo.old_logp=sampler needs the sampler's distribution to be the policy's: rollout.top_k "
                        f"must be 0 and rollout.top_p 1.0 (got {self.rollout.top_k} and {self.rollout.top_p}); or "
                        f"use grpo.old_logp=forward")
    if self.grpo.old_logp == "sampler" and self.rollout.dtype not in ("", self.model.dtype):
      raise ConfigError(f"grpo.old_logp=sampler needs the sampler's log-probs at the model's precision: rollout.dtype "
                        f"is {self.rollout.dtype}, model.dtype {self.model.dtype}; or use grpo.old_logp=forward")
    if not self.grpo.max_completion_len:  # Dr.GRPO's normaliser defaults to the generation budget
      object.__setattr__(self, "grpo", dataclasses.replace(self.grpo,
                                                           max_completion_len=self.rollout.max_new_tokens))

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


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(key: str, value, tp):
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return None if value is None else _coerce(key, value, args[0])
  if origin is tuple:
    if isinstance(value, str):
      value = [value]
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key} must be a list, got {value!r}")
    inner = typing.get_args(tp)[0]
    return tuple(_coerce(key, v, inner) for v in value)
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key} must be an integer, got {value!r}")
    return value
  if tp is float:
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
      value = float(value)  # YAML 1.1 reads '1e-3' (no dot) as a string; a user means the number
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value):  # YAML's .nan/.inf would pass every range check written as a comparison
      raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key} must be a string, got {value!r}")
    return value
  return value


def build(cls, d: dict, prefix: str = ""):
  """A section (any of these frozen dataclasses) from its mapping; `prefix` names it in errors."""
  if not isinstance(d, dict):
    raise ConfigError(f"config section {prefix.rstrip('.') or '<root>'} must be a mapping, got {d!r}")
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
      raise ConfigError(f"unknown config key '{prefix}{key}'; valid keys here: {valid}")
    tp = hints[key]
    if dataclasses.is_dataclass(tp):
      kwargs[key] = build(tp, dict(value) if isinstance(value, dict) else ({} if value is None else value),
                           f"{prefix}{key}.")
    else:
      kwargs[key] = _coerce(prefix + key, value, tp)
  return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
  """['train.steps=20', 'out_dir=/tmp/x'] -> nested dict (values parsed as YAML scalars)."""
  out: dict = {}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
      if not isinstance(node, dict):
        raise ConfigError(f"override {item!r}: {p} is not a section")
    try:
      node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
      raise ConfigError(f"override {item!r}: the value is not valid YAML ({e})") from None
  return out


def _merge(base: dict, extra: dict) -> dict:
  for k, v in extra.items():
    if isinstance(v, dict) and isinstance(base.get(k), dict):
      _merge(base[k], v)
    else:
      base[k] = v
  return base


def merged(d: dict, overrides: Sequence[str] = ()) -> dict:
  """A loaded YAML mapping with dotted overrides applied (the mapping is updated in place)."""
  return _merge(d, parse_overrides(list(overrides)))


def from_dict(d: dict, overrides: Sequence[str] = ()) -> Config:
  """A loaded YAML mapping plus dotted overrides -> validated Config."""
  return build(Config, merged(d, overrides), "")


def read_yaml(path: str | None) -> dict:
  """The mapping in a YAML file ({} for None); ConfigError naming the file if it is missing or not a mapping."""
  if not path:
    return {}
  if not os.path.isfile(path):
    raise ConfigError(f"--config {path}: no such file")
  try:
    with open(path) as f:
      d = yaml.safe_load(f) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: not valid YAML ({e})") from None
  if not isinstance(d, dict):
    raise ConfigError(f"{path}: the top level must be a mapping")
  return d


def load(path: str | None, overrides: Sequence[str] = ()) -> Config:
  """YAML file (may be None) + dotted overrides -> validated Config."""
  return from_dict(read_yaml(path), overrides)
