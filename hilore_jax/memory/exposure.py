"""Policy-update exposure: how much error in a saved unit can reach this step's parameter gradient.

A unit's L error e_t enters only its own weight gradient, as sum_t e_t (x) delta_t, where the cotangent delta_t at
token t scales with the token's loss coefficient w_t = d loss / d logp_t. Rounding errors of different tokens are
independent, so the error's norm adds in quadrature, and the gradient itself scales with w. The exposure of unit u,
a predictor of its relative gradient error, is therefore

    exposure_u = s_u * sqrt(sum_t w_t^2 * |e_{u,t}|^2) / sqrt(sum_t w_t^2)

with |e_{u,t}| the unit's per-token reconstruction error (proportional to its activation magnitude) and s_u its
measured susceptibility. Everything is known after the forward pass, before backward. Different units' errors land
in disjoint weight gradients, so squared exposures add: the risk of a set of L units is the sum of their squares.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.rl import grpo


def token_weights(logp, old_logp, ref_logp, adv_B, mask_BT, lc,
                  sw: ExposureSwitches = ExposureSwitches()) -> jax.Array:
  """|w_t| [B, T] under the switches (the GRPO forward quantities alone)."""
  mask = mask_BT if sw.update_mask else jnp.ones_like(mask_BT)
  if sw.ratio_clip:
    lc_used = lc if sw.kl else dataclasses.replace(lc, beta=0.0)
    w = grpo.loss_coefficients(logp, old_logp, ref_logp, adv_B, mask, lc_used)
  else:
    num_seqs, num_tokens = grpo.normalisers(mask)
    w = adv_B[:, None] * grpo.token_weights(mask, lc, num_seqs, num_tokens)
    if sw.kl and lc.beta > 0:
      w = w + lc.beta * grpo.kl_grad(logp, ref_logp, lc.kl_estimator) * grpo.token_weights(
          mask, lc, num_seqs, num_tokens)
  return jnp.abs(w)


def unit_exposure(w_abs_BT: jax.Array, err_UBT: jax.Array, susceptibility_U: jax.Array,
                  sw: ExposureSwitches = ExposureSwitches()) -> jax.Array:
  """[U] exposure from |w_t| [B, T], per-token reconstruction errors [U, B, T] and per-unit susceptibility."""
  err = err_UBT if sw.activation else jnp.ones_like(err_UBT)
  s = susceptibility_U if sw.susceptibility else jnp.ones_like(susceptibility_U)
  w2 = w_abs_BT * w_abs_BT
  # 0 when no token is updated (every group had zero advantage): nothing can reach the gradient
  return s * jnp.sqrt(jnp.einsum("bt,ubt->u", w2, err * err) / jnp.maximum(jnp.sum(w2), 1e-30))


def position_profile(err_UBT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """[U, T] root-mean-square reconstruction error of each unit at each completion position over the rows that
  have a token there (positions no row reaches take the unit's overall RMS)."""
  m = mask_BT.astype(jnp.float32)
  sq = jnp.einsum("bt,ubt->ut", m, err_UBT * err_UBT)
  count = jnp.sum(m, axis=0)
  overall = jnp.sqrt(jnp.sum(sq, axis=1) / jnp.maximum(jnp.sum(count), 1.0))
  return jnp.where(count > 0, jnp.sqrt(sq / jnp.maximum(count, 1.0)), overall[:, None])


def runtime_scores(w_abs_BT: jax.Array, profile_UT: jax.Array, susceptibility_U: jax.Array,
                   sw: ExposureSwitches = ExposureSwitches()) -> jax.Array:
  """[U] run-time exposure of each unit from the batch's |w_t| alone (no forward pass):

      score_u = s_u * sqrt(sum_t w_t^2 p_u[pos t]^2) / sum_t |w_t|

  p_u the unit's calibrated per-position reconstruction error (what the forward would show, on average). The
  numerator is the error that reaches the gradient (rounding errors of different tokens add in quadrature); the
  denominator the gradient's scale (token contributions add coherently). A unit with a flat profile scores
  s_u * p_u * ||w||_2 / ||w||_1; 0 when no token is updated (nothing can reach the gradient)."""
  T = w_abs_BT.shape[1]
  prof = profile_UT[:, :T] if profile_UT.shape[1] >= T else jnp.pad(
      profile_UT, ((0, 0), (0, T - profile_UT.shape[1])), mode="edge")  # longer completions: the last position's
  prof = prof if sw.activation else jnp.ones_like(prof)
  s = susceptibility_U if sw.susceptibility else jnp.ones_like(susceptibility_U)
  w2 = jnp.sum(w_abs_BT * w_abs_BT, axis=0)  # [T]: rows at one position share the profile
  return s * jnp.sqrt(jnp.einsum("t,ut->u", w2, prof * prof)) / jnp.maximum(jnp.sum(w_abs_BT), 1e-30)
