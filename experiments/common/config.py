"""The benchmarks' own sections (bench.*, bench_exposure.*): kept out of the trainer's Config, read beside it from
the same YAML file by `load` (the rest of the file is an ordinary trainer config)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hilore_jax import config as config_lib
from hilore_jax.errors import ConfigError, check_choice, check_positive, check_range
from hilore_jax.memory.config import MEMORY_POLICIES, check_budget_ratio, check_policy
from hilore_jax.model.codec import FORMATS


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """`python -m experiments.bench.main`: the actor update of every method on synthetic GRPO minibatches."""

  batch_size: int = 8  # rows per minibatch (groups x group_size)
  group_size: int = 4  # responses per prompt
  seq_len: int = 256  # prompt + completion tokens
  prompt_len: int = 64
  budget_ratios: tuple[float, ...] = (1.00, 1.05, 1.10)
  methods: tuple[str, ...] = MEMORY_POLICIES
  reps: int = 9  # the fewest interleaved timing rounds (one timed step per configuration each)
  # more rounds until every row's gain CI is at most +/- this many points, or the timing has run time_cap_s
  ci_halfwidth_pct: float = 2.0
  time_cap_s: float = 1200.0
  # measures that may lower the noise floor, recorded in results.json (timing.measures) so runs can be compared:
  warmup_rounds: int = 1  # untimed interleaved rounds first (first-call allocations, caches)
  pause_python_gc: bool = False  # gc.collect() before each round, Python's collector off while it runs
  zero_adv_frac: float = 0.25  # share of groups whose rewards are all equal
  logp_noise: float = 0.3  # old log-probs = current + N(0, this): some ratios clip
  # diagnostics beside the timing, each off or minimal unless asked for (a per-unit table costs a probe gradient per
  # unit and batch: over half an hour at 8 layers, hidden 512)
  risk_batches: int = 1  # held-out batches: gradient errors beyond the timed batch, and the risk diagnostics'
  risk_sets: int = 0  # random L sets whose measured error validates the set-risk model on the held-out batches
  unit_risk_table: bool = False  # per-unit risk-prediction table (risk.md): one probe gradient per unit and batch
  roofline: bool = False  # a projected H200 step time per plan (capacity/roofline.py): one more compile per plan

  def __post_init__(self):
    for k in ("batch_size", "group_size", "seq_len", "prompt_len", "reps"):
      check_positive(f"bench.{k}", getattr(self, k))
    if self.batch_size % self.group_size:
      raise ConfigError(f"bench.batch_size ({self.batch_size}) must be a multiple of bench.group_size "
                        f"({self.group_size})")
    if not 0 < self.prompt_len < self.seq_len:
      raise ConfigError(f"bench.prompt_len must be in (0, bench.seq_len={self.seq_len}), got {self.prompt_len}")
    for r in self.budget_ratios:
      check_budget_ratio("bench.budget_ratios", r)
    for m in self.methods:
      check_policy("bench.methods", m)
    check_range("bench.zero_adv_frac", self.zero_adv_frac, 0.0, 1.0)
    check_positive("bench.logp_noise", self.logp_noise, allow_zero=True)
    check_positive("bench.risk_batches", self.risk_batches, allow_zero=True)
    check_positive("bench.risk_sets", self.risk_sets, allow_zero=True)
    check_positive("bench.ci_halfwidth_pct", self.ci_halfwidth_pct)
    check_positive("bench.time_cap_s", self.time_cap_s)
    check_positive("bench.warmup_rounds", self.warmup_rounds, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class E1Criteria:
  """Issue 36's pre-registered criteria (bench_exposure.criteria.*; experiments/exposure/e1.py reads them)."""

  regime_clipfrac_min: float = 0.02  # rollout 0's second pass clips at least this share of tokens
  regime_length_ratio_min: float = 4.0  # rollout 0's completion lengths, p90 / p10
  p1_paper_like: float = 2.5  # P1: median over units of the within-unit p90 / p10 of the error
  p1_nothing: float = 1.5  # at or under it: nothing to predict
  p2_static_points: float = 3.0  # P2: oracle minus static, recompute removed (FLOPs points) at the violation target
  p2_periodic_points: float = 2.0  # and oracle minus periodic static
  p3_rho: float = 0.5  # P3: the chosen predictor's within-unit rho (median over units)
  p3_rho_ci_low: float = 0.3  # its cluster-bootstrap CI's low end
  p3_headroom_share: float = 0.5  # and this share of the oracle's headroom over static
  p4_paper: tuple[float, ...] = (0.78, 0.81, 0.89)  # P4: the paper's cross-unit rho, top-10% recall, AUROC


@dataclasses.dataclass(frozen=True)
class E1bSettings:
  """Issue 47's experiment E1b (bench_exposure.e1b.*; experiments/exposure/e1b.py): exposure decided where the risk
  budget binds. Pre-registered in configs/exposure_e1b_smollm2.yaml and docs/exposure.md before it runs."""

  json: str = ""  # where the summary is written (e.g. docs/data/exposure_e1b.json); "": the bench runs, not E1b
  # the tolerance rule: this share of the calibration-median error of the most aggressive plan memory allows
  tolerance_share: float = 0.5
  # the risk budget binds: that plan's error is over the tolerance on at least this share of calibration minibatches
  binds_share: float = 0.75
  violation_target: float = 0.10  # every arm is read where its sweep first crosses this violation rate
  # the sweep: delta from sweep_start x the static arm's calibrated delta (halved while already over the target),
  # doubled until the arm crosses the target or its plans are memory's alone (never crossing: undefined), at most
  # max_doublings times; then `refine` bisections (in log delta) of the octave where it crossed
  sweep_start: float = 0.0625
  max_doublings: int = 40
  refine: int = 3
  primary_share: float = 0.15  # (oracle - static) / (ceiling - optimal_hr) at the target, cluster CI low > 0
  secondary_share: float = 0.5  # static_clip recovers this share of oracle - static
  # ... while its violation rate at the calibrated delta is at most this much above static's there
  secondary_violation_points: float = 0.05

  def __post_init__(self):
    for k in ("tolerance_share", "binds_share", "violation_target", "primary_share", "secondary_share"):
      check_range(f"bench_exposure.e1b.{k}", getattr(self, k), 0.0, 1.0, low_open=True)
    check_range("bench_exposure.e1b.sweep_start", self.sweep_start, 0.0, low_open=True)
    check_positive("bench_exposure.e1b.max_doublings", self.max_doublings)
    check_positive("bench_exposure.e1b.refine", self.refine, allow_zero=True)
    check_range("bench_exposure.e1b.secondary_violation_points", self.secondary_violation_points, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class ExposureBenchConfig:
  """`python -m experiments.exposure.main`: run-time exposure on real rollout minibatches (exposure/run.py)."""

  rollout_steps: int = 4  # rollouts of the warm-started policy; each gives grpo.num_iterations passes of minibatches
  calib_minibatches: int = 8  # the first minibatches (step 0, first pass) calibrate; every later one is held out
  reps: int = 5  # interleaved timing rounds over every distinct plan (with timing)
  bootstrap: int = 2000  # resamples of the held-out minibatches for the Spearman CIs
  arms: bool = True  # false: risk prediction only (no per-arm plans, budget fits, sweep or timing)
  timing: bool = False  # time every arm's distinct plans (step seconds); the sweep and FLOPs are never timed
  held_out: int = 0  # at most this many held-out minibatches, the first (0: every one)
  # the delta sweep of the equal-violation comparison, as multiples of the calibrated delta (0: no unit L)
  sweep: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
  violation_target: float = 0.05  # each arm read at this violation rate
  update_error: bool = True  # record every minibatch's optimizer state: the update error's column (and metric)
  kl_clamps: tuple[float, ...] = (10.0, 3.0)  # grpo.kl_clamp values whose removal of ||g||'s spread is reported
  # issue 36's experiment E1: a periodic-static arm recalibrated on this rollout (0: none), the criteria, and where
  # the P1-P4 summary is written (""; e.g. docs/data/exposure_e1.json: experiments/exposure/e1.py)
  recalibrate_rollout: int = 0
  criteria: E1Criteria = E1Criteria()
  e1_json: str = ""
  e1b: E1bSettings = E1bSettings()  # issue 47's E1b: runs instead of the bench's arms where e1b.json is set

  def __post_init__(self):
    for k in ("rollout_steps", "calib_minibatches", "reps", "bootstrap"):
      check_positive(f"bench_exposure.{k}", getattr(self, k))
    check_positive("bench_exposure.held_out", self.held_out, allow_zero=True)
    if not self.sweep or min(self.sweep) < 0:
      raise ConfigError(f"bench_exposure.sweep must be non-empty multiples >= 0 of delta, got {list(self.sweep)}")
    check_range("bench_exposure.violation_target", self.violation_target, 0.0, 1.0, low_open=True, high_open=True)
    for c in self.kl_clamps:
      check_positive("bench_exposure.kl_clamps", c)


REAL_PARTS = ("setup", "l_error", "memory", "logra")


@dataclasses.dataclass(frozen=True)
class RealBenchConfig:
  """`python -m experiments.real_model.main`: a pretrained model's memory table, L error and set-up cost (run.py)."""

  shapes: tuple[str, ...] = ("8x1024", "4x2048")  # minibatch rows x tokens per row of the compile-only memory table
  prompt_fraction: float = 0.25  # share of each row's tokens that are prompt
  methods: tuple[str, ...] = ("none", "gc", "sac", "optimal_hr", "hilore_static", "hilore")
  logra_rank: int = 32
  formats: tuple[str, ...] = ("int8", "fp8_e4m3", "int4")
  lerror_minibatches: int = 2  # rollout minibatches the L-error table measures (besides the calibration's)
  parts: tuple[str, ...] = REAL_PARTS  # what to measure; results are written after each part, so a long run keeps them

  def __post_init__(self):
    for part in self.parts:
      check_choice("bench_real.parts", part, REAL_PARTS)
    for s in self.shapes:
      rows, _, seq = s.lower().partition("x")
      if not (rows.isdigit() and seq.isdigit() and int(rows) > 0 and int(seq) > 1):
        raise ConfigError(f"bench_real.shapes entries look like ROWSxTOKENS (e.g. 8x1024), got {s!r}")
    check_range("bench_real.prompt_fraction", self.prompt_fraction, 0.0, 1.0, low_open=True, high_open=True)
    for m in self.methods:
      check_policy("bench_real.methods", m)
    check_positive("bench_real.logra_rank", self.logra_rank)
    for f in self.formats:
      check_choice("bench_real.formats", f, FORMATS)
    check_positive("bench_real.lerror_minibatches", self.lerror_minibatches)


SECTIONS = {"bench": BenchConfig, "bench_exposure": ExposureBenchConfig, "bench_real": RealBenchConfig}
# one key per fact: the memory budget of a single plan is memory.budget_ratio, the budgets a study sweeps are
# bench.budget_ratios, and the compiles that fit a plan are memory.budget_probes, for every study alike
MOVED = {"bench_exposure.budget_ratio": "memory.budget_ratio", "bench_real.budget_ratios": "bench.budget_ratios",
         "bench_real.budget_probes": "memory.budget_probes"}


def load(path: str | None, overrides: Sequence[str], section: str):
  """(trainer Config, the named bench section) from one YAML file and dotted overrides: the section (and any other
  bench section the file holds) is taken out, the rest is an ordinary trainer config."""
  d = config_lib.merged(config_lib.read_yaml(path), overrides)
  raw = {name: d.pop(name, None) for name in SECTIONS}
  for old, new in MOVED.items():
    name, key = old.split(".")
    if key in (raw[name] or {}):
      raise ConfigError(f"{old} is now {new} (one key per fact); set that instead")
  return config_lib.from_dict(d), config_lib.build(SECTIONS[section], raw[section] or {}, f"{section}.")
