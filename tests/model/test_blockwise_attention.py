"""The blockwise (flash-style) attention kernel against the xla kernel, alone, in the model, in the sampler, and
its compiled memory (scores one block at a time, never T x S)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import rel_err

from hilore_jax import model
from hilore_jax.model import units as U
from hilore_jax.model.attention import attention_context, attention_probs, blockwise_attention
from hilore_jax.rl import sampler
from hilore_jax.rl.config import SamplingConfig

B, N, K, H = 3, 6, 2, 8
G = N // K


def _qkv(T, S, seed=0, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(kq, (B, T, N, H)).astype(dtype), jax.random.normal(kk, (B, S, K, H)).astype(dtype),
          jax.random.normal(kv, (B, S, K, H)).astype(dtype))


def _masks(T, S, pads, offset=0):
  """(key mask [B, S], the equivalent [B, T, S] mask, rows that see a key [B, T]) for left pads per row."""
  key_mask_BS = jnp.arange(S)[None] >= jnp.array(pads)[:, None]
  mask_BTS = (jnp.arange(S)[None, :] <= offset + jnp.arange(T)[:, None])[None] & key_mask_BS[:, None]
  return key_mask_BS, mask_BTS, mask_BTS.any(-1)


def _xla(q, k, v, mask_BTS):
  return attention_context(attention_probs(q, k, mask_BTS), v)


def _shapes(jaxpr) -> set[tuple[int, ...]]:
  """Shapes of every value a jaxpr computes, inside nested jaxprs (scans, conds, custom VJPs, remat) too."""
  out = set()
  for eqn in jaxpr.eqns:
    out |= {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out |= _shapes(inner)
  return out


def _has_scores(fn, args, T, S, blocks=None) -> bool:
  """Whether fn (forward and backward) computes scores [..., B, K, G, T, S] (not the [B, T, S] mask), or score blocks
  stacked over several blocks (what JAX's loop-invariant hoisting out of an enclosing scan once made of them)."""
  shapes = _shapes(jax.make_jaxpr(fn)(*args).jaxpr)
  return any((s[-2:] == (T, S) or s[-2:] == blocks and len(s) > 5) for s in shapes if len(s) >= 5)


@pytest.mark.parametrize("T,S,offset,pads,blocks", [
    pytest.param(13, 13, 0, (0, 3, 5), (8, 8), marks=pytest.mark.slow),  # remainders in both block axes
    (37, 37, 0, (0, 11, 2), (8, 16)),  # remainders in the key axis (the quick tier's self-attention case)
    pytest.param(37, 37, 0, (0, 11, 2), (128, 256), marks=pytest.mark.slow),  # the defaults: one block each way
    (5, 17, 9, (0, 4, 7), (2, 8)),  # a cache: 5 queries at slots 9..13 over 17 slots, later ones still empty
])
def test_matches_the_xla_kernel_forward_and_gradients(T, S, offset, pads, blocks):
  q, k, v = _qkv(T, S)
  key_mask_BS, mask_BTS, seen_BT = _masks(T, S, pads, offset)
  w = jax.random.normal(jax.random.PRNGKey(9), (B, T, N, H)) * seen_BT[..., None, None]  # rows that see a key
  ref = lambda q, k, v: _xla(q, k, v, mask_BTS)
  blk = lambda q, k, v: blockwise_attention(q, k, v, key_mask_BS, offset, *blocks)
  want = ref(q, k, v) * seen_BT[..., None, None]
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
  want_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
  for f in (blk, jax.jit(blk)):
    out = f(q, k, v)
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
    assert rel_err(out, want) <= 1e-5
    grads = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    for name, g, g_want in zip("qkv", grads, want_grads):
      assert rel_err(g, g_want) <= 1e-5, name
  assert not _has_scores(jax.grad(loss(blk), argnums=(0, 1, 2)), (q, k, v), T, S) or max(blocks) >= S


def test_rows_that_see_no_key_give_zeros_and_finite_gradients():
  """Left-pad queries (and a row of padding only) see no key: zeros, where the xla kernel averages every value."""
  T = 13
  q, k, v = _qkv(T, T)
  key_mask_BS, mask_BTS, seen_BT = _masks(T, T, (0, 6, T))
  blk = lambda q, k, v: blockwise_attention(q, k, v, key_mask_BS, 0, 4, 4)
  out = blk(q, k, v)
  assert np.all(np.asarray(out)[~np.asarray(seen_BT)] == 0) and not seen_BT[2].any()
  assert np.abs(np.asarray(_xla(q, k, v, mask_BTS))[~np.asarray(seen_BT)]).max() > 0.01
  grads = jax.grad(lambda *a: jnp.sum(jnp.sin(blk(*a))), argnums=(0, 1, 2))(q, k, v)
  assert all(bool(jnp.isfinite(g).all()) for g in grads)
  assert float(jnp.abs(grads[0][2]).max()) == 0.0 and float(jnp.abs(grads[2][2]).max()) == 0.0


def test_bf16_inputs_accumulate_in_float32():
  T = 37
  q, k, v = _qkv(T, T, dtype=jnp.bfloat16)
  key_mask_BS, mask_BTS, seen_BT = _masks(T, T, (0, 11, 2))
  f32 = lambda x: x.astype(jnp.float32)
  want = _xla(f32(q), f32(k), f32(v), mask_BTS) * seen_BT[..., None, None]  # the same inputs, in float32
  out = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, key_mask_BS, 0, 8, 8))(q, k, v)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, want) <= 2 ** -8  # within bf16 of the float32 reference
  # float32 sums round once, at the output: the float32 reference rounded to bf16, up to a rare tie (measured 0.0;
  # the xla kernel's bf16 probabilities and context sum are 2.5e-3 off it)
  assert rel_err(out, want.astype(jnp.bfloat16)) <= 2 ** -12
  w = jax.random.normal(jax.random.PRNGKey(9), (B, T, N, H)) * seen_BT[..., None, None]
  grads = jax.grad(lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, key_mask_BS, 0, 8, 8).astype(
      jnp.float32) * w), argnums=(0, 1, 2))(q, k, v)
  want_grads = jax.grad(lambda q, k, v: jnp.sum(_xla(q, k, v, mask_BTS) * w), argnums=(0, 1, 2))(f32(q), f32(k),
                                                                                            f32(v))
  for g, g_want in zip(grads, want_grads):
    assert g.dtype == jnp.bfloat16 and rel_err(g, g_want) <= 2 ** -7


# ----------------------------------------------------------------------------- the model and the sampler


def _cfg(tiny_cfg, attention):
  return tiny_cfg.replace(attention=attention, attention_block_q=4, attention_block_k=4)


def _batch(cfg, T=11):
  ids = jax.random.randint(jax.random.PRNGKey(5), (3, T), 2, cfg.vocab_size)
  mask = (jnp.arange(T)[None] >= jnp.array([0, 4, 7])[:, None]).astype(jnp.int32)  # left padding
  return ids, mask


def _logp_loss(cfg, params, ids, mask, policies=None):
  """Sum of next-token log-probs over real tokens, weighted per position (what GRPO's loss reads)."""
  logp = jax.nn.log_softmax(model.forward(cfg, params, ids, mask, layer_policies=policies)[:, :-1], -1)
  tok = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
  weight = mask[:, 1:] * mask[:, :-1] * jnp.linspace(0.5, 1.5, ids.shape[1] - 1)
  return jnp.sum(tok * weight)


@pytest.mark.parametrize("remat", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_model_matches_the_xla_kernel(tiny_cfg, remat):
  xla, blk = _cfg(tiny_cfg, "xla"), _cfg(tiny_cfg, "blockwise")
  params = model.init_params(xla, jax.random.PRNGKey(0), init_std=0.3)
  ids, mask = _batch(xla)
  pols = (model.FULL_REMAT if remat else model.NO_REMAT,) * xla.num_hidden_layers  # one policy: the layer scan
  real = np.asarray(mask, bool)
  want = model.forward(xla, params, ids, mask, layer_policies=pols)
  out = jax.jit(model.forward, static_argnums=0, static_argnames="layer_policies")(blk, params, ids, mask,
                                                                                  layer_policies=pols)
  assert rel_err(np.asarray(out)[real], np.asarray(want)[real]) <= 1e-5
  grad = lambda cfg: jax.jit(jax.grad(lambda p: _logp_loss(cfg, p, ids, mask, pols)))(params)
  assert rel_err(grad(blk), grad(xla)) <= 1e-5
  # remat is really on (or off): what backward keeps of each layer
  kept = {r.name for rs in model.layer_residuals(blk, params, ids, pols) for r in rs if r.name}
  assert ({U.Q, U.K, U.V} <= kept) != remat and U.ATTN_PROBS not in kept
  # the kernel really ran: no T x T tensor anywhere in forward or backward (the xla kernel has them)
  T = ids.shape[1]
  assert not _has_scores(jax.grad(lambda p: _logp_loss(blk, p, ids, mask, pols)), (params,), T, T, (4, 4))
  assert _has_scores(jax.grad(lambda p: _logp_loss(xla, p, ids, mask, pols)), (params,), T, T)


def test_the_sampler_decodes_the_same_tokens(tiny_cfg):
  xla, blk = _cfg(tiny_cfg, "xla"), _cfg(tiny_cfg, "blockwise")
  params = model.init_params(xla, jax.random.PRNGKey(3), init_std=0.4)
  ids = jnp.array([[3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 0, 10, 11, 12], [0, 0, 13, 14, 15, 16, 17]])
  mask = (ids > 0).astype(jnp.int32)
  sc = SamplingConfig(max_new_tokens=9, greedy=True)
  gen = lambda cfg: sampler.generate(cfg, params, ids, mask, jax.random.PRNGKey(0), sc, stop_ids=1, pad_id=0)
  want, out = gen(xla), gen(blk)
  np.testing.assert_array_equal(out["tokens"], want["tokens"])
  np.testing.assert_array_equal(out["mask"], want["mask"])
  assert rel_err(out["logprobs"], want["logprobs"]) <= 1e-5
  # the prefill's [B, K, G, P-1, P] scores (it fills a prompt-length cache) are blocks under blockwise (the decode
  # steps attend over the filled cache chunks whatever the kernel: model.decode_step)
  P = S = ids.shape[1]
  keys = jax.random.split(jax.random.PRNGKey(0), ids.shape[0])
  trace = lambda cfg: jax.make_jaxpr(lambda p: sampler.start(cfg, sc, sampler.decode_params(cfg, p), ids, mask, keys,
                                                             jnp.array([1]), 1, P + 9))
  has = lambda cfg: any(s[-2:] == (P - 1, S) for s in _shapes(trace(cfg)(params).jaxpr) if len(s) == 5)
  assert has(xla) and not has(blk)


# ----------------------------------------------------------------------------- memory


def test_compiled_memory_grows_with_t_not_t_squared():
  """Forward + backward of one attention call at T = S = 1024: the xla kernel's temp holds T x S float32 score
  tensors, the blockwise kernel's stays well under one."""
  B1, T, N4, K2, H16 = 1, 1024, 4, 2, 16
  q = jax.ShapeDtypeStruct((B1, T, N4, H16), jnp.float32)
  kv = jax.ShapeDtypeStruct((B1, T, K2, H16), jnp.float32)
  km = jax.ShapeDtypeStruct((B1, T), jnp.bool_)
  score_bytes = B1 * N4 * T * T * 4  # one [B, K, G, T, S] float32 tensor: 16 MiB
  causal = lambda km: jnp.tril(jnp.ones((T, T), bool))[None] & km[:, None, :]
  kernels = {"xla": lambda q, k, v, km: _xla(q, k, v, causal(km)),
             "blockwise": lambda q, k, v, km: blockwise_attention(q, k, v, km)}
  temp = {}
  for name, f in kernels.items():
    g = jax.jit(jax.grad(lambda q, k, v, km, f=f: jnp.sum(f(q, k, v, km) ** 2), argnums=(0, 1, 2)))
    temp[name] = g.lower(q, kv, kv, km).compile().memory_analysis().temp_size_in_bytes
  assert temp["xla"] > score_bytes, temp
  assert temp["blockwise"] < score_bytes / 4, temp  # measured 2.8 MiB: blocks, q/k/v/out copies, dq partials


def test_the_model_never_builds_a_t_by_t_mask_or_scores(tiny_cfg):
  """The decoder still builds the [B, T, S] mask for the other kernels; under blockwise it is dead code."""
  T = 1024
  ids = jnp.ones((1, T), jnp.int32)
  pols = (model.FULL_REMAT,) * tiny_cfg.num_hidden_layers

  def compiled(attention):
    cfg = tiny_cfg.replace(attention=attention, attention_block_q=32, attention_block_k=32)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    g = jax.jit(jax.grad(lambda p: jnp.sum(model.forward(cfg, p, ids, layer_policies=pols) ** 2)))
    return g.lower(params).compile()

  xla, blk = compiled("xla"), compiled("blockwise")
  assert f"pred[1,{T},{T}]" in xla.as_text() and f"pred[1,{T},{T}]" not in blk.as_text()
  G2 = tiny_cfg.num_attention_heads
  assert xla.memory_analysis().temp_size_in_bytes > G2 * T * T * 4  # one layer's float32 scores
  # measured 2.6 MB at T = 1024 (activations, logits, blocks), 1.3 MB at 512: linear; XLA's was 70 MB
  assert blk.memory_analysis().temp_size_in_bytes < G2 * T * T * 4 / 4


def test_the_units_table_has_no_probabilities_under_blockwise():
  assert U.fused("blockwise") and U.fused("dot_product_attention") and not U.fused("xla")
  rows = {t.name: t for t in U.table("blockwise")}
  assert U.ATTN_PROBS not in rows and rows[U.ATTN_CTX].producer == U.FUSED_ATTN
  assert rows[U.ATTN_CTX].reads == (U.Q, U.K, U.V)
