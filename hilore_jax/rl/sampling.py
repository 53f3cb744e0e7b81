"""One decode step's draw: temperature, top-k and top-p without sorting the vocabulary, inverse-CDF sampling from
one uniform per row, each row from its own key, so a row's tokens do not depend on the rows beside it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hilore_jax.rl.config import SamplingConfig

NEG = float(jnp.finfo(jnp.float32).min)  # a removed token's logit (finite: a row never holds only -inf)
BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _ordered(x: jax.Array) -> jax.Array:
  """float32 -> int32 keys in the same order (negative floats' bits reversed)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, jnp.int32(-(2 ** 31)) - bits, bits)


def largest_threshold(x_BV: jax.Array, enough) -> jax.Array:
  """[B, 1] int32: per row, the largest order key tau with enough(keep_BV = key(x) >= tau) true, found by bisection
  over float32's order keys: 32 masked passes over [B, V], no sort (XLA:CPU sorts the whole row for lax.top_k).
  enough must hold when every entry is kept and be monotone (fewer kept, never more enough)."""
  key = _ordered(x_BV)
  lo, hi = jnp.min(key, -1, keepdims=True), jnp.max(key, -1, keepdims=True)  # enough(lo) holds; hi bounds tau

  def body(_, lohi):
    lo, hi = lohi
    # mid = lo + ceil((hi - lo) / 2), in (lo, hi] until they meet; the difference of two int32 keys may not fit in
    # int32, so it is taken in uint32 (wrapping back to the right int32 sum)
    span = jax.lax.bitcast_convert_type(hi - lo, jnp.uint32) + jnp.uint32(1)
    mid = lo + jax.lax.bitcast_convert_type(jax.lax.shift_right_logical(span, jnp.uint32(1)), jnp.int32)
    ok = enough(key >= mid)[:, None]
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
  return lo


def _keep(x_BV, tau_B1) -> jax.Array:
  return _ordered(x_BV) >= tau_B1


def process_logits(logits_BV: jax.Array, sc: SamplingConfig) -> jax.Array:
  """Logits of the sampling distribution: temperature, then top-k, then top-p (the smallest set of the most likely
  tokens whose mass reaches top_p; ties with its least likely token kept), removed tokens at NEG."""
  logits_BV = logits_BV.astype(jnp.float32) / sc.temperature
  if sc.top_k and sc.top_k < logits_BV.shape[-1]:
    tau = largest_threshold(logits_BV, lambda keep: jnp.sum(keep, -1) >= sc.top_k)
    logits_BV = jnp.where(_keep(logits_BV, tau), logits_BV, NEG)
  if sc.top_p < 1.0:
    probs = jax.nn.softmax(logits_BV, axis=-1)
    tau = largest_threshold(probs, lambda keep: jnp.sum(jnp.where(keep, probs, 0.0), -1) >= sc.top_p)
    logits_BV = jnp.where(_keep(probs, tau), logits_BV, NEG)
  return logits_BV


def _last_nonzero(x_BW: jax.Array) -> jax.Array:
  """[B] index of each row's last entry > 0 (0 where none)."""
  W = x_BW.shape[-1]
  return jnp.max(jnp.where(x_BW > 0, jnp.arange(W), 0), axis=-1)


def inverse_cdf(probs_BV: jax.Array, u_B: jax.Array) -> jax.Array:
  """[B] int32: per row the first token whose cumulative probability exceeds u * total, u in [0, 1): blocks of
  BLOCK tokens, the block by the blocks' cumulative mass, then the token inside it; never a zero-probability
  token, whatever the rounding of the two sums."""
  B, V = probs_BV.shape
  nb = -(-V // BLOCK)
  p = jnp.pad(probs_BV, [(0, 0), (0, nb * BLOCK - V)]).reshape(B, nb, BLOCK)
  mass_Bn = jnp.sum(p, -1)
  cum_Bn = jnp.cumsum(mass_Bn, -1)
  target = u_B * cum_Bn[:, -1]
  b = jnp.minimum(jnp.sum(cum_Bn <= target[:, None], -1), _last_nonzero(mass_Bn))
  before = jnp.where(b > 0, jnp.take_along_axis(cum_Bn, jnp.maximum(b - 1, 0)[:, None], -1)[:, 0], 0.0)
  local_BW = jnp.take_along_axis(p, b[:, None, None], 1)[:, 0]
  target_in = jnp.maximum(target - before, 0.0)
  j = jnp.minimum(jnp.sum(jnp.cumsum(local_BW, -1) <= target_in[:, None], -1), _last_nonzero(local_BW))
  return (b * BLOCK + j).astype(jnp.int32)


def row_uniforms(keys_B: jax.Array, t) -> jax.Array:
  """[B] float32 in [0, 1): row r's draw for token t, from its own key alone."""
  return jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, t), (), jnp.float32))(keys_B)


def pick(logits_BV: jax.Array, keys_B: jax.Array, t, sc: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """(token [B] int32, its log-prob [B]) of token t: greedy (argmax, log-prob under the plain softmax) or drawn from
  the processed distribution with each row's key, log-prob under that distribution."""
  if sc.greedy:
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), -1)
    tok = jnp.argmax(logits_BV, -1).astype(jnp.int32)
  else:
    logp_BV = jax.nn.log_softmax(process_logits(logits_BV, sc), -1)
    tok = inverse_cdf(jnp.exp(logp_BV), row_uniforms(keys_B, t))
  return tok, jnp.take_along_axis(logp_BV, tok[:, None], -1)[:, 0]
