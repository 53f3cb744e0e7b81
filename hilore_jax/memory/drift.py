"""Recalibration on drift: sentinels that are free or cheap, each compared with its value at calibration.

  grad      every step's median ||g|| / c (the step metrics' gradient norm over the clip; ||g|| where nothing clips)
            against calibration's: the clipped error's denominator and how much exposure clipping divides away
  recon     every memory.drift_check_every steps, each unit's int8 reconstruction RMS on one minibatch (a forward
            pass, no gradient): the median over units of its ratio to calibration's
  exact     at the same cadence one exact gradient: the realised error of the running plan's L set on that
            minibatch over the tolerance (one reference gradient and one probe)

A ratio past its threshold either way (memory.drift_*_ratio; exact: upwards) recalibrates; every sentinel's value is
logged as memory/drift/* and a recalibration as memory/recalibrated."""

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


class Sentinels:
  """The check that reads the sentinels; what it compares across steps lives in the manager's state (so a resumed
  run checks as the uninterrupted one: ManagerState.drift_grad_norms, .drift_checked_at)."""

  def __init__(self, mc: MemoryConfig, hooks, units):
    self.mc, self.hooks, self.units = mc, hooks, units
    self._recon = jax.jit(lambda p, b: calibration.token_errors(hooks, p, b, units, mc.group_size, mc.lowp_format))

  def values(self, st, params, batch, step: int, lset=tuple, opt_state=None, logp=None) -> dict:
    """Every sentinel due at this step against st's calibration (grad each step; recon and exact every
    drift_check_every steps since calibration or the last check); lset() gives the running plan's L units."""
    mc, c, cal = self.mc, self.hooks.max_grad_norm, st.calibration
    out = {}
    if st.drift_grad_norms and cal.grad_norms:
      now, then = over_clip(st.drift_grad_norms, c), over_clip(cal.grad_norms, c)
      out.update({"grad_over_clip": now, "grad_ratio": now / then if then > 0 else NAN})
    if not mc.drift_check_every or step - st.drift_checked_at < mc.drift_check_every:
      return out
    st.drift_checked_at = step
    if cal.recon_rms:
      rms, ref = recon_rms([self._recon(params, batch)], [batch]), np.asarray(cal.recon_rms)
      live = ref > 0
      out["recon_ratio"] = float(np.median(rms[live] / ref[live])) if live.any() else NAN
    lset = lset()
    if lset:
      ctx = calibration.UpdateContext(params, opt_state, logp)
      ref_g = calibration.reference(self.hooks, ctx, batch, mc.risk_metric, mc.lowp_format, mc.group_size)
      err = float(calibration.set_errors(self.hooks, params, batch, self.units, [list(lset)], mc.group_size,
                                         mc.lowp_format, ref_g)[0]) if ref_g.grad_norm > 0 else 0.0
      out.update({"exact_err": err, "exact_ratio": err / mc.grad_err_tolerance})
    return out


def metrics(values: dict[str, float], recalibrated: bool) -> dict[str, float]:
  """memory/drift/* and memory/recalibrated of a step (every key always present: one step's rows share keys)."""
  keys = ("grad_over_clip", "grad_ratio", "recon_ratio", "exact_err", "exact_ratio")
  return {**{f"memory/drift/{k}": float(values.get(k, NAN)) for k in keys}, "memory/recalibrated": float(recalibrated)}
