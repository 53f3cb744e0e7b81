"""GRPO numerics as pure functions: advantages, clipped surrogate, KL estimators, aggregation, w_t.

The advantage functions use array methods only, so numpy rewards give numpy advantages on the host (the update
batch is built there) and jax arrays give jax arrays.

Imports nothing from the package: the settings arrive as `lc`, any object with the loss fields of
config.GRPOConfig (loss_agg, eps_low, eps_high, dual_clip, beta, kl_estimator, kl_clamp,
max_completion_len), validated there.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

ADVANTAGES = ("grpo", "rloo", "dr_grpo")
STD_SCALES = ("group", "batch", "none")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
STD_EPS = 1e-4


# ----------------------------------------------------------------------------- advantages


def _std(x, axis=None, keepdims=False):
  return x.std(axis=axis, ddof=1, keepdims=keepdims)  # unbiased, as TRL and DeepSeekMath


def _scaled(adv_PG: jax.Array, rewards_PG: jax.Array, std_scale: str) -> jax.Array:
  # times the reciprocal: what XLA makes of a division by a broadcast value, so numpy (the host) and jax agree bitwise
  if std_scale == "group":
    return adv_PG * (1.0 / (_std(rewards_PG, axis=1, keepdims=True) + STD_EPS))
  if std_scale == "batch":
    return adv_PG * (1.0 / (_std(rewards_PG) + STD_EPS))
  if std_scale == "none":
    return adv_PG
  raise ValueError(f"std_scale must be one of {list(STD_SCALES)}, got {std_scale!r}")


def grpo_advantages(rewards_PG: jax.Array, std_scale: str = "group") -> jax.Array:
  """Reward minus its group mean, divided by the group's (or batch's) std, or not scaled."""
  return _scaled(rewards_PG - rewards_PG.mean(axis=1, keepdims=True), rewards_PG, std_scale)


def rloo_advantages(rewards_PG: jax.Array, std_scale: str = "none") -> jax.Array:
  """Reward minus the mean of the other G-1 rewards of its group (leave-one-out baseline)."""
  G = rewards_PG.shape[1]
  loo = (rewards_PG.sum(axis=1, keepdims=True) - rewards_PG) / (G - 1)
  return _scaled(rewards_PG - loo, rewards_PG, std_scale)


def dr_grpo_advantages(rewards_PG: jax.Array, std_scale: str = "none") -> jax.Array:
  """Dr.GRPO: reward minus group mean, never divided by a std (the std_scale knob is ignored)."""
  del std_scale
  return rewards_PG - rewards_PG.mean(axis=1, keepdims=True)


ADVANTAGE_FNS: dict[str, Callable] = {"grpo": grpo_advantages, "rloo": rloo_advantages,
                                      "dr_grpo": dr_grpo_advantages}


def advantages(name: str, rewards_PG: jax.Array, std_scale: str = "group") -> jax.Array:
  """[P, G] advantages by the named estimator (one of ADVANTAGES)."""
  return ADVANTAGE_FNS[name](rewards_PG, std_scale)


def zero_std_groups(rewards_PG: jax.Array) -> jax.Array:
  """[P] True where every completion of a prompt got the same reward (no learning signal)."""
  return (rewards_PG == rewards_PG[:, :1]).all(axis=1)


# ----------------------------------------------------------------------------- per-token terms


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, estimator: str, clamp: float | None = None) -> jax.Array:
  """Per-token KL(pi || ref) estimators of Schulman: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r; with
  clamp, log r is clipped to [-clamp, clamp] first (its gradient is then 0 outside)."""
  log_r = ref_logp - logp
  if clamp is not None:
    log_r = jnp.clip(log_r, -clamp, clamp)
  if estimator == "k1":
    return -log_r
  if estimator == "k2":
    return 0.5 * log_r**2
  if estimator == "k3":
    return jnp.exp(log_r) - 1.0 - log_r
  raise ValueError(f"kl_estimator must be one of {list(KL_ESTIMATORS)}, got {estimator!r}")


def kl_grad(logp: jax.Array, ref_logp: jax.Array, estimator: str, clamp: float | None = None) -> jax.Array:
  """d kl_estimate / d logp (with clamp: 0 where the log-ratio lies outside [-clamp, clamp], as autodiff of the
  clipped estimate gives, so a token whose probability collapsed against the reference adds no unbounded
  1 - r)."""
  log_r = ref_logp - logp
  g = {"k1": jnp.ones_like(logp), "k2": -log_r, "k3": 1.0 - jnp.exp(log_r)}[estimator]
  return g if clamp is None else jnp.where(jnp.abs(log_r) <= clamp, g, 0.0)


def policy_loss(logp, old_logp, adv, lc) -> tuple[jax.Array, jax.Array]:
  """Per-token clipped surrogate -min(r A, clip(r) A) (dual-clipped if set) and its clip mask."""
  ratio = jnp.exp(logp - old_logp)
  surr = ratio * adv
  surr_clipped = jnp.clip(ratio, 1.0 - lc.eps_low, 1.0 + lc.eps_high) * adv
  loss = -jnp.minimum(surr, surr_clipped)
  clipped = surr_clipped < surr  # the constant branch is active: no gradient from this token
  if lc.dual_clip is not None:
    cap = -lc.dual_clip * adv
    dual = (adv < 0) & (loss > cap)
    loss = jnp.where(dual, cap, loss)
    clipped = clipped | dual
  return loss, clipped


def token_weights(mask_BT: jax.Array, lc, num_seqs, num_tokens) -> jax.Array:
  """Each token's weight in the aggregated loss; normalisers come from the whole minibatch."""
  mask = mask_BT.astype(jnp.float32)
  if lc.loss_agg == "token-mean":
    return mask / jnp.maximum(num_tokens, 1.0)
  if lc.loss_agg == "seq-mean-token-mean":
    lens = jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    return mask / lens / jnp.maximum(num_seqs, 1.0)
  return mask / (jnp.maximum(num_seqs, 1.0) * lc.max_completion_len)


def normalisers(mask_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(number of sequences with any token, number of tokens) of a batch."""
  return (mask_BT.sum(axis=1) > 0).sum().astype(jnp.float32), mask_BT.sum().astype(jnp.float32)


def _selected(mask_BT: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
  """xs with 0 at masked positions, selected rather than multiplied: inf * 0 (a pad token's -inf log-prob, an
  overflowing ratio) is NaN."""
  keep = mask_BT.astype(bool)
  return tuple(jnp.where(keep, x, jnp.zeros_like(x)) for x in xs)


def grpo_loss(logp, old_logp, ref_logp, adv_B, mask_BT, lc, num_seqs=None, num_tokens=None):
  """Aggregated GRPO loss and per-token stats; logp etc. are [B, T], adv_B one per sequence."""
  if num_seqs is None:
    num_seqs, num_tokens = normalisers(mask_BT)
  # inputs too, not only the result: the backward of a where still multiplies its zero cotangent into the
  # derivative of the unselected branch (exp(inf) there makes 0 * inf = NaN)
  logp, old_logp, ref_logp = _selected(mask_BT, logp, old_logp, ref_logp)
  adv = adv_B[:, None]
  pg, clipped = policy_loss(logp, old_logp, adv, lc)
  per_token = pg
  kl = jnp.zeros_like(logp)
  if lc.beta > 0:
    kl = kl_estimate(logp, ref_logp, lc.kl_estimator, lc.kl_clamp)
    per_token = per_token + lc.beta * kl
  weights = token_weights(mask_BT, lc, num_seqs, num_tokens)
  per_token, kl, log_ratio = _selected(mask_BT, per_token, kl, jnp.abs(logp - old_logp))
  loss = jnp.sum(per_token * weights)
  m = mask_BT.astype(jnp.float32)
  stats = {"clipped_tokens": jnp.sum(clipped & mask_BT.astype(bool), dtype=jnp.float32), "kl_sum": jnp.sum(kl),
           "tokens": m.sum(), "abs_log_ratio_sum": jnp.sum(log_ratio)}
  return loss, stats


def loss_coefficients(logp, old_logp, ref_logp, adv_B, mask_BT, lc, num_seqs=None,
                      num_tokens=None) -> jax.Array:
  """w_t = d loss / d logp_t from forward quantities alone (ratio, advantage, clip mask, KL, weights)."""
  if num_seqs is None:
    num_seqs, num_tokens = normalisers(mask_BT)
  logp, old_logp, ref_logp = _selected(mask_BT, logp, old_logp, ref_logp)
  adv = adv_B[:, None]
  ratio = jnp.exp(logp - old_logp)
  _, clipped = policy_loss(logp, old_logp, adv, lc)
  w = jnp.where(clipped, 0.0, -adv * ratio)
  if lc.beta > 0:
    w = w + lc.beta * kl_grad(logp, ref_logp, lc.kl_estimator, lc.kl_clamp)
  return _selected(mask_BT, w)[0] * token_weights(mask_BT, lc, num_seqs, num_tokens)
