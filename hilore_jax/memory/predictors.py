"""Run-time risk predictors (memory.exposure.predictor) and how they are compared.

Each predicts every unit's error on a minibatch before its backward, from what the batch carries (advantages, masks,
old / reference / current log-probs) and calibrated profiles, with no extra forward pass:

  exposure_v1        |w_t| x the calibrated per-position reconstruction error (the first run-time score)
  cotangent          |w_t| (1 - p_t) x the same: the softmax cotangent ||e_y - pi_t|| is ~0 on confident tokens, so
                     |w_t| alone overstates what reaches backward there
  cotangent_forward  |w_t| (1 - p_t) x per-token reconstruction errors of a forward pass where a caller has them
                     (the old-log-prob forward runs one for most minibatches); else the calibrated profile. The
                     trainer does not pass them yet: its old-log-prob forward is a compiled program returning
                     log-probs alone, which would have to quantise every unit's tensor of every layer as well, and
                     a rollout's first minibatch has no such forward (it is on-policy). The benchmark computes them
                     at the params that forward runs at (experiments/exposure.py)

All include the prompt's positions (exposure.prompt_weights) unless memory.exposure.prompt is off, and share one
normalisation (exposure.normaliser), so a susceptibility is fitted and applied on the same score. Predictors are
compared by within-unit Spearman rho on held-out minibatches (a unit's per-unit factor cannot change that ranking),
median over units with a bootstrap CI over minibatches.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax.memory import exposure
from hilore_jax.memory.config import PREDICTORS, ExposureSwitches
from hilore_jax.memory.hooks import StepHooks


def uses_forward(name: str) -> bool:
  return name.endswith("_forward")


def weights(name: str, w_abs_BN: jax.Array, logp_BN: jax.Array) -> jax.Array:
  """[B, N] the predictor's per-token weight from |w_t| and the sampled tokens' log-probs."""
  if name not in PREDICTORS:
    raise ValueError(f"predictor must be one of {list(PREDICTORS)}, got {name!r}")
  return w_abs_BN if name == "exposure_v1" else w_abs_BN * exposure.softmax_cotangent(logp_BN)


class Normalisation(NamedTuple):
  """What predicted errors are relative to (exposure.normaliser): static for a compiled scorer."""

  metric: str = "relative"
  max_grad_norm: float = 0.0


def score(sw: ExposureSwitches, norm: Normalisation, w_abs_BN, logp_BN, prompt_mask_BP, prompt_profile_UP,
          profile_UN, susceptibility_U, grad_scale, err_UBT=None) -> jax.Array:
  """[U] one minibatch's predicted errors: per-position weights over the prompt and completion, times the forward's
  per-token errors err_UBT [U, B, P-1+N] (cotangent_forward, where given) or the calibrated profiles."""
  c = weights(sw.predictor, w_abs_BN, logp_BN)
  w = exposure.sequence_weights(c, prompt_mask_BP, sw.prompt)
  scale = exposure.normaliser(exposure.token_norm(c, sw.coherence), norm.metric, grad_scale, norm.max_grad_norm)
  if err_UBT is not None and uses_forward(sw.predictor):
    return exposure.unit_exposure(w, err_UBT, susceptibility_U, sw, scale)
  P1, N = prompt_mask_BP.shape[1] - 1, w_abs_BN.shape[1]
  prof = jnp.concatenate([exposure.fit_length(prompt_profile_UP, P1, from_end=True),
                          exposure.fit_length(profile_UN, N)], axis=1)
  return exposure.runtime_scores(w, prof, susceptibility_U, sw, scale)


class ScoreInputs(NamedTuple):
  """What calibration gives the scores: per-position profiles, per-unit susceptibility, ||g|| per unit weight."""

  prompt_profile: np.ndarray  # [U, P-1] (may be [U, 0]: no prompt profile)
  profile: np.ndarray  # [U, N]
  susceptibility: np.ndarray  # [U]
  grad_scale: float = 1.0


class Scorer:
  """[M, U] predicted errors of a step's minibatches, in one jitted call and one host read."""

  def __init__(self, hooks: StepHooks):
    self.hooks = hooks
    self._fns: dict = {}

  def _fn(self, sw: ExposureSwitches, norm: Normalisation, forward: bool, l1: bool = False):
    key = (sw, norm, forward, l1)
    if key not in self._fns:
      def one(b, lp, pprof, prof, sus, gamma, err):
        w = self.hooks.token_weights(None, b, sw, lp)
        if l1:
          return exposure.token_norm(weights(sw.predictor, w, lp), sw.coherence)
        return score(sw, norm, w, lp, b.prompt_mask, pprof, prof, sus, gamma, err)
      self._fns[key] = jax.jit(jax.vmap(one, in_axes=(0, 0, None, None, None, None, 0 if forward else None)))
    return self._fns[key]

  @staticmethod
  def current_logp(minibatches: Sequence, logp=None) -> list:
    """Each minibatch's current log-probs as known: given (a previous pass's, replayed rows'), else its old ones
    (on its old policy), else zeros (a placeholder: ratio 1, cotangent unknown)."""
    logp = [None] * len(minibatches) if logp is None else logp
    cur = [b.old_logp if lp is None else lp for b, lp in zip(minibatches, logp)]
    return [jnp.zeros(b.mask.shape, jnp.float32) if lp is None else jnp.asarray(lp, jnp.float32)
            for b, lp in zip(minibatches, cur)]

  def __call__(self, minibatches: Sequence, inputs: ScoreInputs, sw: ExposureSwitches, norm: Normalisation,
               logp=None, token_err=None) -> np.ndarray:
    forward = uses_forward(sw.predictor) and token_err is not None and all(e is not None for e in token_err)
    stacked = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *minibatches)
    cur = jnp.stack(self.current_logp(minibatches, logp))
    err = jnp.stack([jnp.asarray(e, jnp.float32) for e in token_err]) if forward else None
    out = self._fn(sw, norm, forward)(stacked, cur, *(jnp.asarray(x, jnp.float32) for x in inputs[:3]),
                                      jnp.float32(inputs.grad_scale), err)
    return np.asarray(jax.device_get(out), np.float64)

  def l1(self, minibatches: Sequence, sw: ExposureSwitches, logp=None) -> np.ndarray:
    """[M] each minibatch's token norm of the predictor's completion weights (exposure.token_norm under
    sw.coherence: what normaliser scales)."""
    stacked = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *minibatches)
    cur = jnp.stack(self.current_logp(minibatches, logp))
    out = self._fn(sw, Normalisation(), False, l1=True)(stacked, cur, None, None, None, None, None)
    return np.asarray(jax.device_get(out), np.float64)


def fit_grad_scale(grad_norms, wnorm) -> float:
  """||g|| per unit of the weights' token norm: the median ratio over calibration minibatches with weight (1 if
  none)."""
  r = [g / w for g, w in zip(grad_norms, wnorm) if w > 0 and g > 0]
  return float(np.median(r)) if r else 1.0


def with_predictor(sw: ExposureSwitches, name: str) -> ExposureSwitches:
  return dataclasses.replace(sw, predictor=name)


# ----------------------------------------------------------------------------- comparison


def within_unit_spearman(score_MU, err_MU) -> np.ndarray:
  """[U] Spearman rho across minibatches, unit by unit (nan where either side is constant): Pearson on average
  ranks, all units at once."""
  from scipy.stats import rankdata

  rs, re = rankdata(np.asarray(score_MU, float), axis=0), rankdata(np.asarray(err_MU, float), axis=0)
  rs, re = rs - rs.mean(0), re - re.mean(0)
  den = np.sqrt((rs * rs).sum(0) * (re * re).sum(0))
  return np.where(den > 0, (rs * re).sum(0) / np.where(den > 0, den, 1.0), np.nan)


def rho_summary(score_MU, err_MU, n_boot: int = 2000, seed: int = 0) -> dict:
  """Median over units of the within-unit Spearman rho, with a bootstrap 95% CI over minibatches."""
  score_MU, err_MU = np.asarray(score_MU, float), np.asarray(err_MU, float)
  rho = within_unit_spearman(score_MU, err_MU)
  defined = np.isfinite(rho)
  med = float(np.median(rho[defined])) if defined.any() else float("nan")
  rng = np.random.default_rng(seed)
  M, boots = len(score_MU), []
  for _ in range(n_boot if defined.any() else 0):
    idx = rng.integers(0, M, M)
    r = within_unit_spearman(score_MU[idx], err_MU[idx])
    if np.isfinite(r).any():
      boots.append(np.nanmedian(r))
  lo, hi = np.quantile(boots, [0.025, 0.975]) if boots else (np.nan, np.nan)
  return {"within_unit_rho_median": med, "ci_low": float(lo), "ci_high": float(hi),
          "units_defined": int(defined.sum()),
          "share_positive": float(np.mean(rho[defined] > 0)) if defined.any() else float("nan")}


def compare(scores: dict[str, np.ndarray], err_MU, n_boot: int = 2000, seed: int = 0) -> tuple[dict, str]:
  """({name: rho_summary}, the name with the highest median within-unit rho; the first on a tie)."""
  rows = {name: rho_summary(s, err_MU, n_boot, seed) for name, s in scores.items()}
  ranked = [n for n in scores if np.isfinite(rows[n]["within_unit_rho_median"])]
  best = max(ranked, key=lambda n: rows[n]["within_unit_rho_median"]) if ranked else next(iter(scores))
  return rows, best
