"""The memory manager's state: what calibration measured and everything a resumed run needs to allocate exactly as
the interrupted one did (typed, JSON-serialisable, saved with every checkpoint; older versions converted)."""

from __future__ import annotations

import dataclasses

from hilore_jax.errors import CheckpointError

STATE_VERSION = 3


@dataclasses.dataclass
class Calibration:
  """What risk calibration measured: per-unit errors, susceptibility and error profile, the risk budget."""

  susceptibility: list[float]
  predicted_error: list[float]  # [U] mean over calibration batches of the run-time score (each unit's level 0)
  static_error: list[float]  # [U] mean measured error
  delta: float
  calibration_error: float
  calibration_level: float  # mean over calibration batches of the summed predicted unit errors
  level_max: float  # their largest
  fit: dict
  calib_batches: int
  coherence: float = 1.0  # measured set error / sum of its units' errors, the largest over calibration sets
  set_fit: dict = dataclasses.field(default_factory=dict)  # linear vs orthogonal model on the calibration sets
  unit_errors: list = dataclasses.field(default_factory=list)  # [K][U] measured per-unit errors
  profile: list = dataclasses.field(default_factory=list)  # [U][T] per-position RMS reconstruction error
  score_max: list = dataclasses.field(default_factory=list)  # [U] largest run-time score over calibration batches
  prompt_profile: list = dataclasses.field(default_factory=list)  # [U][P-1] the same at prompt positions
  grad_scale: float = 1.0  # ||g|| per unit of the predictor's summed token weights (the clipped score's scale)
  risk_metric: str = "relative"  # what the errors above are errors of (memory.risk_metric)
  predictor: str = "exposure_v1"  # the run-time score susceptibility was fitted to (memory.exposure.predictor)
  # [U] each unit's calibrated error: its memory.calib_quantile over the calibration minibatches (hilore's static
  # risk, coherence not included); empty in older states (the largest score stands in)
  static_risk: list = dataclasses.field(default_factory=list)
  quantile: float = 0.9
  gate: dict = dataclasses.field(default_factory=dict)  # the exposure gate's inputs and decision (memory/gate.py)
  # the drift sentinels' calibration values (memory/drift.py): each minibatch's ||g||, each unit's reconstruction RMS
  grad_norms: list = dataclasses.field(default_factory=list)
  recon_rms: list = dataclasses.field(default_factory=list)
  # the unit kinds it measured, every layer's (empty: all of memory.lowp_kinds): the kinds the plan with every L
  # unit free of risk held in L (memory/lgain.py); no other kind is L in its plans
  kinds: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ManagerState:
  """Everything a resumed run needs to allocate exactly as the interrupted one did."""

  gc_bytes: int
  budget_bytes: int
  profile: dict
  calibrated_at: int
  calibration: Calibration | None = None
  buckets: list[list[int]] = dataclasses.field(default_factory=list)  # hilore: unit level vectors, by index
  allowance: dict[str, int] = dataclasses.field(default_factory=dict)  # bucket -> fitted byte allowance
  verified: list[int] = dataclasses.field(default_factory=list)
  fallback_gc: list[int] = dataclasses.field(default_factory=list)
  # buckets whose fitted plan is the risk-free one (H/R only): the method's own fit compiled to a slower plan
  risk_free: list[int] = dataclasses.field(default_factory=list)
  # measured seconds per update minibatch of steps without a compile: under full checkpointing and under the plans
  timings: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {"gc": [], "plan": []})
  # what the measured guard decided: "" not yet, "plan" the plans ran faster than GC, "gc" they did not (GC runs)
  guard: str = ""
  warmup_steps: int = 0  # steps run on GC before the plans (memory/warmup.py)
  # the drift sentinels between steps (memory/drift.py): the last step's ||g|| per update, the last check's step,
  # and the references that follow the run (moving averages of this run's own ||g|| / c and L units' RMS)
  drift_grad_norms: list[float] = dataclasses.field(default_factory=list)
  drift_checked_at: int = 0
  drift_ref: dict = dataclasses.field(default_factory=dict)
  # this run's calibrations (set-up's and drift's) and recalibrations (drift's) so far: a resumed run goes on
  # counting, a run that takes a cached state starts again at 0
  calibrations: int = 0
  recalibrations: int = 0
  # whether calibrating L can change the plan, decided before any risk is measured (memory/lgain.py): the risk-free
  # fit, the fit with every L unit free of risk, L's predicted gain against the measured noise, and the kinds
  lgain: dict = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    return {"version": STATE_VERSION, **dataclasses.asdict(self)}

  @classmethod
  def from_json(cls, d: dict) -> "ManagerState":
    """A saved state; version 1 (a flat dict, written before this class existed) is converted."""
    d = dict(d)
    version = d.pop("version", 1)
    if version == 1:  # calibration keys sat beside the rest
      cal_keys = [f.name for f in dataclasses.fields(Calibration)]
      cal = {k: d.pop(k) for k in cal_keys if k in d}
      if "calibration_level" in cal:
        cal["level_max"] = d.get("max_level", cal["calibration_level"])
      d = {k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}}
      d["calibration"] = cal if len(cal) == len(cal_keys) else None
    if version == 2 and d.pop("edges", None):  # hilore's scalar exposure buckets: replan, recalibrate
      d.update(allowance={}, verified=[], fallback_gc=[], risk_free=[])
      if d.get("calibration"):
        d["calibration"] = {k: v for k, v in d["calibration"].items() if k not in ("profile", "score_max")}
    d.pop("max_level", None)
    if version not in (1, 2, STATE_VERSION):
      raise CheckpointError(f"memory manager state version {version} is newer than this code's {STATE_VERSION}")
    try:
      cal = d.pop("calibration", None)
      return cls(**d, calibration=Calibration(**cal) if cal else None)
    except TypeError as e:
      raise CheckpointError(f"memory manager state in the checkpoint does not match this version: {e}") from None
