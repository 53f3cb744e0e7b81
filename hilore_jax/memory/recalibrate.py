"""Recalibration on drift, incremental: only the units the running plans hold in L are measured again, on one
minibatch at the params the run has now, and only their risks change. The other units keep their calibration (no
plan holds them in L, so no error of theirs reaches an update), and a plan with no L never gets here.

The measurement is calibration's own (memory/calibrate.py): one reference gradient on memory.calib_rows rows, the
errors scaled to the whole minibatch (calibrate.rows_factor); the weight-read kinds from the reference's
instrumented backward (where every calibrated kind is one) or one probe between them, the others by one probe per
unit at up to memory.calib_layers of their L layers, the rest interpolated over depth. Each unit's calibrated error
becomes the new one-minibatch measurement, widened as calibration widens a single sample
(calibrate.SINGLE_BATCH_MARGIN), its run-time scores scaled alike, and the risk budget delta is calibrated again on
the same minibatch against the same reference."""

from __future__ import annotations

import dataclasses

import numpy as np

from hilore_jax.memory import calibrate
from hilore_jax.memory.allocator import L
from hilore_jax.memory.calibration import (UpdateContext, additive, calibration_rows, interpolate_layers,
                                           measure_unit_errors, probed_layers, reference)
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.memory.state import Calibration
from hilore_jax.model.decoder import WEIGHT_READS


def held_in_l(unit_list, plans, lowp_ids) -> tuple[int, ...]:
  """Indices into lowp_ids of the units any of the plans (over unit_list) holds in L."""
  index = {tuple(u): i for i, u in enumerate(lowp_ids)}
  return tuple(sorted({index[(u.layer, u.kind)] for plan in plans for u, c in zip(unit_list, plan.choice)
                       if c == L and (u.layer, u.kind) in index}))


def groups(chosen, decompose: bool) -> list[list[int]]:
  """Indices into chosen measured together: every weight-read unit in one (decompose), then one group per kind."""
  weight = [j for j, (_, k) in enumerate(chosen) if decompose and k in WEIGHT_READS]
  kinds = dict.fromkeys(k for j, (_, k) in enumerate(chosen) if j not in weight)
  return ([weight] if weight else []) + [[j for j, (_, k) in enumerate(chosen) if k == kind and j not in weight]
                                         for kind in kinds]


def unit_errors(hooks: StepHooks, mc: MemoryConfig, chosen, params, sub, ref) -> np.ndarray:
  """[len(chosen)] each (layer, kind) unit's error alone as L on the row subsample sub against ref (not yet scaled
  to the minibatch): a kind's units at up to memory.calib_layers of its layers, the others interpolated."""
  err = np.zeros(len(chosen))
  for idx in groups(chosen, mc.calib_decompose):
    units = [tuple(chosen[j]) for j in idx]
    layers = sorted({layer for layer, _ in units})
    picked = probed_layers(len(layers), mc.calib_layers)
    decomposed = mc.calib_decompose and units[0][1] in WEIGHT_READS  # every layer from one backward
    at = [u for u in units if decomposed or picked is None or u[0] in {layers[i] for i in picked}]
    measured = measure_unit_errors(hooks, params, sub, at, mc.group_size, mc.lowp_format, ref,
                                   decompose=mc.calib_decompose)
    err[idx] = interpolate_layers(units, dict(zip(at, measured)))
  return err


def _scaled(values, idx, ratio) -> list:
  out = np.asarray(values, float).copy()
  out[idx] = out[idx] * ratio
  return out.tolist()


def remeasure(hooks: StepHooks, mc: MemoryConfig, units, lset, cal: Calibration, ctx: UpdateContext,
              batch) -> Calibration:
  """cal with the lset units (indices into units) measured again on batch at ctx and delta calibrated again there
  (on the risks the run's allocations read: the static ones, or the scores where exposure buckets run); cal itself
  where the minibatch has no gradient (nothing to measure)."""
  lset = list(lset)
  sub = calibration_rows(batch, mc.calib_rows)
  sub_ctx = ctx if ctx.logp is None else dataclasses.replace(ctx, logp=calibration_rows(ctx.logp, mc.calib_rows))
  # one reference serves the units' errors and delta's sets, which may hold any calibrated unit
  ref = reference(hooks, sub_ctx, sub, mc.risk_metric, mc.lowp_format, mc.group_size,
                  mc.calib_decompose and additive(units, (mc.risk_metric,)))
  if ref.grad_norm == 0:
    return cal
  scale = calibrate.rows_factor(hooks, ctx, batch, sub, ref)
  err = unit_errors(hooks, mc, [units[i] for i in lset], ctx.params, sub, ref) * scale
  static = np.asarray(cal.static_risk or cal.score_max or cal.predicted_error, float).copy()
  new = err * calibrate.SINGLE_BATCH_MARGIN
  ratio = np.where(static[lset] > 0, new / np.where(static[lset] > 0, static[lset], 1.0), 1.0)
  static[lset] = new
  predicted = np.asarray(_scaled(cal.predicted_error, lset, ratio))
  static_error = np.asarray(cal.static_error, float).copy()
  static_error[lset] = err
  risk_U = predicted if cal.gate.get("on") else static
  delta, measured = calibrate.calibrate_delta(hooks, [ctx.params], [sub], units, cal.coherence * risk_U,
                                              mc.grad_err_tolerance, mc.group_size, mc.lowp_format, exact=[ref],
                                              row_scale=[scale])
  return dataclasses.replace(cal, static_risk=static.tolist(), predicted_error=predicted.tolist(),
                             score_max=_scaled(cal.score_max, lset, ratio) if cal.score_max else cal.score_max,
                             static_error=static_error.tolist(), delta=float(delta), calibration_error=float(measured))
