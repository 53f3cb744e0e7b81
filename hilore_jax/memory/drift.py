"""Recalibration on drift: sentinels that are free or cheap, read after a step and only while the running plans hold
L units (a plan without L has no calibrated risk to go stale), each against a reference that follows the run.

  grad      every step's median ||g|| / c (the step metrics' gradient norm over the clip; ||g|| where nothing clips)
            against its moving average over this run's earlier steps (the clipped error's denominator and how much
            exposure clipping divides away)
  recon     every memory.drift_check_every steps, each L unit's int8 reconstruction RMS on one minibatch (a forward
            pass, no gradient): the median over those units of its ratio to its moving average over this run's
            earlier checks
  exact     at the same cadence one exact gradient: the realised error of the running plans' L set on that
            minibatch over the tolerance (one reference gradient and one probe)

The averages live in the manager's state (`ManagerState.drift_ref`, so a resumed run checks as the uninterrupted
one), and start again with every run: a cached set-up's are another run's. A ratio past its threshold either way
(memory.drift_*_ratio; exact: upwards) recalibrates those L units (memory/recalibrate.py); every sentinel's value is
logged as memory/drift/*, a recalibration as memory/recalibrated and in the count memory/recalibrations."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax.memory import calibration, exposure
from hilore_jax.memory.config import MemoryConfig

NAN = float("nan")


def over_clip(grad_norms: Sequence[float], max_grad_norm: float) -> float:
  """Median ||g|| / c (||g|| without a clip)."""
  g = np.asarray(grad_norms, float)
  return float(np.median(g) / (max_grad_norm or 1.0)) if g.size else NAN


def recon_rms(token_err: Sequence, batches: Sequence) -> np.ndarray:
  """[U] each unit's RMS reconstruction error over the positions that reach a completion log-prob (token_err: per
  batch [U, B, P-1+N], calibration.token_errors)."""
  err = np.concatenate([np.asarray(e, float) for e in token_err], axis=1)
  mask = np.concatenate([np.asarray(exposure.position_mask(jnp.asarray(b.prompt_mask), jnp.asarray(b.mask)))
                         for b in batches], axis=0).astype(bool)
  return np.sqrt((err[:, mask] ** 2).mean(1)) if mask.any() else np.zeros(len(err))


def two_sided(ratio: float) -> float:
  """A ratio's distance from 1 either way (r or 1 / r, whichever is larger; nan stays nan)."""
  return float(max(ratio, 1.0 / ratio)) if ratio > 0 else (float("inf") if ratio == 0 else NAN)


def decide(values: dict[str, float], mc: MemoryConfig) -> list[str]:
  """The sentinels past their threshold (values: grad_ratio, recon_ratio, exact_ratio; nan or absent: not checked)."""
  limits = {"grad_ratio": (mc.drift_grad_ratio, True), "recon_ratio": (mc.drift_recon_ratio, True),
            "exact_ratio": (mc.drift_exact_ratio, False)}
  out = []
  for name, (limit, either_way) in limits.items():
    v = values.get(name, NAN)
    if np.isfinite(v) and (two_sided(v) if either_way else v) >= limit:
      out.append(name)
  return out


# weight of a new value in a reference's moving average (of logs: ratios, not offsets): about the last 3 values
EMA = 0.3


def follow(ref: float | None, value: float) -> float:
  """The moving average of logs with a new value (the first value starts it)."""
  return value if ref is None or not ref > 0 else float(np.exp((1 - EMA) * np.log(ref) + EMA * np.log(value)))


def restart(st, step: int):
  """A state taken over by another run (the set-up cache): its references, its check cadence and its counts start
  again here."""
  st.drift_ref, st.drift_grad_norms, st.drift_checked_at = {}, [], step
  st.calibrations = st.recalibrations = 0


class Sentinels:
  """The check that reads the sentinels; what it compares across steps lives in the manager's state
  (ManagerState.drift_grad_norms, .drift_checked_at, .drift_ref)."""

  def __init__(self, mc: MemoryConfig, hooks):
    self.mc, self.hooks = mc, hooks
    self._recon: dict[tuple, object] = {}  # a forward's reconstruction errors per L set (one program each)

  def values(self, st, params, batch, step: int, units, lset: Sequence[int], opt_state=None, logp=None) -> dict:
    """Every sentinel due after this step against the run's references (grad each step; recon and exact every
    drift_check_every steps since set-up or the last check), the references moved on; lset: indices into units
    of the running plans' L units (none: only the grad reference follows, nothing is compared)."""
    mc, c, ref = self.mc, self.hooks.max_grad_norm, st.drift_ref
    out = {}
    now = over_clip(st.drift_grad_norms, c)
    if np.isfinite(now) and now > 0:
      before = ref.get("grad")
      out["grad_over_clip"] = now
      if lset and before:
        out["grad_ratio"] = now / before
      ref["grad"] = follow(before, now)
    if not lset or not mc.drift_check_every or step - st.drift_checked_at < mc.drift_check_every:
      return out
    st.drift_checked_at = step
    chosen = tuple(tuple(units[i]) for i in lset)
    if chosen not in self._recon:
      self._recon[chosen] = jax.jit(lambda p, b: calibration.token_errors(self.hooks, p, b, chosen, mc.group_size,
                                                                          mc.lowp_format))
    rms = recon_rms([self._recon[chosen](params, batch)], [batch])
    keys = [f"{layer}:{kind}" for layer, kind in chosen]
    before = ref.setdefault("recon", {})
    live = [(r, before[k]) for k, r in zip(keys, rms) if before.get(k, 0) > 0]
    if live:
      out["recon_ratio"] = float(np.median([r / b for r, b in live]))
    before.update({k: follow(before.get(k), float(r)) for k, r in zip(keys, rms) if r > 0})
    ctx = calibration.UpdateContext(params, opt_state, logp)
    ref_g = calibration.reference(self.hooks, ctx, batch, mc.risk_metric, mc.lowp_format, mc.group_size)
    err = float(calibration.set_errors(self.hooks, params, batch, units, [list(lset)], mc.group_size,
                                       mc.lowp_format, ref_g)[0]) if ref_g.grad_norm > 0 else 0.0
    out.update({"exact_err": err, "exact_ratio": err / mc.grad_err_tolerance})
    return out


def metrics(values: dict[str, float], recalibrated: bool) -> dict[str, float]:
  """memory/drift/* and memory/recalibrated of a step (every key always present: one step's rows share keys)."""
  keys = ("grad_over_clip", "grad_ratio", "recon_ratio", "exact_err", "exact_ratio")
  return {**{f"memory/drift/{k}": float(values.get(k, NAN)) for k in keys}, "memory/recalibrated": float(recalibrated)}


def step_metrics(calibrations: int, recalibrations: int, cal, values: dict, recalibrated: bool) -> dict:
  """A step's memory/* metrics beside its plan's: the process's calibrations and recalibrations so far, and with a
  calibration the sentinels' values and the gate's."""
  from hilore_jax.memory import gate

  out = {"memory/calibrations": float(calibrations), "memory/recalibrations": float(recalibrations)}
  if cal is not None:
    out.update({**metrics(values, recalibrated), **gate.gate_metrics(cal.gate)})
  return out
