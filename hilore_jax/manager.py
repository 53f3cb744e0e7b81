"""The memory manager: profile units, calibrate risk on K batches, bucket each minibatch's exposure, plan H/L/R(/O)
with the configured method, and verify the compiled step against the budget."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import allocator, buckets, calibration, exposure, methods, model, train_step, units
from hilore_jax.config import MemoryConfig

log = logging.getLogger(__name__)


def concentration(spec: train_step.StepSpec, batch: dict, switches: exposure.ExposureSwitches) -> jax.Array:
  """||w||_2 / ||w||_1 of the batch's token loss coefficients, from the log-probs it already carries (no forward
  pass): the fewer tokens carry the update, the less rounding errors average out relative to the gradient."""
  old = batch.get("old_logp", jnp.zeros(batch["mask"].shape, jnp.float32))
  logp = old  # before the update the policy is the one that produced old_logp (ratio 1 on the first pass)
  ref = batch.get("ref_logp", logp)
  w = exposure.token_weights(logp, old, ref, batch["adv"], batch["mask"], spec.loss_cfg, switches)
  return jnp.sqrt(jnp.sum(w * w)) / jnp.maximum(jnp.sum(w), 1e-30)


CALIBRATION_KEYS = ("susceptibility", "predicted_error", "static_error", "delta", "calibration_error",
                    "calibration_level", "edges", "max_level", "fit", "calib_batches")


class MemoryManager:
  """Chooses the step's per-layer policies; its state is JSON so a resumed run allocates identically."""

  def __init__(self, mc: MemoryConfig, spec: train_step.StepSpec, stepper: train_step.Stepper):
    self.mc, self.spec, self.stepper = mc, spec, stepper
    self.method = mc.policy
    self.state: dict | None = None
    self._cache = buckets.AllocationCache(self._solve)
    self._gaps: dict[int, float] = {}
    self._units: list[units.Unit] = []
    self._units_by_shape: dict[tuple[int, int], list[units.Unit]] = {}
    self._verify_s = 0.0
    self.lowp_ids = calibration.lowp_units(spec.model_cfg)
    sw = mc.exposure
    self._raw = jax.jit(lambda p, b: calibration.raw_exposure(spec, p, b, self.lowp_ids, sw, mc.group_size,
                                                              mc.lowp_format))
    self._level = jax.jit(lambda b: concentration(spec, b, sw))

  # ------------------------------------------------------------------ set-up

  def setup(self, state, batches: list[dict], step: int, calibration_state: dict | None = None):
    """Budget from the GC step, unit profile, and (for calibrated methods) risk calibration on K batches (or the
    given `calibration_state`, another manager's, to compare methods on one calibration)."""
    cfg, mc = self.spec.model_cfg, self.mc
    if mc.offload and not model.offload_supported():
      raise model.OffloadUnsupported(f"memory.offload=true is unsupported on the {jax.default_backend()} backend: it "
                                     "needs a device with its own memory and a pinned_host memory kind (GPU/TPU)")
    batch = batches[0]
    gc_spec = dataclasses.replace(self.spec, policies=model.uniform_policies(cfg, model.FULL_REMAT))
    _, gc_bytes = self.stepper.get(gc_spec, state, batch, reason="memory manager: GC reference", count=False)
    budget = mc.budget_bytes if mc.budget_bytes is not None else int(mc.budget_ratio * gc_bytes)
    if budget < gc_bytes:
      raise allocator.InfeasibleBudget(f"memory budget {budget} bytes is below full checkpointing's "
                                       f"{gc_bytes} bytes, the minimum")
    rows, seq = self._shape(batch)
    st = {"gc_bytes": gc_bytes, "budget_bytes": budget, "profile": units.profile_kinds(cfg, rows, seq, mc.group_size),
          "allowance": {}, "calibrated_at": step, "edges": [], "max_level": 0.0}
    if self.method in methods.CALIBRATED:
      st.update(calibration_state or self._calibrate(state["params"], batches[:mc.calib_batches]))
    self.state = st
    self._units_by_shape.clear()  # their measured times come from this profile
    self._cache.invalidate(f"set up at step {step}")
    log.info("memory (%s): GC %d B, budget %d B, %s", self.method, gc_bytes, budget,
             {k: st[k] for k in ("delta", "calibration_error", "fit", "edges") if k in st})

  def _calibrate(self, params, batches: list[dict]) -> dict:
    mc = self.mc
    err = np.stack([calibration.measure_unit_errors(self.spec, params, b, self.lowp_ids, mc.group_size,
                                                    mc.lowp_format) for b in batches])
    raw = np.stack([np.asarray(self._raw(params, b)) for b in batches])
    sus = calibration.fit_susceptibility(raw, err) if mc.exposure.susceptibility else np.ones(len(self.lowp_ids))
    pred = raw * sus
    delta, measured = calibration.calibrate_delta(self.spec, params, batches, self.lowp_ids, pred.mean(0), err,
                                                  mc.grad_err_tolerance, mc.group_size, mc.lowp_format)
    levels = [float(self._level(b)) for b in batches]
    level = float(np.mean(levels))
    # geometric edges around the calibration level: bucket b tolerates exposure up to edges[b]
    edges = [level * 2.0 ** ((k - mc.buckets // 2) / 2) for k in range(1, mc.buckets)] if level > 0 else []
    return {"susceptibility": sus.tolist(), "predicted_error": pred.mean(0).tolist(),
            "static_error": err.mean(0).tolist(), "delta": delta, "calibration_error": measured,
            "calibration_level": level, "edges": edges, "max_level": max(levels),
            "fit": calibration.risk_metrics(pred.ravel(), err.ravel()), "calib_batches": len(batches)}

  def calibration_state(self) -> dict:
    return {k: self.state[k] for k in CALIBRATION_KEYS if k in self.state}

  def load_state(self, state: dict):
    self.state = state
    self._units_by_shape.clear()
    self._cache.invalidate("restored from checkpoint")

  # ------------------------------------------------------------------ per step

  def _shape(self, batch: dict) -> tuple[int, int]:
    rows = batch["tokens"].shape[0] // self.spec.microbatches
    return rows, batch["prompt_ids"].shape[1] + batch["tokens"].shape[1]

  def _solve(self, bucket: int) -> methods.Plan:
    st, mc = self.state, self.mc
    extra = max(int(st["allowance"].get(str(bucket), st["budget_bytes"] - st["gc_bytes"])), 0)
    keys = [tuple(u) for u in self.lowp_ids]
    risk_of, sens = {}, {}
    if self.method == "hilore":
      scale = buckets.Bucketer(tuple(st["edges"])).upper(bucket, st["max_level"]) / max(st["calibration_level"], 1e-30)
      risk_of = {k: (e * scale) ** 2 for k, e in zip(keys, st["predicted_error"])}
    elif self.method in ("adacc_style", "greedy_bits"):
      risk_of = {k: e ** 2 for k, e in zip(keys, st["static_error"])}
      sens = dict(zip(keys, st["static_error"]))
    kw = dict(risk_of=risk_of, delta=st.get("delta", 0.0), fmt=mc.lowp_format, allow_o=mc.offload,
              sensitivity=sens, group_size=mc.group_size)
    plan = methods.plan(self.method, self._units, st["profile"]["ops"], extra, **kw)
    if self.method == "hilore":  # the exact MILP, once per bucket, only to report how far the greedy is from optimal
      best = methods.plan(self.method, self._units, st["profile"]["ops"], extra, solver="exact", **kw)
      self._gaps[bucket] = (plan.time_s - best.time_s) / max(best.time_s, 1e-12)
    return plan

  def _spec(self, plan: methods.Plan) -> train_step.StepSpec:
    pols = methods.policies(plan, self._units, self.spec.model_cfg.num_hidden_layers, self.mc.group_size, self.method)
    return dataclasses.replace(self.spec, policies=pols)

  def _verify(self, bucket: int, state, batch: dict):
    """Fit the bucket's plan to the budget on the compiled step: the cost model's bytes are additive, XLA's peak
    is not, so the byte allowance shrinks by any excess and grows by any slack (a few probe compiles, logged);
    the fastest plan whose compiled peak is within budget wins. Remembered in the state, so a resume repeats it."""
    st, key = self.state, str(bucket)
    budget = st["budget_bytes"]
    allowance, lo, hi = budget - st["gc_bytes"], None, None  # lo fits, hi does not
    best = None
    for probe in range(self.mc.budget_probes):
      st["allowance"][key] = allowance
      self._cache.invalidate(f"bucket {bucket}: byte allowance {allowance}")
      plan = self._cache.get(bucket)
      _, compiled = self.stepper.get(self._spec(plan), state, batch, count=False)
      fits = compiled <= budget
      log.info("%s bucket %d probe %d: allowance %d B -> predicted %d B, compiled %d B (%s budget %d B)", self.method,
               bucket, probe, allowance, st["gc_bytes"] + plan.bytes, compiled, "within" if fits else "OVER", budget)
      if fits:
        if best is None or plan.time_s < best[1].time_s:
          best = (allowance, plan)
        lo = allowance
        if allowance > 0 and plan.bytes < allowance // 2:
          break  # the plan no longer grows with the allowance (everything useful is kept)
      else:
        hi = allowance
      if hi is None:  # grow by the slack, at least 5% of the budget (XLA's peak is not the cost model's sum)
        allowance = allowance + max(budget - compiled, budget // 20)
      elif lo is None:  # shrink by the excess
        allowance = max(allowance - (compiled - budget), 0)
      else:
        allowance = (lo + hi) // 2
      if hi is not None and lo is not None and hi - lo < budget // 200:
        break
    if best is None:  # nothing fitted: full checkpointing, which the budget always admits
      log.warning("%s: bucket %d: no plan fitted the budget; using full checkpointing", self.method, bucket)
      st["allowance"][key] = 0
      st["fallback_gc"] = sorted(set(st.get("fallback_gc", [])) | {bucket})
    else:
      st["allowance"][key] = best[0]
    st["verified"] = sorted(set(st.get("verified", [])) | {bucket})
    self._cache.invalidate(f"bucket {bucket} verified")

  def bucket(self, batch: dict) -> int:
    if self.method != "hilore" or not self.state["edges"]:
      return 0
    level = float(self._level(batch))
    self.state["max_level"] = max(self.state["max_level"], level)
    return buckets.Bucketer(tuple(self.state["edges"])).bucket(level)

  def schedule(self, state, batch: dict) -> tuple[int, methods.Plan, train_step.StepSpec]:
    """This batch's bucket, plan and spec: the scheduling work of every step (a new bucket is verified first)."""
    shape = self._shape(batch)
    if shape not in self._units_by_shape:
      self._units_by_shape[shape] = units.enumerate_units(self.spec.model_cfg, *shape, self.mc.group_size,
                                                          self.state["profile"], self.mc.lowp_format)
    self._units = self._units_by_shape[shape]
    bucket = self.bucket(batch)
    if bucket not in self.state.get("verified", []) and self.method != "none":
      t0 = time.perf_counter()
      self._verify(bucket, state, batch)
      self._verify_s += time.perf_counter() - t0
    if bucket in self.state.get("fallback_gc", []):
      plan = methods.plan("gc", self._units, self.state["profile"]["ops"], 0)
    else:
      plan = self._cache.get(bucket)
    return bucket, plan, self._spec(plan)

  def step_spec(self, state, batch: dict, step: int, pool: list[dict] | None = None):
    """The spec (policies) for this batch and the alloc/memory metrics; verifies the compiled bytes.

    pool: the step's minibatches, from which calibration takes its K batches.
    """
    if self.state is None or (self.mc.refresh_every and step - self.state["calibrated_at"] >= self.mc.refresh_every):
      self.setup(state, pool or [batch], step)
    t0, verify0 = time.perf_counter(), self._verify_s
    bucket, plan, spec = self.schedule(state, batch)
    schedule_s = time.perf_counter() - t0 - (self._verify_s - verify0)  # probe compiles are not scheduling
    _, compiled = self.stepper.get(spec, state, batch, reason=f"{self.method} bucket {bucket}")
    fr = plan.fractions()
    metrics = {"alloc/frac_H": fr["frac_H"], "alloc/frac_L": fr["frac_L"], "alloc/frac_R": fr["frac_R"],
               "alloc/frac_O": fr["frac_O"], "alloc/bucket": bucket, "memory/budget_bytes": self.state["budget_bytes"],
               "memory/predicted_bytes": self.state["gc_bytes"] + plan.bytes, "memory/compiled_bytes": compiled,
               "alloc/greedy_gap": self._gaps.get(bucket, 0.0), "alloc/predicted_err": float(np.sqrt(plan.risk)),
               "time/schedule_s": schedule_s}
    return spec, metrics
