"""Policy-update exposure: how much error in a saved unit can reach this step's update, as pure functions.

A unit's L error e_t at position t reaches the gradient through the cotangent delta_t there: in its own weight
gradient as e_t (x) delta_t, and, for the units backward reads exactly (a norm, softmax or nonlinearity derivative),
through the input gradients of every earlier layer too (most of their error lands outside their own layer). Either
way it scales with the cotangent, and delta_t scales with the token's loss coefficient w_t = d loss / d logp_t.
Rounding errors of different tokens are independent, so their contributions add in quadrature:

    exposure_u = s_u * sqrt(sum_t w_t^2 |e_{u,t}|^2) / scale

|e_{u,t}| the unit's per-token reconstruction error, s_u its measured susceptibility (how much of it reaches the
update, wherever it lands), and scale what the risk is relative to (normaliser: the gradient's scale for the
relative error, the clip for the clipped one; the gradient's scale is the token weights' sum, or their root sum of
squares since GRPO's zero-mean advantages make token contributions cancel rather than add: token_norm). Positions
t cover the prompt too: completion tokens attend to it, so the cotangent reaches its activations (prompt_weights).
Everything is known after the forward pass, before backward; at run time a calibrated per-position profile stands
in for |e_{u,t}| (runtime_scores).
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
      w = w + lc.beta * grpo.kl_grad(logp, ref_logp, lc.kl_estimator, lc.kl_clamp) * grpo.token_weights(
          mask, lc, num_seqs, num_tokens)
  return jnp.abs(w)


def softmax_cotangent(logp_BN: jax.Array) -> jax.Array:
  """1 - p_t, p_t = exp(logp_t) the sampled token's probability: the softmax cotangent e_y - pi_t of a confident
  token is about 0, so its loss coefficient barely reaches backward. A log-prob of exactly 0 is a placeholder (rows
  whose log-probs no forward filled in, see update_batch) and counts as unknown: 1."""
  return jnp.where(logp_BN < 0, -jnp.expm1(jnp.minimum(logp_BN, 0.0)), 1.0)


def prompt_weights(c_BN: jax.Array, prompt_mask_BP: jax.Array) -> jax.Array:
  """[B, P-1] the weight of each prompt position but the last (which predicts the first completion token: a
  completion position): the attention cotangent reaching it under uniform attention. Completion token j's query (at
  position P-1+j) sees the row's P_b real prompt tokens and its j predecessors, so each key receives 1/(P_b + j) of
  that token's coefficient c_j, and a prompt position sum_j c_j / (P_b + j). Uniform attention is what is known
  without a forward pass; the per-unit susceptibility absorbs how far real attention departs from it."""
  pm = prompt_mask_BP.astype(jnp.float32)
  keys = jnp.sum(pm, axis=1, keepdims=True) + jnp.arange(c_BN.shape[1], dtype=jnp.float32)[None]
  share = jnp.sum(c_BN / jnp.maximum(keys, 1.0), axis=1, keepdims=True)
  return pm[:, :-1] * share


def position_mask(prompt_mask_BP: jax.Array, mask_BN: jax.Array) -> jax.Array:
  """[B, P-1+N] the real positions among those whose activations reach a completion log-prob: the prompt's but the
  last, then the completion's (the order of StepHooks.unit_tensors)."""
  return jnp.concatenate([prompt_mask_BP[:, :-1], mask_BN], axis=1).astype(jnp.float32)


def sequence_weights(c_BN: jax.Array, prompt_mask_BP: jax.Array, prompt: bool = True) -> jax.Array:
  """[B, P-1+N] per-position weights: prompt_weights (zeros with prompt off), then the completion's c_BN."""
  pw = prompt_weights(c_BN, prompt_mask_BP)
  return jnp.concatenate([pw if prompt else jnp.zeros_like(pw), c_BN], axis=1)


def token_norm(c, coherence: str = "coherent"):
  """How the gradient's norm grows with the token weights c (any shape): sum |c_t| coherent, sqrt(sum c_t^2)
  incoherent.

  The gradient is g = sum_t c_t j_t, j_t token t's log-prob gradient (|j_t| ~ J). If every c_t j_t pointed one way
  ||g|| = J sum |c_t| (coherent). GRPO's advantages are zero-mean within a group, so the signs of c_t differ and
  different tokens' j_t are nearly orthogonal: their contributions cancel as a random walk does, and
  E||g||^2 = J^2 sum c_t^2, ||g|| ~ J sqrt(sum c_t^2) (incoherent). The unit's error adds in quadrature in either
  case (unit_exposure), so with a flat error profile p the relative score is s p under the incoherent sum, flat in
  the token count as a relative error of independent terms is, but s p ||c||_2 / ||c||_1 under the coherent one,
  which falls as 1/sqrt(n) with n tokens and ranks long minibatches as safe for that alone. Whatever remains of
  coherence (correlated tokens) is a constant factor per run: grad_scale (fit_grad_scale) measures it. Incoherent
  also makes clipping, which removes tokens from the numerator and the scale alike, nearly invisible to a
  flat-profile unit's relative score; the default stays coherent until the exposure experiment decides."""
  c = jnp.abs(jnp.asarray(c, jnp.float32))
  if coherence == "coherent":
    return jnp.sum(c)
  if coherence == "incoherent":
    return jnp.sqrt(jnp.sum(c * c))
  raise ValueError(f"coherence must be one of ['coherent', 'incoherent'], got {coherence!r}")


def normaliser(wnorm, metric: str, grad_scale, max_grad_norm: float):
  """What a unit's predicted error is relative to, from the token norm of the completion weights wnorm (token_norm:
  the gradient's scale up to a constant): wnorm itself for the relative error; max(grad_scale * wnorm, c) for the
  clipped error and the update's (grad_scale, calibrated, turns wnorm into ||g||; c the clip, the largest update)."""
  if metric == "relative":
    return jnp.maximum(wnorm, 1e-30)
  return jnp.maximum(jnp.maximum(grad_scale * wnorm, max_grad_norm), 1e-30)


def unit_exposure(w_abs_BT: jax.Array, err_UBT: jax.Array, susceptibility_U: jax.Array,
                  sw: ExposureSwitches = ExposureSwitches(), scale=None) -> jax.Array:
  """[U] exposure from per-position weights [B, T], per-token reconstruction errors [U, B, T] and per-unit
  susceptibility, relative to scale (default token_norm(w, sw.coherence): the same normalisation as runtime_scores,
  so one fitted susceptibility serves both)."""
  err = err_UBT if sw.activation else jnp.ones_like(err_UBT)
  s = susceptibility_U if sw.susceptibility else jnp.ones_like(susceptibility_U)
  scale = jnp.maximum(token_norm(w_abs_BT, sw.coherence) if scale is None else scale, 1e-30)
  # 0 when no token is updated (every group had zero advantage): nothing can reach the gradient
  return s * jnp.sqrt(jnp.einsum("bt,ubt->u", w_abs_BT * w_abs_BT, err * err)) / scale


def position_profile(err_UBT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """[U, T] root-mean-square reconstruction error of each unit at each position over the rows that have a token
  there (positions no row reaches take the unit's overall RMS)."""
  m = mask_BT.astype(jnp.float32)
  sq = jnp.einsum("bt,ubt->ut", m, err_UBT * err_UBT)
  count = jnp.sum(m, axis=0)
  overall = jnp.sqrt(jnp.sum(sq, axis=1) / jnp.maximum(jnp.sum(count), 1.0))
  return jnp.where(count > 0, jnp.sqrt(sq / jnp.maximum(count, 1.0)), overall[:, None])


def fit_length(profile_UT: jax.Array, T: int, from_end: bool = False) -> jax.Array:
  """A profile cut or edge-padded to T positions: at its end for a completion (longer ones read the last position),
  at its start with from_end (a prompt, aligned to its last token)."""
  have = profile_UT.shape[1]
  if have == 0:
    return jnp.zeros((profile_UT.shape[0], T), profile_UT.dtype)
  if from_end:
    return profile_UT[:, have - T:] if have >= T else jnp.pad(profile_UT, ((0, 0), (T - have, 0)), mode="edge")
  return profile_UT[:, :T] if have >= T else jnp.pad(profile_UT, ((0, 0), (0, T - have)), mode="edge")


def runtime_scores(w_abs_BT: jax.Array, profile_UT: jax.Array, susceptibility_U: jax.Array,
                   sw: ExposureSwitches = ExposureSwitches(), scale=None) -> jax.Array:
  """[U] run-time exposure of each unit from per-position weights alone (no forward pass):

      score_u = s_u * sqrt(sum_t w_t^2 p_u[pos t]^2) / scale

  p_u the unit's calibrated per-position reconstruction error (what the forward would show, on average), scale as
  in unit_exposure. A unit with a flat profile and the default scale scores s_u * p_u * ||w||_2 / ||w||_1
  (coherent) or s_u * p_u (incoherent); 0 when no token is updated (nothing can reach the gradient)."""
  prof = fit_length(profile_UT, w_abs_BT.shape[1])
  prof = prof if sw.activation else jnp.ones_like(prof)
  s = susceptibility_U if sw.susceptibility else jnp.ones_like(susceptibility_U)
  scale = jnp.maximum(token_norm(w_abs_BT, sw.coherence) if scale is None else scale, 1e-30)
  w2 = jnp.sum(w_abs_BT * w_abs_BT, axis=0)  # [T]: rows at one position share the profile
  return s * jnp.sqrt(jnp.einsum("t,ut->u", w2, prof * prof)) / scale
