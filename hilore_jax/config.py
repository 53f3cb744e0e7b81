"""Trainer configuration: a tree of frozen, typed dataclasses, validated at the boundary.

A leaf module: it imports only leaf types and constants (GRPO names, the model's shape config and L formats) and
does no I/O; reading YAML files and resolving `model.path` happen in the entry points and the trainer.
Longer than ~300 lines on purpose: every key a user can set is in this one file, next to its check.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from typing import Any

import yaml

from hilore_jax import grpo
from hilore_jax.errors import ConfigError, check_choice, check_positive, check_range
from hilore_jax.model.codec import FORMATS
from hilore_jax.model.config import ModelConfig

_ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                     if f.name not in ("dtype", "param_dtype", "attention"))
# memory.policy: none keeps every activation, gc recomputes every layer, hilore plans H/L/R(/O) per unit by
# exposure; the rest are the benchmark's baselines (memory/methods.py implements one planner per name)
MEMORY_POLICIES = ("none", "gc", "sac", "optimal_hr", "uniform_int8", "uniform_int8_gc", "greedy_bits",
                   "greedy_bits_gc", "adacc_style", "hilore")
REPLAY_MODES = ("fresh_anchored", "naive")


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """model.path (a local HF checkpoint) or HF-named shape fields for a randomly initialised model."""

  path: str | None = None
  init_std: float = 0.02
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  attention: str = "xla"  # xla | dot_product_attention (jax.nn's fused kernel: cuDNN flash attention on GPU)
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
        ModelConfig(dtype=self.dtype, param_dtype=self.param_dtype, attention=self.attention)  # numerics alone
    except ValueError as e:
      raise ConfigError(str(e) if str(e).startswith("model.") else f"model: {e}") from None

  def shape_config(self) -> ModelConfig:
    """The model config of a randomly initialised model (model.path unset)."""
    return ModelConfig(**dict(self.arch), dtype=self.dtype, param_dtype=self.param_dtype, attention=self.attention)


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
  """Difficulty knobs of the synthetic arithmetic task (task.arithmetic.*)."""

  seed: int = 0
  min_value: int = 0
  max_value: int = 99
  num_terms: int = 2
  ops: tuple[str, ...] = ("+",)
  num_test: int = 200
  teacher_error_rate: float = 0.0  # share of warm-start targets where the teacher answers one too high
  fixed_width: bool = False  # zero-pad operands and gold answers to a fixed width ('07+45=' -> '052')
  # completions of varying length: the answer, '#', then a tail (the first operand once, and once more per unit of
  # the others' last digit): '3+5=' -> '8#3,3,3,3,3,3'; the reward reads the answer before the '#'
  scratchpad: bool = False

  def __post_init__(self):
    check_range("task.arithmetic.teacher_error_rate", self.teacher_error_rate, 0.0, 1.0)
    if self.min_value < 0 or self.max_value < self.min_value:
      raise ConfigError(f"task.arithmetic needs 0 <= min_value <= max_value, got {self.min_value}, "
                        f"{self.max_value}")
    if self.num_terms < 2:
      raise ConfigError(f"task.arithmetic.num_terms must be >= 2, got {self.num_terms}")
    bad = sorted(set(self.ops) - {"+", "-", "*"})
    if bad or not self.ops:
      raise ConfigError(f"task.arithmetic.ops must be a non-empty subset of ['+', '-', '*'], got {list(self.ops)}")
    check_positive("task.arithmetic.num_test", self.num_test)
    if self.scratchpad and "*" in self.ops:
      raise ConfigError("task.arithmetic.scratchpad counts digits of the later operands: ops must not include '*'")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  kind: str = "arithmetic"  # arithmetic | gsm8k | math
  seed: int = 0  # shuffling of dataset tasks
  arithmetic: ArithmeticSpec = ArithmeticSpec()
  train_path: str | None = None  # gsm8k / math JSONL
  test_path: str | None = None
  skip_malformed: bool = False
  prompt_template: str = "{question}\n"  # gsm8k: {question} is replaced (other braces are text); the user turn in chat
  prompt_format: str = "template"  # template: the text as is | chat: inside the tokenizer's chat template
  system_prompt: str | None = None  # chat only: a system message before the user's

  def __post_init__(self):
    check_choice("task.kind", self.kind, ("arithmetic", "gsm8k", "math"))
    if self.kind != "arithmetic" and not (self.train_path and self.test_path):
      raise ConfigError(f"task.kind={self.kind} needs task.train_path and task.test_path (JSONL files)")
    if "{question}" not in self.prompt_template:
      raise ConfigError(f"task.prompt_template must contain {{question}}, got {self.prompt_template!r}")
    check_choice("task.prompt_format", self.prompt_format, ("template", "chat"))
    if self.system_prompt is not None and self.prompt_format != "chat":
      raise ConfigError("task.system_prompt needs task.prompt_format=chat (with a template, write it into "
                        "task.prompt_template)")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Decoding settings (static for jit: a change recompiles the sampler)."""

  max_new_tokens: int = 8
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0: off
  greedy: bool = False

  def __post_init__(self):
    check_positive("rollout.max_new_tokens", self.max_new_tokens)
    if not self.greedy:
      check_positive("rollout.temperature", self.temperature)
    check_range("rollout.top_p", self.top_p, 0.0, 1.0, low_open=True)
    check_positive("rollout.top_k", self.top_k, allow_zero=True)

  def sampling(self) -> "SamplingConfig":
    """Just the decoding fields (so other settings of a subclass never recompile the sampler)."""
    return SamplingConfig(self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.greedy)


@dataclasses.dataclass(frozen=True)
class RolloutConfig(SamplingConfig):
  """Rollouts: prompts per step, G completions each, prompt length, and the decoding settings."""

  num_prompts: int = 16
  num_generations: int = 8  # G
  max_prompt_len: int = 16

  def __post_init__(self):
    super().__post_init__()
    check_positive("rollout.num_prompts", self.num_prompts)
    if self.num_generations < 2:
      raise ConfigError(f"rollout.num_generations must be > 1, got {self.num_generations}")
    check_positive("rollout.max_prompt_len", self.max_prompt_len)
    if self.greedy:
      raise ConfigError("rollout.greedy=true would make every completion of a group identical (zero advantage)")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """The GRPO objective and update schedule; grpo.py's numerics read the loss fields."""

  advantage: str = "grpo"  # grpo | rloo | dr_grpo
  std_scale: str = "group"  # group | batch | none
  loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)
  eps_low: float = 0.2
  eps_high: float = 0.2  # > eps_low: DAPO's clip-higher
  dual_clip: float | None = None  # c > 1 caps the loss of negative-advantage tokens at c * |A|
  beta: float = 0.0  # KL coefficient
  kl_estimator: str = "k3"
  max_completion_len: int = 0  # Dr.GRPO's constant normaliser; 0: rollout.max_new_tokens
  num_iterations: int = 1  # passes over each rollout batch
  filter_zero_std: bool = True  # drop groups whose rewards are all equal

  def __post_init__(self):
    check_choice("grpo.advantage", self.advantage, grpo.ADVANTAGES)
    check_choice("grpo.std_scale", self.std_scale, grpo.STD_SCALES)
    check_choice("grpo.loss_agg", self.loss_agg, grpo.LOSS_AGGS)
    check_choice("grpo.kl_estimator", self.kl_estimator, grpo.KL_ESTIMATORS)
    # eps = 0 puts every on-policy token on the clip boundary, where the surrogate's derivative is undefined
    check_range("grpo.eps_low", self.eps_low, 0.0, 1.0, low_open=True, high_open=True)
    check_positive("grpo.eps_high", self.eps_high)
    if self.dual_clip is not None and self.dual_clip <= 1:
      raise ConfigError(f"grpo.dual_clip must be > 1 (or null), got {self.dual_clip}")
    check_positive("grpo.beta", self.beta, allow_zero=True)
    check_positive("grpo.max_completion_len", self.max_completion_len, allow_zero=True)
    check_positive("grpo.num_iterations", self.num_iterations)


OPTIMIZERS = ("adamw", "logra")


@dataclasses.dataclass(frozen=True)
class LograConfig:
  """optimizer.logra.*: Adam(W) moments in a rank-`rank` subspace of each weight matrix (hilore_jax/logra.py)."""

  rank: int = 8  # r: columns of each matrix's projection P [M, r]; matrices with a smaller side < r stay dense
  refresh_every: int = 200  # updates between refits of P (GaLore's T); the first update fits it
  oversample: int = 8  # extra columns of the range finder's Gaussian test matrix
  power_iters: int = 2  # power iterations of the range finder
  min_dim: int = 0  # matrices whose smaller side is below this stay dense
  scale: float = 1.0  # the projected-back update is multiplied by this (GaLore's alpha)
  seed: int = 0  # the range finder's PRNG seed

  def __post_init__(self):
    check_positive("optimizer.logra.rank", self.rank)
    check_positive("optimizer.logra.refresh_every", self.refresh_every)
    check_positive("optimizer.logra.oversample", self.oversample, allow_zero=True)
    check_positive("optimizer.logra.power_iters", self.power_iters, allow_zero=True)
    check_positive("optimizer.logra.min_dim", self.min_dim, allow_zero=True)
    check_positive("optimizer.logra.scale", self.scale)
    check_positive("optimizer.logra.seed", self.seed, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
  """optimizer.kl_control.*: scale each update so its predicted per-token KL stays under `target` (kl_control.py)."""

  target: float = 0.0  # nats per completion token; 0: off (the update program is then exactly the plain one)
  chunk: int = 128  # sequence positions per logits chunk of the KL's forward and JVP

  def __post_init__(self):
    check_positive("optimizer.kl_control.target", self.target, allow_zero=True)
    check_positive("optimizer.kl_control.chunk", self.chunk)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  kind: str = "adamw"  # adamw | logra (AdamW on low-rank gradient sketches; settings under optimizer.logra)
  lr: float = 1e-5
  schedule: str = "constant"  # constant | cosine (after linear warmup)
  warmup_steps: int = 0
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0  # 0: no clipping
  logra: LograConfig = LograConfig()
  kl_control: KLControlConfig = KLControlConfig()  # with either kind

  def __post_init__(self):
    check_choice("optimizer.kind", self.kind, OPTIMIZERS)
    check_choice("optimizer.schedule", self.schedule, ("constant", "cosine"))
    check_positive("optimizer.lr", self.lr)
    check_positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)
    check_range("optimizer.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
    check_positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
    check_range("optimizer.b1", self.b1, 0.0, 1.0, high_open=True)
    check_range("optimizer.b2", self.b2, 0.0, 1.0, high_open=True)
    check_positive("optimizer.eps", self.eps)
    check_positive("optimizer.max_grad_norm", self.max_grad_norm, allow_zero=True)


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
    check_positive("train.steps", self.steps)
    check_positive("train.minibatch_size", self.minibatch_size, allow_zero=True)
    check_positive("train.microbatch_size", self.microbatch_size, allow_zero=True)
    check_positive("train.logprob_chunk", self.logprob_chunk)
    check_positive("train.warmstart_steps", self.warmstart_steps, allow_zero=True)
    check_positive("train.warmstart_lr", self.warmstart_lr)
    check_positive("train.warmstart_batch_size", self.warmstart_batch_size)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  num_examples: int = 200
  pass_k: int = 4
  temperature: float = 1.0
  batch_size: int = 128
  at_start: bool = True
  at_end: bool = True

  def __post_init__(self):
    check_positive("eval.num_examples", self.num_examples)
    check_positive("eval.pass_k", self.pass_k, allow_zero=True)
    check_positive("eval.temperature", self.temperature)
    check_positive("eval.batch_size", self.batch_size)


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
class ExposureSwitches:
  """Terms of the exposure score, each switchable for ablations (memory.exposure.*)."""

  ratio_clip: bool = True  # use w_t (ratio, clip mask); off: |advantage| per token
  update_mask: bool = True  # only tokens that are updated; off: every position counts
  kl: bool = True  # include the beta * KL part of w_t
  activation: bool = True  # weight by the unit's per-token reconstruction error; off: 1
  susceptibility: bool = True  # per-unit measured factor; off: 1


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  policy: str = "none"  # one of MEMORY_POLICIES
  budget_ratio: float = 1.05  # memory budget as a multiple of the GC step's peak bytes
  budget_bytes: int | None = None  # absolute budget (overrides budget_ratio)
  grad_err_tolerance: float = 0.01  # relative gradient error the risk budget is calibrated to
  buckets: int = 4  # hilore: exposure buckets, one allocation (and compiled step) each
  refresh_every: int = 0  # recalibrate every N steps (0: only at the start)
  group_size: int = 64  # L codes: one scale per group along the last axis
  lowp_format: str = "int8"  # L codes: int8 | fp8_e4m3 | int4 | bf16
  calib_batches: int = 2  # K: minibatches the risk calibration measures
  calib_sets: int = 6  # random L sets per calibration batch to fit how coherently units' errors add
  solver: str = "exact"  # exact (MILP) | greedy: the allocator of the solved methods; the other's gap is logged
  # exact: the relative optimality gap HiGHS must prove (0: proven optimal). Below ~0.5% some two-budget plans took
  # minutes to prove (measured: 217 s at 0.1%, 0.7 s at 0.5%, the same plan time to 0.06%)
  mip_gap: float = 0.005
  offload: bool = False  # allow O (offload to host memory); GPU/TPU only
  budget_probes: int = 4  # compiles per bucket to fit the plan's byte allowance to the compiled peak
  exposure: ExposureSwitches = ExposureSwitches()

  def __post_init__(self):
    check_choice("memory.policy", self.policy, MEMORY_POLICIES)
    check_choice("memory.lowp_format", self.lowp_format, FORMATS)
    check_positive("memory.calib_batches", self.calib_batches)
    check_positive("memory.calib_sets", self.calib_sets, allow_zero=True)
    check_choice("memory.solver", self.solver, ("exact", "greedy"))
    check_positive("memory.budget_probes", self.budget_probes)
    if not 0.0 <= self.mip_gap < 1.0:
      raise ConfigError(f"memory.mip_gap must be in [0, 1) (a relative optimality gap), got {self.mip_gap}")
    if self.budget_ratio < 1.0:
      raise ConfigError(f"memory.budget_ratio must be >= 1.0 (full checkpointing is the floor), got "
                        f"{self.budget_ratio}")
    if self.budget_bytes is not None:
      check_positive("memory.budget_bytes", self.budget_bytes)
    check_positive("memory.grad_err_tolerance", self.grad_err_tolerance)
    check_positive("memory.buckets", self.buckets)
    check_positive("memory.refresh_every", self.refresh_every, allow_zero=True)
    check_positive("memory.group_size", self.group_size)


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """replay.*: rollout-level replay (replay.py); off by default; mode `naive` is the uniform, whole-group,
  unbounded-age baseline."""

  enabled: bool = False
  mode: str = "fresh_anchored"  # fresh_anchored | naive
  tau_max: int = 4  # largest age (training steps) a replayed rollout may have; naive ignores it
  capacity: int = 1024  # stored rollouts (rows, not groups)
  share: float = 0.25  # replayed rows per fresh row, rounded half up, capped by what is replayable (0 fresh: none)
  priority_exponent: float = 1.0  # alpha in P(row) ~ |A|^alpha; 0 is uniform; naive is always uniform
  group_size: int = 0  # G rows per prompt; 0: rollout.num_generations (the only value a run accepts)

  def __post_init__(self):
    check_choice("replay.mode", self.mode, REPLAY_MODES)
    if self.tau_max < 1:
      raise ConfigError(f"replay.tau_max must be >= 1 (rows are replayable from the step after their birth), "
                        f"got {self.tau_max}")
    check_positive("replay.capacity", self.capacity)
    check_positive("replay.share", self.share, allow_zero=True)
    check_positive("replay.priority_exponent", self.priority_exponent, allow_zero=True)
    if self.group_size == 1 or self.group_size < 0:
      raise ConfigError(f"replay.group_size must be > 1 (or 0: rollout.num_generations), got {self.group_size}")
    if self.mode == "naive" and self.group_size and self.capacity % self.group_size:
      raise ConfigError(f"replay.capacity ({self.capacity}) must be a multiple of replay.group_size "
                        f"({self.group_size}) in naive mode, which stores whole groups")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """`python -m train.bench`: the actor update of every method on synthetic GRPO minibatches."""

  batch_size: int = 8  # rows per minibatch (groups x group_size)
  group_size: int = 4  # responses per prompt
  seq_len: int = 256  # prompt + completion tokens
  prompt_len: int = 64
  budget_ratios: tuple[float, ...] = (1.00, 1.05, 1.10)
  methods: tuple[str, ...] = MEMORY_POLICIES
  reps: int = 9  # timed steps per method (interleaved; medians)
  zero_adv_frac: float = 0.25  # share of groups whose rewards are all equal
  logp_noise: float = 0.3  # old log-probs = current + N(0, this): some ratios clip
  risk_batches: int = 4  # held-out batches for the risk-prediction table
  risk_sets: int = 8  # random L sets whose measured error validates the set-risk model on the held-out batches
  unit_risk_table: bool = True  # per-unit risk-prediction table (risk.md): one probe gradient per unit and batch

  def __post_init__(self):
    for k in ("batch_size", "group_size", "seq_len", "prompt_len", "reps"):
      check_positive(f"bench.{k}", getattr(self, k))
    if self.batch_size % self.group_size:
      raise ConfigError(f"bench.batch_size ({self.batch_size}) must be a multiple of bench.group_size "
                        f"({self.group_size})")
    if not 0 < self.prompt_len < self.seq_len:
      raise ConfigError(f"bench.prompt_len must be in (0, bench.seq_len={self.seq_len}), got {self.prompt_len}")
    for r in self.budget_ratios:
      if r < 1.0:
        raise ConfigError(f"bench.budget_ratios must be >= 1.0 (full checkpointing is the floor), got {r}")
    for m in self.methods:
      check_choice("bench.methods", m, MEMORY_POLICIES)
    check_range("bench.zero_adv_frac", self.zero_adv_frac, 0.0, 1.0)
    check_positive("bench.logp_noise", self.logp_noise, allow_zero=True)
    check_positive("bench.risk_batches", self.risk_batches, allow_zero=True)
    check_positive("bench.risk_sets", self.risk_sets, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class ExposureBenchConfig:
  """`python -m train.bench_exposure`: run-time exposure on real rollout minibatches (bench/exposure.py)."""

  rollout_steps: int = 4  # rollouts of the warm-started policy; each gives grpo.num_iterations passes of minibatches
  calib_minibatches: int = 8  # the first minibatches (step 0, first pass) calibrate; every later one is held out
  budget_ratio: float = 1.10  # every arm's memory budget, a multiple of the GC step's peak
  reps: int = 5  # interleaved timing rounds over every distinct plan
  bootstrap: int = 2000  # resamples of the held-out minibatches for the Spearman CIs
  arms: bool = True  # false: risk prediction only (no per-arm plans, budget fits or timing)

  def __post_init__(self):
    for k in ("rollout_steps", "calib_minibatches", "reps", "bootstrap"):
      check_positive(f"bench_exposure.{k}", getattr(self, k))
    if self.budget_ratio < 1.0:
      raise ConfigError(f"bench_exposure.budget_ratio must be >= 1.0, got {self.budget_ratio}")


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
  bench: BenchConfig = BenchConfig()
  bench_exposure: ExposureBenchConfig = ExposureBenchConfig()

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
    G = self.rollout.num_generations
    if self.replay.group_size not in (0, G):
      raise ConfigError(f"replay.group_size ({self.replay.group_size}) must equal rollout.num_generations ({G}) "
                        f"or be 0")
    if self.replay.group_size != G:  # validated again with G: naive mode's capacity must hold whole groups
      object.__setattr__(self, "replay", dataclasses.replace(self.replay, group_size=G))
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
    if value is None:
      return None
    return _coerce(key, value, args[0])
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


def _build(cls, d: dict, prefix: str):
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
      kwargs[key] = _build(tp, dict(value) if isinstance(value, dict) else ({} if value is None else value),
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


def from_dict(d: dict, overrides: list[str] = ()) -> Config:
  """A loaded YAML mapping plus dotted overrides -> validated Config."""
  return _build(Config, _merge(d, parse_overrides(list(overrides))), "")


