"""The RL wing's settings: rollouts and decoding (rollout.*), the GRPO objective (grpo.*), the update schedule
(train.*), evaluation (eval.*) and rollout replay (replay.*)."""

from __future__ import annotations

import dataclasses

from hilore_jax.errors import ConfigError, check_choice, check_positive, check_range
from hilore_jax.rl import grpo

REPLAY_MODES = ("fresh_anchored", "naive")
ROLLOUT_DTYPES = ("", "float32", "bfloat16")  # "": the model's compute dtype
SHUFFLES = ("group", "row")  # train.shuffle: minibatches of whole groups, or of rows


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
class DecodeConfig:
  """How the JAX rollout engine runs its decode loop (rl/sampler.py; static: a change recompiles its programs)."""

  dtype: str = ""  # compute dtype of the decode: "" the model's, float32 or bfloat16 (params cast once per call)
  segment: int = 16  # tokens decoded on the device between host checks (finished rows leave at each check)
  cache_bucket: int = 128  # completion tokens the first KV cache holds; it doubles when full, up to max_new_tokens
  attention_chunk: int = 128  # cache slots a decode step's attention reads at a time, up to the filled ones
  compact: bool = True  # finished rows leave the batch at each check (into the smallest row bucket that holds it)

  def __post_init__(self):
    check_choice("rollout.dtype", self.dtype, ROLLOUT_DTYPES)
    check_positive("rollout.decode_segment", self.segment)
    check_positive("rollout.cache_bucket", self.cache_bucket)
    check_positive("rollout.attention_chunk", self.attention_chunk)


@dataclasses.dataclass(frozen=True)
class RolloutConfig(SamplingConfig):
  """Rollouts: prompts per step, G completions each, prompt length, the decoding settings, and the engine that
  samples (rl/rollout_engine.py) with its decode settings."""

  num_prompts: int = 16
  num_generations: int = 8  # G
  max_prompt_len: int = 16
  engine: str = "jax"  # a registered rollout engine (rl/rollout_engine.py): jax, the in-process KV-cache sampler
  dtype: str = DecodeConfig.dtype
  decode_segment: int = DecodeConfig.segment
  cache_bucket: int = DecodeConfig.cache_bucket
  attention_chunk: int = DecodeConfig.attention_chunk
  compact_rows: bool = DecodeConfig.compact

  def decoding(self) -> DecodeConfig:
    """The JAX engine's decode settings."""
    return DecodeConfig(self.dtype, self.decode_segment, self.cache_bucket, self.attention_chunk, self.compact_rows)

  def __post_init__(self):
    super().__post_init__()
    self.decoding()  # validated at the boundary
    if not self.engine or not isinstance(self.engine, str):
      raise ConfigError(f"rollout.engine must name a rollout engine (jax), got {self.engine!r}")
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
  # k3 only: clip the log-ratio log(ref / pi) to [-kl_clamp, kl_clamp] in the KL term and its gradient (tokens
  # beyond it get no KL gradient), bounding the 1 - r that collapsed tokens give; None: off
  kl_clamp: float | None = None
  max_completion_len: int = 0  # Dr.GRPO's constant normaliser; 0: rollout.max_new_tokens
  num_iterations: int = 1  # passes over each rollout batch
  filter_zero_std: bool = True  # drop groups whose rewards are all equal
  # where an off-policy update's old log-probs of fresh rows come from: forward (a log-prob pass at the rollout's
  # params before the step's first update) or sampler (the sampler's own log-probs of its tokens: the same tempered
  # softmax at the same params, so no forward pass; float32 differences of the KV-cache path ~1e-6; needs
  # rollout.top_k 0 and top_p 1, whose truncation the update's log-probs do not apply)
  old_logp: str = "forward"

  def __post_init__(self):
    check_choice("grpo.advantage", self.advantage, grpo.ADVANTAGES)
    check_choice("grpo.old_logp", self.old_logp, ("forward", "sampler"))
    check_choice("grpo.std_scale", self.std_scale, grpo.STD_SCALES)
    check_choice("grpo.loss_agg", self.loss_agg, grpo.LOSS_AGGS)
    check_choice("grpo.kl_estimator", self.kl_estimator, grpo.KL_ESTIMATORS)
    # eps = 0 puts every on-policy token on the clip boundary, where the surrogate's derivative is undefined
    check_range("grpo.eps_low", self.eps_low, 0.0, 1.0, low_open=True, high_open=True)
    check_positive("grpo.eps_high", self.eps_high)
    if self.dual_clip is not None and self.dual_clip <= 1:
      raise ConfigError(f"grpo.dual_clip must be > 1 (or null), got {self.dual_clip}")
    check_positive("grpo.beta", self.beta, allow_zero=True)
    if self.kl_clamp is not None:
      check_positive("grpo.kl_clamp", self.kl_clamp)
      if self.kl_estimator != "k3":
        raise ConfigError(f"grpo.kl_clamp bounds the k3 estimator's log-ratio; kl_estimator is {self.kl_estimator}")
    check_positive("grpo.max_completion_len", self.max_completion_len, allow_zero=True)
    check_positive("grpo.num_iterations", self.num_iterations)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 100
  minibatch_size: int = 0  # sequences per optimizer update; 0: the whole batch
  microbatch_size: int = 0  # sequences per gradient-accumulation slice; 0: the whole minibatch
  # the token budget (rl/token_budget.py): a minibatch's rows packed by completion length into microbatches of at
  # most this many positions (rows x (prompt + bucket cap)); 0: off, rows padded to rollout.max_new_tokens
  max_tokens_per_microbatch: int = 0
  max_tokens_per_logprob_pass: int = 0  # the same for the old and reference log-prob forwards; 0: off
  length_buckets: int = 3  # completion-length caps max_new_tokens / 2^k, k < length_buckets (with a budget on)
  # rows packed end to end (rl/packing.py): each budget above is then a buffer of that many positions (per pass,
  # split over the mesh's devices), with smaller ones of budget / 2^k, k < length_buckets, for a minibatch's rest;
  # segment ids keep the rows apart. False: the budget's length buckets (rows padded to a bucket's cap)
  packing: bool = False
  # with packing, buffer lengths every multiple of this many positions up to the budget (one compiled shape each):
  # a minibatch's rest takes one buffer within a granule of its tokens, where the budget / 2^k ladder takes up to
  # length_buckets buffers, each with its own prompt table; 0: that ladder (unused without packing)
  packing_granule: int = 0
  # a minibatch is packed only where its buffers compute at least this fraction of positions fewer than the padded
  # layout under the same budget (rows padded to a length bucket's cap; every row at the cap in one microbatch: the
  # step without a budget), which it runs otherwise: packing that removes no padding still pays for a buffer's
  # attention; 0: always packed
  packing_min_saving: float = 0.1
  # how minibatches are drawn: whole groups (a minibatch's prompt table then serves G rows each) or rows
  shuffle: str = "group"
  logprob_chunk: int = 128
  resume: bool = False
  warmstart_steps: int = 0  # supervised steps on task answers before GRPO (from scratch models)
  warmstart_lr: float = 1e-3
  warmstart_batch_size: int = 64
  # a group's prompt computed once in the update (rl/prompt_share.py): exact, so on unless switched off
  share_prompt: bool = True

  def __post_init__(self):
    check_positive("train.steps", self.steps)
    check_positive("train.minibatch_size", self.minibatch_size, allow_zero=True)
    check_positive("train.microbatch_size", self.microbatch_size, allow_zero=True)
    check_positive("train.max_tokens_per_microbatch", self.max_tokens_per_microbatch, allow_zero=True)
    check_positive("train.max_tokens_per_logprob_pass", self.max_tokens_per_logprob_pass, allow_zero=True)
    check_positive("train.length_buckets", self.length_buckets)
    check_choice("train.shuffle", self.shuffle, SHUFFLES)
    check_positive("train.packing_granule", self.packing_granule, allow_zero=True)
    check_range("train.packing_min_saving", self.packing_min_saving, 0, 1, high_open=True)
    if self.packing and not self.max_tokens_per_microbatch:
      raise ConfigError("train.packing=true packs rows into buffers of train.max_tokens_per_microbatch positions: "
                        "set it (> 0), e.g. to the rows x (prompt + completion) a microbatch holds at the cap")
    if self.max_tokens_per_microbatch and self.microbatch_size:
      raise ConfigError(f"train.microbatch_size ({self.microbatch_size}) and train.max_tokens_per_microbatch "
                        f"({self.max_tokens_per_microbatch}) both set the microbatches: set one (the other 0)")
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
