"""The memory manager: budget from the GC step, unit profile, risk calibration on K batches, exposure buckets for
all of a step's minibatches at once, and per bucket one plan fitted to the budget on the compiled step.

It reaches the trainer only through `StepHooks` (compile a step, take a gradient, read loss coefficients), so it
never imports a train step; its state is a typed, JSON-serialisable dataclass saved with every checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model
from hilore_jax.config import MemoryConfig
from hilore_jax.errors import CheckpointError
from hilore_jax.memory import budget as budgets
from hilore_jax.memory import calibration, methods, profile
from hilore_jax.memory.buckets import AllocationCache, Bucketer
from hilore_jax.memory.hooks import StepHooks

log = logging.getLogger(__name__)
STATE_VERSION = 2


@dataclasses.dataclass
class Calibration:
  """What risk calibration measured: per-unit errors and susceptibility, the risk budget, the exposure level."""

  susceptibility: list[float]
  predicted_error: list[float]
  static_error: list[float]
  delta: float
  calibration_error: float
  calibration_level: float  # mean exposure level of the calibration batches
  level_max: float  # their largest
  fit: dict
  calib_batches: int
  coherence: float = 1.0  # measured set error / sum of its units' errors, the largest over calibration sets
  set_fit: dict = dataclasses.field(default_factory=dict)  # linear vs orthogonal model on the calibration sets
  unit_errors: list = dataclasses.field(default_factory=list)  # [K][U] measured per-unit errors


@dataclasses.dataclass
class ManagerState:
  """Everything a resumed run needs to allocate exactly as the interrupted one did."""

  gc_bytes: int
  budget_bytes: int
  profile: dict
  calibrated_at: int
  calibration: Calibration | None = None
  edges: list[float] = dataclasses.field(default_factory=list)  # exposure bucket edges (hilore)
  max_level: float = 0.0
  allowance: dict[str, int] = dataclasses.field(default_factory=dict)  # bucket -> fitted byte allowance
  verified: list[int] = dataclasses.field(default_factory=list)
  fallback_gc: list[int] = dataclasses.field(default_factory=list)

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
    elif version != STATE_VERSION:
      raise CheckpointError(f"memory manager state version {version} is newer than this code's {STATE_VERSION}")
    try:
      cal = d.pop("calibration", None)
      return cls(**d, calibration=Calibration(**cal) if cal else None)
    except TypeError as e:
      raise CheckpointError(f"memory manager state in the checkpoint does not match this version: {e}") from None


@dataclasses.dataclass(frozen=True)
class Allocation:
  """A minibatch's decision: its bucket, plan and per-layer policies, and the alloc/memory metrics."""

  bucket: int
  plan: methods.Plan
  policies: tuple[model.LayerPolicy, ...]
  metrics: dict
  active_constraint: str = "none"  # which budget binds the plan: memory | risk | both | none


class MemoryManager:
  """Chooses every minibatch's per-layer policies under the configured method and budget."""

  def __init__(self, mc: MemoryConfig, hooks: StepHooks):
    self.mc, self.hooks, self.method = mc, hooks, mc.policy
    self.num_layers = hooks.model_cfg.num_hidden_layers
    self.state: ManagerState | None = None
    self._cache = AllocationCache(self._solve_bucket)
    self._gaps: dict[int, float] = {}
    self._active: dict[int, str] = {}
    self._units: dict[tuple[int, int], list[profile.Unit]] = {}
    self._shape: tuple[int, int] | None = None
    self.lowp_ids = calibration.lowp_units(self.num_layers)
    if mc.offload:
      methods.require_offload("memory.offload=true")
    sw = mc.exposure
    if hooks.token_weights is not None:
      def level(b):  # ||w||_2 / ||w||_1: the fewer tokens carry the update, the less rounding errors average out
        w = hooks.token_weights(None, b, sw)
        return jnp.sqrt(jnp.sum(w * w)) / jnp.maximum(jnp.sum(w), 1e-30)

      self._levels = jax.jit(jax.vmap(level))

  # ------------------------------------------------------------------ set-up

  def setup(self, params, batches: list[dict], step: int, calibration_state: Calibration | None = None):
    """Budget from the GC step, unit profile, and (for calibrated methods) risk calibration on K batches (or a
    given calibration, another manager's, to compare methods on one calibration)."""
    mc, cfg, batch = self.mc, self.hooks.model_cfg, batches[0]
    gc_bytes = self.hooks.compile_peak(model.uniform(self.num_layers, model.FULL_REMAT), batch)
    budget = budgets.budget_bytes(gc_bytes, mc.budget_ratio, mc.budget_bytes)
    rows, seq = self.hooks.batch_shape(batch)
    st = ManagerState(gc_bytes, budget, profile.profile_ops(cfg, rows, seq, mc.group_size), calibrated_at=step)
    if self.method in methods.CALIBRATED:
      st.calibration = calibration_state or self._calibrate(params, batches[:mc.calib_batches])
      if self.method == "hilore":
        st.edges = list(Bucketer.around(st.calibration.calibration_level, mc.buckets).edges)
        st.max_level = st.calibration.level_max
    self.load_state(st, f"set up at step {step}")
    log.info("memory (%s): GC %d B, budget %d B, calibration %s", self.method, gc_bytes, budget, st.calibration)

  def _calibrate(self, params, batches: list[dict]) -> Calibration:
    mc, hooks = self.mc, self.hooks
    if not hooks.calibrates:
      raise ValueError(f"memory.policy={self.method} calibrates risk: StepHooks needs gradient, token_weights and "
                       "unit_tensors")
    exact = [calibration.exact_gradient(hooks, params, b) for b in batches]
    err = np.stack([calibration.measure_unit_errors(hooks, params, b, self.lowp_ids, mc.group_size, mc.lowp_format,
                                                    ex) for b, ex in zip(batches, exact)])
    raw_fn = jax.jit(lambda p, b: calibration.raw_exposure(hooks, p, b, self.lowp_ids, mc.exposure, mc.group_size,
                                                           mc.lowp_format))
    raw = np.stack([np.asarray(raw_fn(params, b)) for b in batches])
    sus = calibration.fit_susceptibility(raw, err) if mc.exposure.susceptibility else np.ones(len(self.lowp_ids))
    pred = raw * sus
    # units' errors are not orthogonal: fit how coherently they add on random sets of these batches
    sets = calibration.random_sets(len(self.lowp_ids), mc.calib_sets, np.random.default_rng(len(self.lowp_ids)))
    set_err = np.stack([calibration.set_errors(hooks, params, b, self.lowp_ids, sets, mc.group_size, mc.lowp_format,
                                               ex) for b, ex in zip(batches, exact)])
    kappa = calibration.fit_coherence(err, sets, set_err)
    delta, measured = calibration.calibrate_delta(hooks, params, batches, self.lowp_ids, kappa * pred.mean(0),
                                                  mc.grad_err_tolerance, mc.group_size, mc.lowp_format, exact=exact)
    levels = self.levels(batches)
    return Calibration(sus.tolist(), pred.mean(0).tolist(), err.mean(0).tolist(), delta, measured,
                       float(np.mean(levels)), float(np.max(levels)),
                       calibration.risk_metrics(pred.ravel(), err.ravel()), len(batches), kappa,
                       calibration.set_fit(err.mean(0), sets, set_err.mean(0), kappa), err.tolist())

  def load_state(self, state: ManagerState | dict, reason: str = "restored from checkpoint"):
    self.state = state if isinstance(state, ManagerState) else ManagerState.from_json(state)
    self._units.clear()  # their measured times come from this profile
    self._cache.invalidate(reason)

  # ------------------------------------------------------------------ per step

  def levels(self, minibatches: list[dict]) -> np.ndarray:
    """Exposure level of every minibatch, in one jitted call and one host read (no forward pass)."""
    if self.hooks.token_weights is None:
      return np.zeros(len(minibatches))
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *minibatches)
    return np.asarray(jax.device_get(self._levels(stacked)), np.float64)

  def _unit_list(self, batch: dict) -> list[profile.Unit]:
    shape = self.hooks.batch_shape(batch)
    if shape not in self._units:
      self._units[shape] = profile.enumerate_units(self.hooks.model_cfg, *shape, self.mc.group_size,
                                                   self.state.profile, self.mc.lowp_format)
    self._shape = shape
    return self._units[shape]

  def _risks(self, bucket: int) -> tuple[dict, dict]:
    """(risk_of, sensitivity) per (layer, kind): hilore's at this bucket's exposure, static for the baselines."""
    st = self.state
    keys = [tuple(u) for u in self.lowp_ids]
    if self.method == "hilore":
      upper = Bucketer(tuple(st.edges)).upper(bucket, st.max_level)
      scale = upper / max(st.calibration.calibration_level, 1e-30)
      kappa = st.calibration.coherence
      return {k: kappa * e * scale for k, e in zip(keys, st.calibration.predicted_error)}, {}
    if self.method in methods.CALIBRATED:
      static, kappa = st.calibration.static_error, st.calibration.coherence
      return {k: kappa * e for k, e in zip(keys, static)}, dict(zip(keys, static))
    return {}, {}

  def _plan_kw(self, bucket: int, solver: str | None = None) -> dict:
    risk_of, sens = self._risks(bucket)
    cal = self.state.calibration
    return dict(risk_of=risk_of, delta=cal.delta if cal else 0.0, fmt=self.mc.lowp_format, allow_o=self.mc.offload,
                sensitivity=sens, group_size=self.mc.group_size, solver=solver or self.mc.solver)

  def _plan(self, bucket: int, allowance: int, solver: str | None = None) -> methods.Plan:
    return methods.plan(self.method, self._units[self._shape], self.state.profile["ops"], max(allowance, 0),
                        **self._plan_kw(bucket, solver))

  def _solve_bucket(self, bucket: int) -> methods.Plan:
    st = self.state
    if bucket in st.fallback_gc:
      self._active[bucket] = "none"
      return methods.plan("gc", self._units[self._shape], st.profile["ops"], 0)
    allowance = max(st.allowance.get(str(bucket), st.budget_bytes - st.gc_bytes), 0)
    plan = self._plan(bucket, allowance)
    if self.method in methods.SOLVED:  # the greedy fast path against the exact MILP, once per bucket: logged
      other = self._plan(bucket, allowance, solver="greedy" if self.mc.solver == "exact" else "exact")
      exact, greedy = (plan, other) if self.mc.solver == "exact" else (other, plan)
      self._gaps[bucket] = (greedy.time_s - exact.time_s) / max(exact.time_s, 1e-12)
      log.info("%s bucket %d: greedy is %.2f%% slower than the exact solution", self.method, bucket,
               100 * self._gaps[bucket])
    self._active[bucket] = methods.active_constraint(self.method, self._units[self._shape], st.profile["ops"],
                                                     allowance, plan, **self._plan_kw(bucket))
    return plan

  def policies(self, plan: methods.Plan) -> tuple[model.LayerPolicy, ...]:
    return methods.policies(plan, self._units[self._shape], self.num_layers, self.mc.group_size, self.method)

  def _fit(self, bucket: int, batch: dict):
    """Fit the bucket's plan to the budget on the compiled step (probe compiles, logged); remembered in the state,
    so a resumed run repeats it."""
    st = self.state
    fit = budgets.fit_allowance(
        st.budget_bytes, st.gc_bytes, plan_for=lambda a: self._plan(bucket, a),
        peak_of=lambda plan: self.hooks.compile_peak(self.policies(plan), batch), max_probes=self.mc.budget_probes,
        time_of=lambda plan: plan.time_s, bytes_of=lambda plan: plan.bytes)
    log.info("%s bucket %d: %d probe compiles, allowance %d B", self.method, bucket, len(fit.probes), fit.allowance)
    if fit.plan is None:  # nothing fitted: full checkpointing, which the budget always admits
      log.warning("%s: bucket %d: no plan fitted the budget; using full checkpointing", self.method, bucket)
      st.fallback_gc = sorted(set(st.fallback_gc) | {bucket})
    st.allowance[str(bucket)] = fit.allowance
    st.verified = sorted(set(st.verified) | {bucket})
    self._cache.invalidate(f"bucket {bucket} fitted")

  def allocate(self, minibatches: list[dict]) -> list[Allocation]:
    """Every minibatch's bucket, plan and policies, in order; a new bucket is fitted first (its probe compiles
    are not counted as scheduling time). Exposure levels come from one jitted call."""
    t0 = time.perf_counter()
    self._unit_list(minibatches[0])
    hilore = self.method == "hilore" and self.state.edges
    levels = self.levels(minibatches) if hilore else np.zeros(len(minibatches))
    bucketer = Bucketer(tuple(self.state.edges))
    fit_s, chosen = 0.0, []
    for level in levels:
      bucket = 0
      if hilore:
        self.state.max_level = max(self.state.max_level, float(level))
        bucket = bucketer.bucket(float(level))
      if bucket not in self.state.verified and self.method != "none":
        t1 = time.perf_counter()
        self._fit(bucket, minibatches[0])
        fit_s += time.perf_counter() - t1
      chosen.append((bucket, self._cache.get(bucket)))
    schedule_s = (time.perf_counter() - t0 - fit_s) / len(minibatches)
    out = []
    for bucket, plan in chosen:
      fr = plan.fractions()
      metrics = {"alloc/frac_H": fr["frac_H"], "alloc/frac_L": fr["frac_L"], "alloc/frac_R": fr["frac_R"],
                 "alloc/frac_O": fr["frac_O"], "alloc/bucket": bucket, "alloc/greedy_gap": self._gaps.get(bucket, 0.0),
                 "alloc/predicted_err": float(plan.risk), "memory/budget_bytes": self.state.budget_bytes,
                 "memory/predicted_bytes": self.state.gc_bytes + plan.bytes, "time/schedule_s": schedule_s}
      out.append(Allocation(bucket, plan, self.policies(plan), metrics, self._active.get(bucket, "none")))
    return out

  def step(self, params, minibatches: list[dict], step: int) -> list[Allocation]:
    """Set up (or refresh) when due, then allocate this step's minibatches."""
    mc = self.mc
    if self.state is None or (mc.refresh_every and step - self.state.calibrated_at >= mc.refresh_every):
      self.setup(params, minibatches, step)
    return self.allocate(minibatches)

  def state_json(self) -> Any:
    return None if self.state is None else self.state.to_json()
