"""Policy-update exposure: how much error in a saved unit can reach this step's parameter gradient.

A unit's L error enters the weight gradient as sum_t err_t * delta_t, where the cotangent delta_t at token t
scales with the token's loss coefficient w_t = d loss / d logp_t. So the exposure of unit u is

    exposure_u = s_kind(u) * sum_t |w_t| * a_{u,t}

with a_{u,t} the unit's activation magnitude at token t (int8 error is proportional to it) and s_kind the
measured susceptibility of the unit's kind. Everything is known after the forward pass, before backward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hilore_jax import grpo


@dataclasses.dataclass(frozen=True)
class ExposureSwitches:
  """Each component can be switched off for ablations."""

  ratio_clip: bool = True  # use w_t (ratio, clip mask); off: |advantage| per token
  update_mask: bool = True  # only tokens that are updated; off: every position counts
  kl: bool = True  # include the beta * KL part of w_t
  activation: bool = True  # weight by the unit's activation magnitude; off: 1
  susceptibility: bool = True  # per-kind measured factor; off: 1


def token_weights(logp, old_logp, ref_logp, adv_B, mask_BT, lc: grpo.LossConfig,
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


def unit_exposure(w_abs_BT: jax.Array, act_UBT: jax.Array, susceptibility_U: jax.Array,
                  sw: ExposureSwitches = ExposureSwitches()) -> jax.Array:
  """[U] exposure of each unit from |w_t| [B, T], activation magnitudes [U, B, T] and per-unit susceptibility."""
  act = act_UBT if sw.activation else jnp.ones_like(act_UBT)
  s = susceptibility_U if sw.susceptibility else jnp.ones_like(susceptibility_U)
  return s * jnp.einsum("bt,ubt->u", w_abs_BT, act)
