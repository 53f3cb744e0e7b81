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

from hilore_jax import grpo
from hilore_jax.config import ExposureSwitches


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
