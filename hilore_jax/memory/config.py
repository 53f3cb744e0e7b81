"""The memory wing's settings (memory.*): the method, its budgets, calibration and the exposure score's terms."""

from __future__ import annotations

import dataclasses

from hilore_jax.errors import ConfigError, check_choice, check_positive
from hilore_jax.model.codec import FORMATS
from hilore_jax.model.units import LOWP_UNITS

# memory.policy: none keeps every activation, gc recomputes every layer, hilore plans H/L/R(/O) per unit by
# exposure; the rest are the benchmark's baselines (memory/methods.py implements one planner per name)
MEMORY_POLICIES = ("none", "gc", "sac", "optimal_hr", "uniform_int8", "uniform_int8_gc", "greedy_bits",
                   "greedy_bits_gc", "hilore_static", "hilore")
# old policy names -> (new name, what it is): a config naming one fails with one line naming its successor
RENAMED_POLICIES = {"adacc_style": ("hilore_static", "HiLoRe with exposure off")}
# memory.risk_metric: what a unit's risk is the error of (memory/risk.py): the gradient's relative error, the error
# after global-norm clipping, or the error of the optimizer's update
RISK_METRICS = ("relative", "clipped", "update")
# memory.exposure.predictor: the run-time score of a unit's risk (memory/predictors.py)
PREDICTORS = ("exposure_v1", "cotangent", "cotangent_forward")
# memory.exposure.coherence: how token contributions add up in the gradient a score is relative to
# (exposure.token_norm): coherent (the sum) or incoherent (root sum of squares; GRPO's zero-mean advantages cancel)
COHERENCE = ("coherent", "incoherent")


def check_policy(name: str, policy: str):
  """check_choice over MEMORY_POLICIES, with a renamed policy's successor named."""
  if policy in RENAMED_POLICIES:
    new, what = RENAMED_POLICIES[policy]
    raise ConfigError(f"{name} {policy!r} is now {new!r} ({what})")
  check_choice(name, policy, MEMORY_POLICIES)


def check_budget_ratio(name: str, ratio: float):
  """The one check of a memory budget given as a multiple of full checkpointing's peak, which is its floor."""
  if ratio < 1.0:
    raise ConfigError(f"{name} must be >= 1.0 (full checkpointing is the floor), got {ratio}")


@dataclasses.dataclass(frozen=True)
class ExposureSwitches:
  """Terms of the exposure score, each switchable for ablations (memory.exposure.*)."""

  ratio_clip: bool = True  # use w_t (ratio, clip mask); off: |advantage| per token
  update_mask: bool = True  # only tokens that are updated; off: every position counts
  kl: bool = True  # include the beta * KL part of w_t
  activation: bool = True  # weight by the unit's per-token reconstruction error; off: 1
  susceptibility: bool = True  # per-unit measured factor; off: 1
  prompt: bool = True  # prompt positions count too, weighted by the attention cotangent reaching them
  # exposure_v1: |w_t| x the calibrated per-position error; cotangent: |w_t| (1 - p_t) x the same; cotangent_forward:
  # |w_t| (1 - p_t) x a forward pass's per-token errors where one is given, else the calibrated profile
  predictor: str = "exposure_v1"
  # the normaliser's token sum (exposure.token_norm): coherent sum |c_t| (the rule so far) or incoherent
  # sqrt(sum c_t^2), what GRPO's zero-mean advantages imply; incoherent makes the relative score of a flat-profile
  # unit blind to clipping, which the exposure experiment (issue 36) has to weigh before it becomes the default
  coherence: str = "coherent"

  def __post_init__(self):
    check_choice("memory.exposure.predictor", self.predictor, PREDICTORS)
    check_choice("memory.exposure.coherence", self.coherence, COHERENCE)


@dataclasses.dataclass(frozen=True)
class GateConfig:
  """When hilore runs exposure buckets (memory.gate.*; memory/gate.py): only where calibration measures all three."""

  # auto: the measured gate decides | always / never: forced (the benchmark's arms), its inputs still logged (not
  # on / off: YAML reads those as booleans)
  mode: str = "auto"
  spread_min: float = 2.0  # median over units of the within-unit p90 / p10 of the measured error
  unclipped_min: float = 0.3  # share of calibration minibatches with ||g|| under the clip
  rho_min: float = 0.4  # the predictor's leave-one-out within-unit Spearman rho (median over units)
  # calibration minibatches the gate needs to decide (a within-unit spread and a leave-one-out rank correlation
  # over fewer are no measurement): with fewer it is undecided and exposure stays off
  min_batches: int = 4

  def __post_init__(self):
    check_choice("memory.gate.mode", self.mode, ("auto", "always", "never"))
    if self.min_batches < 3:
      raise ConfigError(f"memory.gate.min_batches must be >= 3 (a leave-one-out rank correlation needs 3 points), "
                        f"got {self.min_batches}")
    check_positive("memory.gate.spread_min", self.spread_min, allow_zero=True)
    if not 0.0 <= self.unclipped_min <= 1.0:
      raise ConfigError(f"memory.gate.unclipped_min must be a share in [0, 1], got {self.unclipped_min}")
    if not -1.0 <= self.rho_min <= 1.0:
      raise ConfigError(f"memory.gate.rho_min must be a correlation in [-1, 1], got {self.rho_min}")


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  policy: str = "none"  # one of MEMORY_POLICIES
  budget_ratio: float = 1.05  # memory budget as a multiple of the GC step's peak bytes
  budget_bytes: int | None = None  # absolute budget (overrides budget_ratio)
  grad_err_tolerance: float = 0.01  # error (of risk_metric) the risk budget is calibrated to
  # calibration runs only where L can change the plan: where the plan the cost model picks with every L unit free
  # of risk is predicted faster than the risk-free (H/R) plan, both fitted to the budget, by more than the op
  # profile's measured noise and by at least this share of the update step (memory/lgain.py). 10%: one program's
  # compilations vary by +/-8% on a 2-core CPU (docs/real_model.md), so a smaller gain is one the measured guard could
  # not tell from a recompile
  min_l_gain: float = 0.10
  # likewise for any plan: where nothing is calibrated and the risk-free (H/R) plan is predicted to save under this
  # share of the update step against full checkpointing, no plan is fitted (no probe compile) and the run keeps GC's
  # program, as the measured guard would; 0 fits whatever is predicted faster
  min_plan_gain: float = 0.0
  risk_metric: str = "relative"  # relative | clipped | update (RISK_METRICS)
  buckets: int = 4  # hilore: exposure buckets, one allocation (and compiled step) each
  refresh_every: int = 0  # recalibrate every N steps, after the step (0: only at the start and on drift)
  group_size: int = 64  # L codes: one scale per group along the last axis
  lowp_format: str = "int8"  # L codes: int8 | fp8_e4m3 | int4 | bf16
  # the unit kinds that may be L (empty: every kind model.LOWP_UNITS allows). The projection inputs only their weight
  # gradients read (attn_norm, attn_ctx, mlp_norm, mlp_down_in) keep an L error out of every other gradient, and
  # calibration measures them exactly at every layer with one probe gradient (calibration.WEIGHT_READS)
  lowp_kinds: tuple[str, ...] = ()
  # K: minibatches the risk calibration measures, gathered (memory.warmup=gc) over the first calib_rollouts
  # rollouts while full checkpointing runs; each unit's calibrated error is its calib_quantile over them (hilore's
  # static risk: memory/gate.py); fewer minibatches than rollouts gather from only as many rollouts
  calib_batches: int = 4
  calib_rollouts: int = 2
  calib_quantile: float = 0.9
  calib_sets: int = 6  # random L sets per calibration batch to fit how coherently units' errors add
  # what one calibration probe costs: the first calib_rows rows of each calibration minibatch (0: all of them), and
  # each unit kind measured at calib_layers layers spread over depth, first and last included, the others
  # interpolated (0: every layer). Both keep the number and size of probe gradients independent of depth; errors on
  # calib_rows rows are scaled to the minibatch's row count (calibrate.rows_factor)
  calib_rows: int = 0
  calib_layers: int = 0
  # the units only their projections' weight gradients read (attn_norm, attn_ctx, mlp_norm, mlp_down_in) measured
  # exactly at every layer by one probe between them, not one probe per unit at calib_layers layers
  calib_decompose: bool = True
  solver: str = "exact"  # exact (MILP) | greedy: the allocator of the solved methods; the other's gap is logged
  # exact: the relative optimality gap HiGHS must prove (0: proven optimal). Below ~0.5% some two-budget plans took
  # minutes to prove (measured: 217 s at 0.1%, 0.7 s at 0.5%, the same plan time to 0.06%)
  mip_gap: float = 0.005
  # exact: the MILP's wall-clock limit in seconds (0: none). At the limit the plan is the faster of HiGHS' best so
  # far and greedy's, logged as unproven. Without one, Qwen2.5-1.5B's 8-device plan ran 30+ min and 13-22 GB
  mip_time_limit_s: float = 60.0
  # a solved method's plan has at most this many runs of consecutive layers with one policy (0: any): each run
  # compiles once, as a layer scan, so compile time and the compiler's memory stay flat in depth (docs/hilore.md).
  # Each run adds about a second of XLA:CPU compile at SmolLM2's width; where layers are identical two cost nothing
  plan_runs: int = 2
  offload: bool = False  # allow O (offload to host memory); GPU/TPU only
  budget_probes: int = 4  # compiles per bucket to fit the plan's byte allowance to the compiled peak
  # what runs before set-up (budget, op profile, calibration) has measured anything: gc trains the first step with
  # full checkpointing and sets up on its minibatches after it; none sets up before the first step
  warmup: str = "gc"
  # keep the set-up (calibration, fitted plans) on disk keyed by model, weights, config, shapes and code, so a
  # second run of the same recipe starts on its plans (runtime.cache_dir("memory"))
  cache: bool = True
  # the measured guard: after this many steps on the plans (without a compile), their median seconds per update
  # minibatch is compared with full checkpointing's, measured on a warm-up step; where the plans are no faster, the
  # run says so and runs GC (0: never compare)
  verify_steps: int = 2
  exposure: ExposureSwitches = ExposureSwitches()
  gate: GateConfig = GateConfig()
  # recalibration on drift (memory/drift.py), only while the running plans hold L units and only of those, after
  # a step: every step's ||g|| / c against the run's own moving average of it (a ratio either way of
  # drift_grad_ratio), and every drift_check_every steps (0: never) the L units' int8 reconstruction RMS against its
  # moving average (median ratio either way of drift_recon_ratio) and one exact gradient: the running plan's
  # realised error over the tolerance (>= drift_exact_ratio)
  drift_check_every: int = 10
  drift_grad_ratio: float = 3.0  # a step's ||g|| varies ~1.5x around its trend: 2x would recalibrate on noise
  drift_recon_ratio: float = 1.5
  drift_exact_ratio: float = 2.0

  def at_budget(self, ratio: float | None, policy: str | None = None) -> MemoryConfig:
    """This config with its budget at `ratio` x full checkpointing's peak (no absolute budget; None keeps the
    ratio), and with `policy` where given: the one way a study sets a plan's budget."""
    return dataclasses.replace(self, policy=policy or self.policy, budget_ratio=self.budget_ratio if ratio is None
                               else ratio, budget_bytes=None)

  def __post_init__(self):
    check_policy("memory.policy", self.policy)
    check_choice("memory.lowp_format", self.lowp_format, FORMATS)
    bad = [k for k in self.lowp_kinds if k not in LOWP_UNITS]
    if bad:
      raise ConfigError(f"memory.lowp_kinds: {bad} cannot be low-precision units; choose from {list(LOWP_UNITS)}")
    if self.lowp_kinds and self.policy.startswith(("uniform_", "greedy_bits")):
      raise ConfigError(f"memory.lowp_kinds restricts the solved plans (hilore, hilore_static); memory.policy "
                        f"{self.policy!r} codes every unit of a layer by definition")
    check_choice("memory.risk_metric", self.risk_metric, RISK_METRICS)
    check_positive("memory.calib_batches", self.calib_batches)
    check_positive("memory.calib_rollouts", self.calib_rollouts)
    if not 0.0 < self.calib_quantile <= 1.0:
      raise ConfigError(f"memory.calib_quantile must be in (0, 1], got {self.calib_quantile}")
    check_positive("memory.drift_check_every", self.drift_check_every, allow_zero=True)
    for name in ("drift_grad_ratio", "drift_recon_ratio", "drift_exact_ratio"):
      if not getattr(self, name) > 1.0:
        raise ConfigError(f"memory.{name} must be > 1 (a ratio that triggers recalibration), got "
                          f"{getattr(self, name)}")
    check_positive("memory.calib_sets", self.calib_sets, allow_zero=True)
    check_positive("memory.calib_rows", self.calib_rows, allow_zero=True)
    if self.calib_layers == 1 or self.calib_layers < 0:
      raise ConfigError(f"memory.calib_layers must be 0 (every layer) or >= 2 (first and last included), got "
                        f"{self.calib_layers}")
    check_choice("memory.solver", self.solver, ("exact", "greedy"))
    check_positive("memory.budget_probes", self.budget_probes)
    if isinstance(self.plan_runs, bool) or not isinstance(self.plan_runs, int) or self.plan_runs < 0:
      raise ConfigError(f"memory.plan_runs must be an integer >= 0 (0: any number of runs), got {self.plan_runs!r}")
    check_choice("memory.warmup", self.warmup, ("gc", "none"))
    check_positive("memory.verify_steps", self.verify_steps, allow_zero=True)
    if not 0.0 <= self.mip_gap < 1.0:
      raise ConfigError(f"memory.mip_gap must be in [0, 1) (a relative optimality gap), got {self.mip_gap}")
    if isinstance(self.mip_time_limit_s, bool) or not isinstance(self.mip_time_limit_s, (int, float)) or not (
        0.0 <= self.mip_time_limit_s < float("inf")):
      raise ConfigError(f"memory.mip_time_limit_s must be a number of seconds >= 0 (0: no limit), got "
                        f"{self.mip_time_limit_s!r}")
    check_budget_ratio("memory.budget_ratio", self.budget_ratio)
    if self.budget_bytes is not None:
      check_positive("memory.budget_bytes", self.budget_bytes)
    check_positive("memory.grad_err_tolerance", self.grad_err_tolerance)
    for key in ("min_l_gain", "min_plan_gain"):
      if not 0.0 <= getattr(self, key) < 1.0:
        raise ConfigError(f"memory.{key} must be a share of the update step in [0, 1), got {getattr(self, key)}")
    check_positive("memory.buckets", self.buckets)
    check_positive("memory.refresh_every", self.refresh_every, allow_zero=True)
    check_positive("memory.group_size", self.group_size)
