"""The HiLoRe memory manager: profile units, calibrate risk, bucket exposure, allocate H/L/R, verify the budget."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from hilore_jax import allocator, buckets, calibration, model, train_step, units
from hilore_jax.config import MemoryConfig

log = logging.getLogger(__name__)


def policies_from_choice(cfg, unit_list: list[units.Unit], choice, group_size: int) -> tuple[model.LayerPolicy, ...]:
  """Per-layer LayerPolicy from a per-unit H/L/R choice."""
  save = [[] for _ in range(cfg.num_hidden_layers)]
  lowp = [[] for _ in range(cfg.num_hidden_layers)]
  for u, c in zip(unit_list, choice):
    if c == allocator.H:
      save[u.layer].append(u.kind)
    elif c == allocator.L:
      lowp[u.layer].append(u.kind)
  return tuple(model.LayerPolicy(remat=True, save=tuple(s), lowp=tuple(l), group_size=group_size)
               for s, l in zip(save, lowp))


class MemoryManager:
  """Chooses the step's per-layer policies; its state is JSON so a resumed run allocates identically."""

  def __init__(self, mc: MemoryConfig, spec: train_step.StepSpec, stepper: train_step.Stepper):
    self.mc, self.spec, self.stepper = mc, spec, stepper
    self.state: dict | None = None
    self._cache = buckets.AllocationCache(self._solve)
    self._gaps: dict[int, float] = {}
    self.lowp_ids = calibration.lowp_units(spec.model_cfg)
    self._exposure = jax.jit(lambda p, b: calibration.raw_exposure(spec, p, b, self.lowp_ids))

  # ------------------------------------------------------------------ set-up

  def setup(self, state, batch: dict, step: int):
    """Budget from the GC step, unit profile, risk calibration and bucket edges on this batch."""
    cfg, mc = self.spec.model_cfg, self.mc
    gc_spec = dataclasses.replace(self.spec, policies=model.uniform_policies(cfg, model.FULL_REMAT))
    _, gc_bytes = self.stepper.get(gc_spec, state, batch, reason="hilore: GC reference", count=False)
    budget = mc.budget_bytes if mc.budget_bytes is not None else int(mc.budget_ratio * gc_bytes)
    if budget < gc_bytes:
      raise allocator.InfeasibleBudget(f"memory budget {budget} bytes is below full checkpointing's "
                                       f"{gc_bytes} bytes, the minimum")
    rows, seq = batch["tokens"].shape[0] // self.spec.microbatches, sum(
        batch[k].shape[1] for k in ("prompt_ids", "tokens"))
    profile = units.profile_kinds(cfg, rows, seq, mc.group_size)
    params = state["params"]
    errors = calibration.measure_unit_errors(self.spec, params, batch, self.lowp_ids, mc.group_size)
    raw = np.asarray(self._exposure(params, batch))
    kinds = [k for _, k in self.lowp_ids]
    sus = calibration.fit_susceptibility(raw, errors, kinds)
    risk = calibration.risk_scores(raw, kinds, sus)
    delta, measured = calibration.calibrate_delta(self.spec, params, batch, self.lowp_ids, risk,
                                                  mc.grad_err_tolerance, mc.group_size)
    level = float(raw.sum())
    # geometric edges around the calibration level: bucket b tolerates up to edges[b]
    edges = [level * 2.0 ** (k - mc.buckets // 2) for k in range(1, mc.buckets)] if level > 0 else []
    self.state = {"gc_bytes": gc_bytes, "budget_bytes": budget, "profile": profile, "susceptibility": sus,
                  "delta": delta, "calibration_error": measured, "calibration_level": level,
                  "unit_share": (raw / level).tolist() if level > 0 else [0.0] * len(raw), "edges": edges,
                  "shrink_bytes": {}, "calibrated_at": step, "max_level": level}
    self._cache.invalidate(f"calibrated at step {step}")
    log.info("hilore: GC %d B, budget %d B, delta %.3g (measured %.3g at tolerance %.3g), buckets %s", gc_bytes,
             budget, delta, measured, mc.grad_err_tolerance, edges)

  def load_state(self, state: dict):
    self.state = state
    self._cache.invalidate("restored from checkpoint")

  # ------------------------------------------------------------------ per step

  def unit_list(self, batch: dict) -> list[units.Unit]:
    rows, seq = batch["tokens"].shape[0] // self.spec.microbatches, sum(
        batch[k].shape[1] for k in ("prompt_ids", "tokens"))
    return units.enumerate_units(self.spec.model_cfg, rows, seq, self.mc.group_size, self.state["profile"])

  def _solve(self, bucket: int):
    st = self.state
    unit_list = self._units
    bucketer = buckets.Bucketer(tuple(st["edges"]))
    level = bucketer.upper(bucket, st["max_level"])
    share = dict(zip([f"{l}/{k}" for l, k in self.lowp_ids], st["unit_share"]))
    costs = []
    for u in unit_list:
      key = f"{u.layer}/{u.kind}"
      risk = st["susceptibility"].get(u.kind, 0.0) * share.get(key, 0.0) * level
      costs.append(allocator.UnitCost(key, u.bytes_h, u.bytes_l, u.recompute_s, u.codec_s, risk))
    extra = max(st["budget_bytes"] - st["gc_bytes"] - st["shrink_bytes"].get(str(bucket), 0), 0)
    greedy = allocator.greedy(costs, extra, st["delta"])
    # the exact MILP is solved once per bucket only to report how far the greedy is from optimal
    best = allocator.exact(costs, extra, st["delta"])
    self._gaps[bucket] = (greedy.time_s - best.time_s) / max(best.time_s, 1e-12)
    return greedy

  def step_spec(self, state, batch: dict, step: int) -> tuple[train_step.StepSpec, dict]:
    """The spec (policies) for this batch and the alloc/memory metrics; verifies the compiled bytes."""
    t0 = time.perf_counter()
    if self.state is None or (self.mc.refresh_every and step - self.state["calibrated_at"] >= self.mc.refresh_every):
      self.setup(state, batch, step)
    self._units = self.unit_list(batch)
    level = float(np.asarray(self._exposure(state["params"], batch)).sum())
    self.state["max_level"] = max(self.state["max_level"], level)
    bucket = buckets.Bucketer(tuple(self.state["edges"])).bucket(level)
    schedule_s = time.perf_counter() - t0
    for attempt in range(4):
      alloc = self._cache.get(bucket)
      policies = policies_from_choice(self.spec.model_cfg, self._units, alloc.choice, self.mc.group_size)
      spec = dataclasses.replace(self.spec, policies=policies)
      _, compiled = self.stepper.get(spec, state, batch, reason=f"hilore bucket {bucket}")
      if compiled <= self.state["budget_bytes"] or attempt == 3:
        break
      # the compiled step is over budget: shrink this bucket's byte allowance by the excess and re-solve
      over = compiled - self.state["budget_bytes"]
      key = str(bucket)
      self.state["shrink_bytes"][key] = self.state["shrink_bytes"].get(key, 0) + over
      log.warning("hilore: bucket %d compiled to %d B, %d B over budget; shrinking and re-solving", bucket,
                  compiled, over)
      self._cache.invalidate(f"bucket {bucket} over budget")
    n = max(len(alloc.choice), 1)
    metrics = {"alloc/frac_H": alloc.choice.count(allocator.H) / n, "alloc/frac_L": alloc.choice.count(allocator.L) / n,
               "alloc/frac_R": alloc.choice.count(allocator.R) / n, "alloc/bucket": bucket,
               "memory/budget_bytes": self.state["budget_bytes"],
               "memory/predicted_bytes": self.state["gc_bytes"] + alloc.bytes, "memory/compiled_bytes": compiled,
               "alloc/greedy_gap": self._gaps.get(bucket, 0.0), "time/schedule_s": schedule_s}
    return spec, metrics
