"""Calibration as the memory manager runs it, in two phases: measure (each unit's and random sets' errors of
memory.risk_metric, the per-position reconstruction profiles) on K minibatches, each at the params and optimizer
state its update saw; then fit a predictor to it (susceptibility, coherence, and the risk budget delta measured
against the tolerance). calibration.py holds the measurements and fits both use."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax
import numpy as np

from hilore_jax.memory import drift, gate, methods, risk
from hilore_jax.memory.calibration import (UpdateContext, additive, calibration_rows, error_profile, exact_gradient,
                                           lowp_units, measure_unit_errors, norm, probed_layers, reference,
                                           set_error_of, set_errors)
from hilore_jax.memory.riskfit import fit_coherence, fit_susceptibility, random_sets, risk_metrics, set_fit
from hilore_jax.memory.config import MemoryConfig
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.memory.state import Calibration
from hilore_jax.model.units import LOWP_UNITS

log = logging.getLogger(__name__)
# with one calibration minibatch the exposure-off bucket's risk (Calibration.static_risk, each unit's p90 over
# calibration minibatches; score_max, its largest score) is that one sample, with no spread measured: both are widened
# by this factor. Taking
# the sample as a unit's median, 2x reaches its p90 for a lognormal within-unit spread of p90 / p10 = 4x
# (p90 / p50 = sqrt(p90 / p10)), wider than the 2.5x issue 36 calls paper-like
SINGLE_BATCH_MARGIN = 2.0


def calibrate_delta(hooks: StepHooks, params: Sequence, batches: Sequence, units, risk_U: np.ndarray,
                    tolerance: float, group_size: int, fmt: str = "int8", max_halvings: int = 8,
                    exact=None, row_scale=None, unit_err=None) -> tuple[float, float]:
  """Largest risk budget delta (from the tolerance, halving) whose lowest-risk L set (risk_U: each unit's predicted
  error, coherence included) measures under the tolerance on every calibration batch, each at its own params (one
  per batch) against its reference (exact, one per batch), its error times the batch's row_scale (rows_factor: what
  it is on the full minibatch). unit_err [K, U]: each unit's measured error alone (row-scaled), from which a set of
  WEIGHT_READS units' error follows without a probe (calibration.set_error_of). Returns (delta, its measured
  error)."""
  risk_U = np.asarray(risk_U, float)
  exact = exact or [None] * len(batches)
  row_scale = [1.0] * len(batches) if row_scale is None else list(row_scale)
  delta = tolerance
  for _ in range(max_halvings + 1):
    chosen, total = [], 0.0
    for i in np.argsort(risk_U, kind="stable"):
      if total + risk_U[i] > delta:
        break
      chosen.append(int(i))
      total += risk_U[i]
    if not chosen:
      return delta, 0.0
    if unit_err is not None and additive([units[i] for i in chosen], (getattr(exact[0], "metric", "relative"),)):
      err = float(max(set_error_of(e, [chosen])[0] for e in np.asarray(unit_err)))
    else:
      err = max(f * float(set_errors(hooks, p, b, units, [chosen], group_size, fmt, ex)[0])
                for p, b, ex, f in zip(params, batches, exact, row_scale))
    if err <= tolerance:
      return delta, err
    delta /= 2
  return 0.0, 0.0


@dataclasses.dataclass
class Measured:
  """What calibration measured on its minibatches, before any predictor is fitted to it (so a benchmark can fit
  several on one measurement)."""

  batches: list
  contexts: list[UpdateContext]
  refs: list[risk.Reference]
  err: np.ndarray  # [K, U] each unit's error alone
  sets: list[list[int]]
  set_err: np.ndarray  # [K, S]
  prompt_profile: np.ndarray  # [U, P-1]
  profile: np.ndarray  # [U, N]
  token_err: list  # per batch [U, B, P-1+N]
  row_scale: np.ndarray | None = None  # [K] rows_factor: err and set_err are already scaled by it (None: ones)
  units: list | None = None  # the (layer, kind) units measured, in err's order (None: the manager's lowp_ids)


def rows_factor(hooks: StepHooks, ctx: UpdateContext, full, sub, ref: risk.Reference) -> float:
  """What a unit error measured on `sub` (b of the minibatch's B rows, reference ref) is multiplied by to be the
  error on the whole minibatch `full`.

  The loss averages over the minibatch's rows (or their tokens), so g_B = (1/B) sum_r g_r. A unit's L error is a sum
  of rounding errors of different rows, independent of each other, so it adds in quadrature:
  ||dg_B|| = sqrt(b / B) ||dg_b||. The gradient itself may add coherently (||g_B|| = ||g_b||) or cancel as
  zero-mean advantages do (||g_B|| = sqrt(b / B) ||g_b||), so it is measured: one exact gradient of the full
  minibatch. The error is ||dg|| over the metric's denominator D (||g||, or max(||g||, c) clipped), so the factor is
  sqrt(b / B) D(g_b) / D(g_B): 1 for fully incoherent rows, sqrt(b / B) for coherent ones. The update error takes
  the relative error's factor (Adam's update is not linear in g; the factor is its first-order value)."""
  B, b = (jax.tree_util.tree_leaves(x)[0].shape[0] for x in (full, sub))
  if b >= B or ref.grad_norm == 0:
    return 1.0
  g_B = float(norm(exact_gradient(hooks, ctx.params, full, probe=False)))  # only its norm: the cheapest program
  denom = (lambda g: max(g, ref.max_grad_norm)) if ref.metric == "clipped" else (lambda g: g)
  return float(np.sqrt(b / B) * denom(ref.grad_norm) / max(denom(g_B), 1e-30))


def _norm_only(ref: risk.Reference) -> risk.Reference:
  """An instrumented reference without its gradient (its unit errors and norm are all a calibration reads)."""
  return dataclasses.replace(ref, grad=None) if ref.weight_errors is not None and ref.metric != "update" else ref


def measure(hooks: StepHooks, mc: MemoryConfig, units, batches: Sequence, contexts: Sequence[UpdateContext],
            log=None) -> Measured:
  """Per-unit and random-set errors of memory.risk_metric and the per-position reconstruction profiles, each
  minibatch at its own context; minibatches without a gradient are skipped (no error to measure)."""
  # probes on a row subsample and, per unit kind, a few layers: their number and size do not grow with depth
  full, batches = list(batches), [calibration_rows(b, mc.calib_rows) for b in batches]
  contexts = [c if c.logp is None else dataclasses.replace(c, logp=calibration_rows(c.logp, mc.calib_rows))
              for c in contexts]
  layers = probed_layers(hooks.model_cfg.num_hidden_layers, mc.calib_layers)
  # units all weight-read ones (memory.lowp_kinds): each reference's backward measures them too (no probe at all)
  instrumented = mc.calib_decompose and additive(units, (mc.risk_metric,))
  # instrumented: every error is read off the backward's own unit errors and nothing after reads the gradient, so
  # each reference keeps its norm alone as soon as it is made (0.5 GB each for SmolLM2, K of them at once otherwise)
  refs = [_norm_only(reference(hooks, c, b, mc.risk_metric, mc.lowp_format, mc.group_size, instrumented))
          for c, b in zip(contexts, batches)]
  live = [i for i, r in enumerate(refs) if r.grad_norm > 0]
  if live and len(live) < len(batches):
    if log is not None:
      log.warning("memory: %d of %d calibration minibatches have a zero gradient; calibrating on the others",
                  len(batches) - len(live), len(batches))
    batches, contexts, refs, full = ([x[i] for i in live] for x in (batches, contexts, refs, full))
  if not live and log is not None:
    log.warning("memory: no calibration minibatch has a gradient (every advantage zero, no KL yet): the measured "
                "risks are undefined and this calibration is not meaningful")
  # errors measured on calib_rows rows, scaled to the minibatch's own row count (rows_factor)
  scale = np.array([rows_factor(hooks, c, f, b, r) for c, f, b, r in zip(contexts, full, batches, refs)])
  err = np.stack([measure_unit_errors(hooks, c.params, b, units, mc.group_size, mc.lowp_format, r, layers,
                                      decompose=mc.calib_decompose)
                  for c, b, r in zip(contexts, batches, refs)]) * scale[:, None]
  pprof, prof, token_err = error_profile(hooks, [c.params for c in contexts], batches, units, mc.group_size,
                                         mc.lowp_format)
  # units' errors are not orthogonal: how coherently they add is fitted on random sets of these batches
  sets = random_sets(len(units), mc.calib_sets, np.random.default_rng(len(units)))
  set_err = np.stack([set_errors(hooks, c.params, b, units, sets, mc.group_size, mc.lowp_format, r)
                      for c, b, r in zip(contexts, batches, refs)]) * scale[:, None]
  return Measured(batches, contexts, refs, err, sets, set_err, pprof, prof, token_err, scale, list(units))


def fit(hooks: StepHooks, mc: MemoryConfig, units, m: Measured, raw_KU: np.ndarray, grad_scale: float) -> Calibration:
  """The calibration of mc's predictor (raw_KU: its scores of the calibration minibatches without susceptibility,
  at the same normalisation it is applied with): susceptibility, coherence, and delta measured on m's minibatches."""
  n = len(units)
  sus = fit_susceptibility(raw_KU, m.err) if mc.exposure.susceptibility else np.ones(n)
  pred = raw_KU * sus
  kappa = fit_coherence(m.err, m.sets, m.set_err)
  # hilore: each unit's calibrated error at calib_quantile; the gate decides whether exposure buckets run on top
  static = gate.unit_quantile(m.err, mc.calib_quantile)
  grad_norms = [r.grad_norm for r in m.refs]  # of minibatches with a gradient (measure drops the others)
  record = gate.evaluate(m.err, raw_KU, grad_norms, hooks.max_grad_norm, mc.gate,
                         mc.buckets if methods.REGISTRY[mc.policy].exposure else 1)
  # delta is calibrated on the risks the run's allocations read: the static ones where exposure is off
  risk_U = static if methods.REGISTRY[mc.policy].exposure and not record["on"] else pred.mean(0)
  delta, measured = calibrate_delta(hooks, [c.params for c in m.contexts], m.batches, units, kappa * risk_U,
                                    mc.grad_err_tolerance, mc.group_size, mc.lowp_format, exact=m.refs,
                                    row_scale=m.row_scale, unit_err=m.err if mc.calib_decompose else None)
  total = pred.sum(1)
  score_max = pred.max(0)
  if len(m.batches) == 1:
    log.warning("memory: one calibration minibatch, so each unit's calibrated error (the exposure-off bucket's risk) "
                "is a single sample with no spread measured: widened %.1fx; calibrate on more minibatches "
                "(memory.calib_batches)", SINGLE_BATCH_MARGIN)
    score_max = score_max * SINGLE_BATCH_MARGIN
    static = static * SINGLE_BATCH_MARGIN
  return Calibration(sus.tolist(), pred.mean(0).tolist(), m.err.mean(0).tolist(), delta, measured,
                     float(np.mean(total)), float(np.max(total)), risk_metrics(pred.ravel(), m.err.ravel()),
                     len(m.batches), kappa, set_fit(m.err.mean(0), m.sets, m.set_err.mean(0), kappa), m.err.tolist(),
                     m.profile.tolist(), score_max.tolist(), m.prompt_profile.tolist(), float(grad_scale),
                     mc.risk_metric, mc.exposure.predictor, static.tolist(), mc.calib_quantile, record, grad_norms,
                     drift.recon_rms(m.token_err, m.batches).tolist())


def unusable(cal: Calibration | None, mc: MemoryConfig, exposure: bool, num_layers: int) -> str | None:
  """Why a restored calibration (a checkpoint's, the set-up cache's) cannot serve this run's settings; None if it
  can."""
  if cal is None:
    return None
  if exposure and mc.buckets > 1 and not cal.profile:
    return "the checkpoint's hilore calibration predates per-unit exposure"
  if (cal.risk_metric, cal.predictor) != (mc.risk_metric, mc.exposure.predictor):
    return (f"the checkpoint's calibration is of {cal.risk_metric} / {cal.predictor}, this run's of {mc.risk_metric} "
            f"/ {mc.exposure.predictor}")
  kinds = cal.kinds or mc.lowp_kinds
  if set(kinds) - set(mc.lowp_kinds or LOWP_UNITS) or len(cal.predicted_error) != len(lowp_units(num_layers, kinds)):
    # another memory.lowp_kinds: its per-unit risks would land on other units
    return (f"the checkpoint's calibration covers {len(cal.predicted_error)} units, this run's L units are "
            f"{len(lowp_units(num_layers, mc.lowp_kinds))} (memory.lowp_kinds)")
  return None
