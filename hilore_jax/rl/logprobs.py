"""Per-token log-probs and entropy in sequence chunks, never materialising [B, T, V] float32 logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunk_stats(h_BCD, w_DV, targets_BC, temperature: float = 1.0):
  # float32 accumulation and result whatever the compute dtype (model.head_logits; logprobs imports no model)
  logits = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV.astype(h_BCD.dtype), preferred_element_type=jnp.float32)
  if temperature != 1.0:  # the sampling distribution's log-probs (rollouts sample from logits / T)
    logits = logits / temperature
  logz = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets_BC[..., None], axis=-1)[..., 0]
  probs = jnp.exp(logits - logz[..., None])
  entropy = logz - jnp.sum(probs * logits, axis=-1)
  return target_logit - logz, entropy


def token_logprobs(h_BTD: jax.Array, w_DV: jax.Array, targets_BT: jax.Array, chunk: int = 128,
                   temperature: float = 1.0):
  """(log p(target), entropy) [B, T] under softmax(logits / temperature), `chunk` positions at a time.

  Each chunk runs under jax.checkpoint so backward recomputes its logits instead of keeping them.
  """
  B, T, D = h_BTD.shape
  chunk = max(1, min(chunk, T))
  n = -(-T // chunk)
  pad = n * chunk - T
  h = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
  tgt = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
  stats = jax.checkpoint(lambda h, w, t: _chunk_stats(h, w, t, temperature))

  def body(carry, xs):
    return carry, stats(xs[0], w_DV, xs[1])

  _, (logp, ent) = jax.lax.scan(body, None, (h, tgt))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
  return unchunk(logp), unchunk(ent)
