"""The synthetic benchmark's per-unit risk table: how well each score predicts the measured per-unit error on
held-out batches, pooled over batches and units (so mostly fixed per-unit differences; experiments/exposure/run.py
reports the within-unit figures on real rollouts)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax.memory import calibration, predictors, riskfit
from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.memory.hooks import StepHooks

ABLATIONS = ("ratio_clip", "update_mask", "kl", "activation", "susceptibility", "prompt")


def risk_report(hooks: StepHooks, params, cal_batches: Sequence, eval_batches: Sequence, units,
                group_size: int, fmt: str = "int8", err_cal=None, err_ev=None,
                sw: ExposureSwitches = ExposureSwitches()) -> dict[str, dict[str, float]]:
  """The run-time score of predictor sw, each of its components switched off, the same with the forward's own
  per-token errors, and simple baselines; susceptibility fitted on cal_batches to each score as it is applied
  (err_cal / err_ev: their per-unit errors if already measured)."""
  measure = lambda bs: np.stack([calibration.measure_unit_errors(hooks, params, b, units, group_size, fmt)
                                 for b in bs])
  err_cal = measure(cal_batches) if err_cal is None else np.asarray(err_cal)
  err_ev = measure(eval_batches) if err_ev is None else np.asarray(err_ev)
  pprof, prof, _ = calibration.error_profile(hooks, [params] * len(cal_batches), cal_batches, units, group_size,
                                             fmt)
  scorer, ones = predictors.Scorer(hooks), np.ones(len(units))
  inputs = predictors.ScoreInputs(pprof, prof, ones)
  run = lambda bs, s: scorer(list(bs), inputs, dataclasses.replace(s, susceptibility=True),
                             predictors.Normalisation())
  fwd_fn = jax.jit(lambda b, s: calibration.raw_exposure(hooks, params, b, units, s, group_size, fmt),
                   static_argnums=1)
  fwd = lambda bs, s: np.stack([np.asarray(fwd_fn(b, s)) for b in bs])
  variants = {"run-time score": (run, sw)}
  variants.update({f"without {a}": (run, dataclasses.replace(sw, **{a: False})) for a in ABLATIONS})
  variants["with the forward's per-token errors"] = (fwd, sw)
  rows = {}
  for name, (fn, s) in variants.items():
    raw_cal, raw_ev = fn(cal_batches, s), fn(eval_batches, s)
    sus = riskfit.fit_susceptibility(raw_cal, err_cal) if s.susceptibility else ones
    rows[name] = riskfit.risk_metrics((raw_ev * sus).ravel(), err_ev.ravel())
  # baselines: the unit's reconstruction error alone; its calibrated mean error (type/layer, batch-independent);
  # the batch's total |advantage| (the same for every unit of a batch)
  recon = jax.jit(lambda b: jnp.sqrt(jnp.sum(calibration.token_errors(hooks, params, b, units, group_size, fmt) ** 2,
                                             axis=(1, 2))))
  rows["baseline: reconstruction error only"] = riskfit.risk_metrics(
      np.stack([np.asarray(recon(b)) for b in eval_batches]).ravel(), err_ev.ravel())
  rows["baseline: static type/layer"] = riskfit.risk_metrics(np.tile(err_cal.mean(0), len(eval_batches)),
                                                                 err_ev.ravel())
  rows["baseline: advantage only"] = riskfit.risk_metrics(
      np.repeat([np.abs(np.asarray(b.adv)).sum() for b in eval_batches], len(units)), err_ev.ravel())
  return rows


def risk_table(rows: dict[str, dict[str, float]]) -> str:
  """The risk report as a markdown table."""
  lines = ["| score | Spearman rho | top-10% recall | AUROC |", "|---|---:|---:|---:|"]
  for name, m in rows.items():
    lines.append(f"| {name} | {m['spearman']:.3f} | {m['top10_recall']:.3f} | {m['auroc']:.3f} |")
  return "\n".join(lines)
