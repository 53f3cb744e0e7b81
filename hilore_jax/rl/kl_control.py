"""Predicted-KL step control: shrink a proposed update so the policy's per-token KL stays under a target.

With logits z and their directional derivative dz along the update (one jax.jvp through the model),
KL(softmax(z) || softmax(z + s dz)) = s^2 / 2 * Var_p(dz) + O(s^3), p = softmax(z): the Fisher quadratic form.
Logits are formed `chunk` positions at a time (as rl/logprobs.py), never as [B, T, V] float32 at once.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _chunked(fn, chunk: int, *xs_BT):
  """fn over sequence chunks of [B, T, ...] arrays -> [B, T] per-token values (lax.scan over chunks)."""
  B, T = xs_BT[0].shape[:2]
  chunk = max(1, min(chunk, T))
  n = -(-T // chunk)
  pad = n * chunk - T

  def split(x):
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(B, n, chunk, *x.shape[2:]).swapaxes(0, 1)

  _, out = jax.lax.scan(lambda c, xs: (c, fn(*xs)), None, tuple(split(x) for x in xs_BT))
  return out.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]


def _masked_mean(x_BT, mask_BT):
  m = mask_BT.astype(jnp.float32)
  return jnp.sum(x_BT * m) / jnp.maximum(jnp.sum(m), 1.0)


def _logits(h_BCD, w_DV):
  return jnp.einsum("bcd,dv->bcv", h_BCD.astype(jnp.float32), w_DV.astype(jnp.float32))


def token_predicted_kl(h_BTD, dh_BTD, w_DV, dw_DV, chunk: int = 128) -> jax.Array:
  """0.5 * Var_p(dz) [B, T], z = h W, dz = dh W + h dW, p = softmax(z)."""
  def per_chunk(h, dh):
    z, dz = _logits(h, w_DV), _logits(dh, w_DV) + _logits(h, dw_DV)
    p = jax.nn.softmax(z, axis=-1)
    mean = jnp.sum(p * dz, axis=-1, keepdims=True)
    return 0.5 * jnp.sum(p * jnp.square(dz - mean), axis=-1)  # centred: no cancellation of E[dz^2] - E[dz]^2
  return _chunked(per_chunk, chunk, h_BTD, dh_BTD)


def token_kl(h0_BTD, h1_BTD, w0_DV, w1_DV, chunk: int = 128) -> jax.Array:
  """Exact KL(softmax(h0 W0) || softmax(h1 W1)) [B, T]."""
  def per_chunk(h0, h1):
    z0 = _logits(h0, w0_DV)
    d = _logits(h1, w1_DV) - z0
    p0 = jax.nn.softmax(z0, axis=-1)
    d = d - jnp.sum(p0 * d, axis=-1, keepdims=True)
    # KL = log E_p0[exp(d)] - E_p0[d]; log1p/expm1 keep it accurate when KL is far below float32's epsilon * |z|
    return jnp.log1p(jnp.sum(p0 * jnp.expm1(d), axis=-1))
  return _chunked(per_chunk, chunk, h0_BTD, h1_BTD)


def predicted_kl(hidden_fn: Callable, head_fn: Callable, params, update, mask_BT, chunk: int = 128) -> jax.Array:
  """Mean second-order KL(pi || pi after params + update) over masked tokens, from one JVP.

  hidden_fn(params) -> final hidden states [B, T, D] at the scored positions; head_fn(params) -> lm head [D, V].
  """
  update = jax.tree.map(lambda p, u: u.astype(p.dtype), params, update)  # jvp wants tangents in the params' dtypes
  h, dh = jax.jvp(hidden_fn, (params,), (update,))
  w, dw = jax.jvp(head_fn, (params,), (update,))
  return _masked_mean(token_predicted_kl(h, dh, w, dw, chunk), mask_BT)


def realized_kl(hidden_fn: Callable, head_fn: Callable, params, update, mask_BT, chunk: int = 128) -> jax.Array:
  """Mean exact KL(pi || pi after params + update) over masked tokens (two forwards; for logging and tests)."""
  after = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, update)
  return _masked_mean(token_kl(hidden_fn(params), hidden_fn(after), head_fn(params), head_fn(after), chunk), mask_BT)


def control_scale(predicted, target) -> jax.Array:
  """s in (0, 1] with s^2 * predicted <= target (KL is quadratic in the step); 1 when target <= 0 (off)."""
  predicted, target = jnp.asarray(predicted, jnp.float32), jnp.asarray(target, jnp.float32)
  over = (target > 0) & (predicted > target)
  return jnp.where(over, jnp.sqrt(target / jnp.where(over, predicted, 1.0)), 1.0)


def scaled_update(hidden_fn: Callable, head_fn: Callable, params, update, mask_BT, target,
                  chunk: int = 128) -> tuple[object, dict]:
  """(update * s, metrics) with s = control_scale(predicted_kl(update), target)."""
  predicted = predicted_kl(hidden_fn, head_fn, params, update, mask_BT, chunk)
  s = control_scale(predicted, target)
  scaled = jax.tree.map(lambda u: (u * s).astype(u.dtype), update)
  return scaled, {"kl_control/predicted": predicted, "kl_control/scale": s}
