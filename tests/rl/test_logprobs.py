import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close

from hilore_jax.rl import logprobs


def _naive(h, w, tgt):
  """Reference: full logits at once."""
  return logprobs._chunk_stats(h, w, tgt)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 3, 13, 50])  # one a position, a remainder chunk, exact, one chunk over T
def test_chunked_equals_naive_values_and_grads(chunk):
  rng = np.random.RandomState(0)
  h = jnp.asarray(rng.randn(3, 13, 7), jnp.float32)
  w = jnp.asarray(rng.randn(7, 29), jnp.float32)
  tgt = jnp.asarray(rng.randint(0, 29, (3, 13)))
  lp, ent = jax.jit(logprobs.token_logprobs, static_argnums=3)(h, w, tgt, chunk)
  lp0, ent0 = _naive(h, w, tgt)
  np.testing.assert_allclose(lp, lp0, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ent, ent0, rtol=1e-5, atol=1e-6)
  # against an independent numpy computation too
  logits = np.einsum("btd,dv->btv", np.asarray(h), np.asarray(w))
  logz = np.log(np.exp(logits).sum(-1))
  want = np.take_along_axis(logits, np.asarray(tgt)[..., None], -1)[..., 0] - logz
  np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
  f = lambda fn: lambda h, w: jnp.sum(fn(h, w, tgt)[0] * jnp.arange(13)) + jnp.sum(fn(h, w, tgt)[1])
  g = jax.grad(f(lambda h, w, t: logprobs.token_logprobs(h, w, t, chunk)), argnums=(0, 1))(h, w)
  g0 = jax.grad(f(_naive), argnums=(0, 1))(h, w)
  for a, b in zip(g, g0):
    # sums over positions and vocabulary: float32 steps of the largest gradient (~40 here), not of each entry; a
    # chunk boundary off by one changes gradients by O(1)
    assert_close(a, b, ulps=64)


def test_no_full_vocab_logits_in_the_program():
  B, T, D, V = 2, 64, 8, 1009
  h = jnp.ones((B, T, D))
  w = jnp.ones((D, V))
  tgt = jnp.zeros((B, T), jnp.int32)
  loss = lambda h, w: logprobs.token_logprobs(h, w, tgt, 16)[0].sum()
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).as_text()
  assert f"{B}x{T}x{V}" not in hlo and f"{B},{T},{V}" not in hlo
  naive = lambda h, w: _naive(h, w, tgt)[0].sum()
  hlo = jax.jit(jax.grad(naive, argnums=(0, 1))).lower(h, w).as_text()
  assert f"{B}x{T}x{V}" in hlo or f"{B},{T},{V}" in hlo  # the check can see full logits when they exist
