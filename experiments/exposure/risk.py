"""The exposure benchmark's risk prediction: every predictor's scores of the held-out minibatches, each with its own
susceptibility fitted on the calibration measurements at the normalisation it is applied with, its ablations and
simple baselines; how much of ||g||'s spread a clamped KL removes; the held-out arrays' file
(experiments/exposure/run.py runs them).

Scores come as (raw, susceptibility): a within-unit ranking reads the raw score (one positive factor per unit cannot
change it, and a unit whose factor could not be fitted, 0, would lose its ranking), pooled figures the product."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

from hilore_jax.memory import MemoryManager, calibration, predictors, probe, risk, riskfit
from hilore_jax.memory.config import PREDICTORS

ABLATIONS = ("ratio_clip", "update_mask", "kl", "activation", "prompt")


def _scores(on: MemoryManager, sw, held, token_err) -> tuple[np.ndarray, np.ndarray]:
  """([M, U] predictor sw's raw scores of the held-out records, [U] its susceptibility), susceptibility and gradient
  scale fitted on the manager's calibration measurements."""
  m, U = probe.measurements(on), len(on.lowp_ids)
  logp_cal = [c.logp for c in m.contexts]
  gamma = predictors.fit_grad_scale([r.grad_norm for r in m.refs], probe.l1(on, m.batches, sw, logp_cal))
  inputs = predictors.ScoreInputs(m.prompt_profile, m.profile, np.ones(U), gamma)
  raw_cal = probe.scores(on, m.batches, inputs, sw, logp_cal, m.token_err)
  sus = riskfit.fit_susceptibility(raw_cal, m.err) if sw.susceptibility else np.ones(U)
  raw = probe.scores(on, [r.batch for r in held], inputs, sw, [r.logp for r in held], token_err)
  return raw, sus


def predictor_scores(on: MemoryManager, held, token_err) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """[M, U] held-out scores of every selectable predictor (token_err: each record's per-token errors from the
  forward the step already ran, for cotangent_forward)."""
  return {name: _scores(on, predictors.with_predictor(on.mc.exposure, name), held, token_err) for name in PREDICTORS}


def other_scores(on: MemoryManager, held, token_err, chosen: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """The chosen predictor with each term switched off, and baselines the same for every unit of a minibatch."""
  sw = predictors.with_predictor(on.mc.exposure, chosen)
  out = {f"{chosen} without {a}": _scores(on, dataclasses.replace(sw, **{a: False}), held, token_err)
         for a in ABLATIONS}
  U, batches = len(on.lowp_ids), [r.batch for r in held]
  each = lambda v: (np.repeat(np.asarray(v, float)[:, None], U, 1), np.ones(U))
  out["baseline: advantage only (sum |A|)"] = each([np.abs(b.adv).sum() for b in batches])
  out["baseline: completion tokens"] = each([b.mask.sum() for b in batches])
  return out


def kl_clamp_spread(hooks_for, records, norms, clamps) -> dict:
  """For each clamp, how much of ||g||'s spread over the records it removes (risk.spread_removed): norms are the
  unclamped exact gradients' norms; hooks_for(clamp) -> StepHooks of the loss with grpo.kl_clamp set."""
  out = {}
  for c in clamps:
    hooks = hooks_for(c)
    bounded = [float(calibration.norm(calibration.exact_gradient(hooks, r.params, r.batch))) for r in records]
    out[str(c)] = risk.spread_removed(norms, bounded)
  return out


def update_effects(hooks, held, refs, units, mc) -> dict:
  """Which error definition best predicts what an L error does to the policy: per held-out minibatch, every unit L
  (the largest error there is), the parameters after one optimizer step with the exact and with that gradient, and
  the mean |d log pi| between them on the next held-out minibatch's completion tokens; the Spearman rho of each
  metric's error against it across minibatches (needs the optimizer states: bench_exposure.update_error)."""
  from scipy.stats import spearmanr

  if len(held) < 3 or not refs[0].has_update:
    return {}
  every = calibration.probe_mix(hooks.model_cfg.num_hidden_layers, units, range(len(units)))
  lp = jax.jit(hooks.logprobs)
  errs, effect = {m: [] for m in refs[0].available()}, []
  for i, (r, ref) in enumerate(zip(held[:-1], refs[:-1])):
    with calibration.measuring():
      g = hooks.probe_gradient(r.params, r.batch, every, mc.lowp_format, mc.group_size)
    for m, e in ref.errors(g).items():
      errs[m].append(e)
    step = lambda grad: optax.apply_updates(ref.params, ref.update(grad, ref.opt_state, ref.params)[0])
    nxt = held[i + 1].batch
    mask = np.asarray(nxt.mask, bool)
    d = np.abs(np.asarray(lp(step(ref.grad), nxt)) - np.asarray(lp(step(g), nxt)))
    effect.append(float(d[mask].mean()) if mask.any() else 0.0)
  rho = {m: float(spearmanr(e, effect).statistic) if np.ptp(e) > 0 and np.ptp(effect) > 0 else float("nan")
         for m, e in errs.items()}
  ranked = [m for m in rho if np.isfinite(rho[m])]
  return {"spearman_vs_effect": rho, "best": max(ranked, key=rho.get) if ranked else None,
          "effect": "mean |d log pi| on the next held-out minibatch's completion tokens after one optimizer step, "
                    "every unit L against none", "minibatches": len(effect)}


def save_arrays(path: str, units, mu, err_by: dict, table: dict, grad_norms) -> None:
  """exposure_arrays.npz: held-out errors [M, U] per metric, scores, each minibatch's ||g|| (grad_norm_M) and each
  unit's absolute error ||dg_u|| (abs_err_MU = relative error * ||g||: a re-analysis can clip at any c)."""
  grad_norm_M = np.asarray(grad_norms, np.float64)
  np.savez_compressed(path, units=np.array([f"{l}:{k}" for l, k in units]), measured=np.array(mu),
                      grad_norm_M=grad_norm_M, abs_err_MU=np.asarray(err_by["relative"]) * grad_norm_M[:, None],
                      **{f"err_{m}": e for m, e in err_by.items()}, **{"score_" + "".join(
                          c if c.isalnum() else "_" for c in k): r * s for k, (r, s) in table.items()})
