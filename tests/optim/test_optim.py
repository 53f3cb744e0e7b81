"""optimizer.kind / optimizer.logra / optimizer.kl_control: config checks, the optax chain, sharded state, and a
LoGRA run with KL control that resumes exactly across a refresh."""

import builders
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from hilore_jax import cli, model, optim, sharding
from hilore_jax.loop import engine
from hilore_jax.optim import logra
from hilore_jax.optim.config import LograConfig, OptimizerConfig

CFG = builders.tiny_model(tie_word_embeddings=False)


def test_config_keys():
  c = cli.load_config(None, ["optimizer.kind=logra", "optimizer.logra.rank=4", "optimizer.logra.refresh_every=3",
                             "optimizer.logra.scale=0.25", "optimizer.kl_control.target=0.002"])
  oc = c.optimizer
  assert (oc.kind, oc.logra.rank, oc.logra.refresh_every, oc.logra.scale) == ("logra", 4, 3, 0.25)
  assert (oc.kl_control.target, oc.kl_control.chunk) == (0.002, 128)
  assert cli.load_config(None, []).optimizer.kind == "adamw" and c.to_dict()["optimizer"]["logra"]["rank"] == 4


@pytest.mark.parametrize("override,message", [
    ("optimizer.kind=sgd", r"optimizer.kind must be one of \['adamw', 'logra'\]"),
    ("optimizer.logra.rank=0", r"optimizer.logra.rank must be > 0"),
    ("optimizer.logra.refresh_every=0", r"optimizer.logra.refresh_every must be > 0"),
    ("optimizer.logra.oversample=-1", r"optimizer.logra.oversample must be >= 0"),
    ("optimizer.logra.scale=0", r"optimizer.logra.scale must be > 0"),
    ("optimizer.logra.rnk=4", r"unknown config key 'optimizer.logra.rnk'; valid keys here: \[.*'rank'"),
    ("optimizer.kl_control.target=-0.1", r"optimizer.kl_control.target must be >= 0"),
    ("optimizer.kl_control.chunk=0", r"optimizer.kl_control.chunk must be > 0"),
])
def test_bad_values_name_the_key(override, message):
  with pytest.raises(ValueError, match=message):
    cli.load_config(None, [override])


def _grads_and_params():
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: model.init_params(CFG, jax.random.PRNGKey(0)))
  draw = lambda s: (rng.standard_normal(s.shape)).astype(np.float32)
  return jax.tree.map(draw, shapes), jax.tree.map(draw, shapes)


@pytest.mark.slow
def test_logra_chain_is_adamw_on_dense_leaves_and_low_rank_on_matrices():
  """Same schedule, betas, clipping and weight decay: LoGRA's dense leaves (norms, biases, embed, lm head) update
  exactly as AdamW's; its matrices' updates lie in rank-r column spaces."""
  kw = dict(lr=3e-3, warmup_steps=1, weight_decay=0.1, b1=0.8, max_grad_norm=0.5)  # lr: 0, then 3e-3
  adamw = optim.make_optimizer(OptimizerConfig(**kw), 10)
  ours = optim.make_optimizer(OptimizerConfig(kind="logra", logra=LograConfig(rank=3), **kw), 10)
  params, grads = _grads_and_params()

  def second_update(tx):
    update, state = jax.jit(tx.update), tx.init(params)
    state = update(jax.tree.map(lambda g: -g, grads), state, params)[1]
    return jax.device_get(update(grads, state, params)[0])

  ua, ub = second_update(adamw), second_update(ours)
  decay = 3e-3 * 0.1  # lr * weight_decay at the second update: full rank, on every leaf
  for (path, a), b, w in zip(jax.tree_util.tree_flatten_with_path(ua)[0], jax.tree.leaves(ub), jax.tree.leaves(params)):
    name = logra.leaf_name(path)
    if a.ndim < 2 or name in optim.DENSE_NAMES:
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-9, err_msg=name)
    else:  # without the decay a matrix view [M, N] of rank 3 (the sketch), where AdamW's is full rank
      a, b = a + decay * w, b + decay * w
      m = b.reshape(b.shape[0], -1) if name != "wo_NHD" else b.reshape(-1, b.shape[-1])
      s = np.linalg.svd(m, compute_uv=False)
      assert s[3] < 1e-5 * s[0] and np.linalg.svd(a.reshape(m.shape), compute_uv=False)[3] > 0.1 * s[0], name
  bq = ua["layers"][0]["attn"]["bq_NH"]
  assert bq.shape == (4, 6) and "bq_NH" in optim.DENSE_NAMES  # 2-D by shape, a bias by name: dense


def test_state_shardings_follow_the_state():
  """Dense moments take their param's spec; sketched moments and P are replicated (tree_map_params cannot map a
  LoGRA state: its init needs real shapes)."""
  mesh = sharding.make_mesh()
  params, _ = _grads_and_params()
  tx = optim.make_optimizer(OptimizerConfig(kind="logra"), 10)
  state, sh = engine.init_state(mesh, tx, jax.eval_shape(lambda: params), lambda s: jax.device_put(params, s))
  st, st_sh = logra.find_state(state["opt_state"]), logra.find_state(sh["opt_state"])
  assert st_sh.mu["embed_VD"].spec == P(sharding.FSDP, None) == sh["params"]["embed_VD"].spec
  assert st_sh.mu["layers"][0]["mlp"]["wup_DF"].spec == P() and st_sh.proj["layers"][0]["mlp"]["wup_DF"].spec == P()
  assert st_sh.proj["embed_VD"] is None and st.proj["embed_VD"] is None
  for x, s in zip(jax.tree.leaves(state["opt_state"]), jax.tree.leaves(sh["opt_state"])):
    assert x.sharding == s
  with pytest.raises(Exception):  # noqa: B017  why engine maps LoGRA's state itself
    optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params), sh["params"])


