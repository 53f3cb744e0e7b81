"""The layer and the memory profile share one definition of the math: the producer ops of model/ops.py."""

import jax
import jax.numpy as jnp
import pytest
from jaxpr_util import reduce_sums

from hilore_jax import model
from hilore_jax.model import lora, ops
from hilore_jax.model import units as U
from hilore_jax.model.config import LoraSpec


def _layer_from_ops(cfg, p, x, ctx):
  """The layer as the profile's ops alone, each producer once in the table's order (exact reads)."""
  t = {U.LAYER_INPUT: x}
  for row in U.table(cfg.attention):
    if row.producer is not None:  # an op making two rows (o_proj, act) returns the later one, the one read after
      t[row.name] = model.OPS[row.producer](cfg, p, t, ctx)
  return t[U.MLP_INPUT] + t[U.MLP_OUT]


@pytest.mark.parametrize("attention,lora_spec", [("xla", None), ("dot_product_attention", None),
                                                 ("blockwise", None), ("xla", LoraSpec(rank=3, alpha=6.0))])
def test_a_layer_built_from_the_profile_ops_is_the_layer(tiny_cfg, attention, lora_spec):
  cfg = tiny_cfg.replace(attention=attention, attention_block_q=3, attention_block_k=2, lora=lora_spec,
                         o_proj_bias=True, mlp_bias=True)
  params = model.init_params(cfg.replace(num_hidden_layers=1), jax.random.PRNGKey(0), init_std=0.3)
  p = model.layer_params(params, 0)
  if lora_spec is not None:  # B starts at zero: give the adapters an output to check
    p = {**p, lora.KEY: jax.tree.map(lambda a: a + 0.1, p[lora.KEY])}
  B, T = 2, 5
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, cfg.hidden_size))
  ctx = model.layer_ctx(cfg, jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.array([[0, 1, 1, 1, 1], [1] * 5]))
  layer = jax.jit(lambda p, x: model.decoder_layer(cfg, p, x, ctx)[0])(p, x)
  built = jax.jit(lambda p, x: _layer_from_ops(cfg, p, x, ctx))(p, x)
  assert jnp.array_equal(layer, built)  # bit for bit: the same functions, not a second copy of the math
  # the same holds where the mode keeps units as L codes (forward values are exact; only backward reads codes)
  lowp = model.LayerPolicy(remat=False, lowp=U.LOWP_UNITS, group_size=8)
  coded = jax.jit(lambda p, x: model.decoder_layer(cfg, p, x, ctx, model.Train(lowp))[0])(p, x)
  assert jnp.array_equal(coded, built)


def test_the_profile_op_list_is_what_the_layer_runs():
  layer_ops = [fn for _, fn in ops.BEFORE_ATTENTION + ops.AFTER_ATTENTION] + [ops.scores, ops.pv, ops.attn]
  assert set(model.OPS.values()) == set(layer_ops) | {ops.lora_a}  # LoRA's x A: computed inside its projections
  assert all(model.OPS[fn.__name__] is fn for fn in layer_ops)
  # every op makes the table row it is listed with
  assert all(U.BY_NAME[name].producer == fn.__name__ for name, fn in ops.BEFORE_ATTENTION + ops.AFTER_ATTENTION)
  assert ops.WEIGHT_READS == {
      U.ATTN_NORM: ("attn", ("wq_DNH", "wk_DKH", "wv_DKH")), U.ATTN_CTX: ("attn", ("wo_NHD",)),
      U.MLP_NORM: ("mlp", ("wgate_DF", "wup_DF")), U.MLP_DOWN_IN: ("mlp", ("wdown_FD",))}


def test_layer_modes_return_what_they_say(tiny_cfg):
  cfg = tiny_cfg.replace(num_hidden_layers=1)
  p = model.layer_params(model.init_params(cfg, jax.random.PRNGKey(0)), 0)
  B, T, S = 2, 3, 8
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, cfg.hidden_size))
  ctx = model.layer_ctx(cfg, jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), bool))
  y, (k, v) = model.decoder_layer(cfg, p, x, ctx)
  assert k.shape == v.shape == (B, T, cfg.num_key_value_heads, cfg.head_size)
  y_taps, taps = model.decoder_layer(cfg, p, x, ctx, model.Taps())
  assert jnp.array_equal(y, y_taps) and set(taps) == set(U.UNITS) and jnp.array_equal(taps[U.K], k)
  assert taps[U.ATTN_PROBS].shape[:2] == (B, T)  # token-major
  cache = (jnp.zeros((B, S, cfg.num_key_value_heads, cfg.head_size)),) * 2
  ctx_c = model.layer_ctx(cfg, jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, S), bool).at[:, T:].set(False))
  y_c, (ck, cv) = model.decoder_layer(cfg, p, x, ctx_c, model.Prefill(cache, 0))
  assert jnp.allclose(y_c, y, atol=1e-6) and jnp.array_equal(ck[:, :T], k) and not jnp.any(ck[:, T:])


@pytest.mark.parametrize("with_bias", [False, True])
def test_norm_and_bias_gradients_reduce_over_positions_as_one_axis(with_bias):
  # by hand: x = [3, 4] -> mean square 12.5, y = x / sqrt(12.5 + eps); weight (2, 0.5)
  x = jnp.array([[[3.0, 4.0]]])
  got = ops.rms_norm(x, jnp.array([2.0, 0.5]), 0.0)
  assert jnp.allclose(got, jnp.array([[[6.0, 2.0]]]) / jnp.sqrt(12.5))
  # a packed buffer [1, L, D]: the weight's (and a bias's) gradient sums [positions, D] over its leading axis, never
  # a middle axis of three (XLA:CPU's reduction there cost the packed update ~4%, issue 45)
  x_1LD = jax.random.normal(jax.random.PRNGKey(0), (1, 7, 5))
  if with_bias:
    fn = lambda b: jnp.sum(ops._proj(x_1LD, jnp.ones((5, 3, 2)), b, "btd,dnh->btnh") ** 2)
    arg = jnp.ones((3, 2))
  else:
    fn = lambda w: jnp.sum(ops.rms_norm(x_1LD, w, 1e-6) ** 2)
    arg = jnp.ones(5)
  sums = reduce_sums(jax.make_jaxpr(jax.grad(fn))(arg).jaxpr)
  kept = lambda shape, axes: tuple(n for i, n in enumerate(shape) if i not in axes)
  to_grad = [(shape, axes) for shape, axes in sums if 7 in shape and kept(shape, axes) == arg.shape]
  assert to_grad == [((7, *arg.shape), (0,))], sums
