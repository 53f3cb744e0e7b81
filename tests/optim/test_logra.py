"""LoGRA: leaf rule, range finder, full-rank equality with optax.adamw, span, exact resume, bytes."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from hilore_jax import model
from hilore_jax.model import ModelConfig
from hilore_jax.optim import logra

# Odd shapes; matrix views: wq [7, 15], wo (transposed) [7, 15], wdown (transposed) [7, 11], bq [3, 5].
SHAPES = {"wq_DNH": (7, 3, 5), "wo_NHD": (3, 5, 7), "wdown_FD": (11, 7), "bq_NH": (3, 5), "norm_D": (7,),
          "embed_VD": (13, 7)}


def _normal(seed, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _params(seed=0):
  return _normal(seed)


def _random_grads(step, names=tuple(SHAPES)):
  return _normal(1000 + step, {k: SHAPES[k] for k in names})


def _apply(params, updates):
  """optax.apply_updates in numpy (eager jnp ops would compile one program per shape)."""
  return {k: np.asarray(params[k]) + np.asarray(updates[k]) for k in params}


def _plan(name, rank):
  return logra.leaf_plan((jax.tree_util.DictKey(name),), SHAPES[name], rank)


def test_leaf_rule_and_matrix_view():
  assert logra.matrix_split((24, 4, 6)) == 1  # wq_DNH -> [D, N*H]
  assert logra.matrix_split((4, 6, 24)) == 2  # wo_NHD -> [N*H, D]
  assert logra.matrix_split((24, 2, 6)) == 1  # wk_DKH -> [D, K*H]
  p = _plan("wo_NHD", 7)
  assert (p.split, p.transpose, p.mn) == (2, True, (7, 15))
  assert _plan("wdown_FD", 7).mn == (7, 11) and _plan("wdown_FD", 7).transpose
  assert not _plan("bq_NH", 4).sketched and _plan("bq_NH", 3).sketched  # smaller side 3: dense for rank > 3
  assert not _plan("norm_D", 1).sketched and not _plan("embed_VD", 1).sketched
  assert not logra.leaf_plan((jax.tree_util.DictKey("w"),), (7, 15), 2, min_dim=8).sketched
  x = jnp.arange(105.0).reshape(3, 5, 7)
  chex.assert_trees_all_equal(logra.to_matrix(x, p), x.reshape(1, 15, 7).swapaxes(1, 2))  # one batch slot
  chex.assert_trees_all_equal(logra.from_matrix(logra.to_matrix(x, p), p), x)


@pytest.mark.slow
def test_projection_shapes_orthonormal_and_captures_low_rank_gradient():
  rank = 2
  tx = logra.logra(1e-2, rank, refresh_every=3)
  params = _params()
  state = tx.init(params)
  grads = _random_grads(0)
  # an exactly rank-2 gradient for wq: P must span its column space
  rng = np.random.default_rng(5)
  g = (rng.standard_normal((7, 2)) @ rng.standard_normal((2, 15))).astype(np.float32)
  grads["wq_DNH"] = g.reshape(7, 3, 5)
  grads["wdown_FD"] = np.zeros((11, 7), np.float32)  # a zero gradient still yields an orthonormal basis
  _, state = jax.device_get(jax.jit(tx.update)(grads, state, params))
  for name in ("wq_DNH", "wo_NHD", "wdown_FD", "bq_NH"):  # bq's smaller side 3 >= rank: sketched
    m, n = _plan(name, rank).mn
    chex.assert_shape(state.proj[name], (1, m, rank))
    chex.assert_shape((state.mu[name], state.nu[name]), (1, rank, n))
    np.testing.assert_allclose(state.proj[name][0].T @ state.proj[name][0], np.eye(rank), atol=1e-5)
  for name in ("norm_D", "embed_VD"):
    assert state.proj[name] is None
    chex.assert_shape((state.mu[name], state.nu[name]), SHAPES[name])
  proj = state.proj["wq_DNH"][0]
  np.testing.assert_allclose(proj @ (proj.T @ g), g, atol=1e-4)


def _structured(rng, name, rank):
  """A gradient whose [M, N] view has orthogonal rows of distinct, shuffled norms: left singular vectors = axes."""
  p = _plan(name, rank)
  m, n = p.mn
  v_NM = np.linalg.qr(rng.standard_normal((n, m)))[0]
  s = rng.permutation(np.arange(1.0, m + 1.0))
  g_MN = (s[:, None] * v_NM.T).astype(np.float32)
  return (g_MN.T if p.transpose else g_MN).reshape(p.shape)


@pytest.mark.slow
def test_full_rank_equals_adamw_across_refreshes():
  """r = M: P is a signed permutation of the axes, so LoGRA must be AdamW exactly, moments carried through refreshes.

  The norms' order is reshuffled at every refresh, so P changes and un-rotated (or reset) moments would differ;
  between refreshes the gradients are arbitrary.
  """
  rank, steps = 7, 6
  lr = optax.linear_schedule(1e-2, 4e-3, steps)
  kw = dict(b1=0.8, b2=0.95, eps=1e-8, weight_decay=0.1)
  ours, ref = logra.logra(lr, rank, refresh_every=2, **kw), optax.adamw(lr, **kw)
  rng = np.random.default_rng(0)
  p_ours = p_ref = _params()
  s_ours, s_ref = ours.init(p_ours), ref.init(p_ref)
  ours_update, ref_update = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(steps):
    grads = _random_grads(step)
    if step % 2 == 0:
      grads.update({k: _structured(rng, k, rank) for k in ("wq_DNH", "wo_NHD", "wdown_FD")})
    u_ours, s_ours = ours_update(grads, s_ours, p_ours)
    u_ref, s_ref = ref_update(grads, s_ref, p_ref)
    chex.assert_trees_all_close(jax.device_get(u_ours), jax.device_get(u_ref), atol=2e-6, rtol=1e-4)
    p_ours, p_ref = _apply(p_ours, u_ours), _apply(p_ref, u_ref)
  assert all(s_ours.proj[k] is not None for k in ("wq_DNH", "wo_NHD", "wdown_FD"))
  chex.assert_trees_all_close(p_ours, p_ref, atol=1e-5)


@pytest.mark.slow
def test_low_rank_update_lies_in_span_of_projection():
  rank, scale = 2, 0.5
  tx = logra.logra(3e-2, rank, refresh_every=3, scale=scale)
  params = _params()
  state, update = tx.init(params), jax.jit(tx.update)
  for step in range(4):  # refresh at 0 and 3; check every step
    updates, state = jax.device_get(update(_random_grads(step), state, params))
    for name in ("wq_DNH", "wo_NHD", "wdown_FD"):
      plan, proj = _plan(name, rank), state.proj[name][0]
      u_MN = updates[name].reshape(-1, int(np.prod(plan.shape[plan.split:])))
      u_MN = u_MN.T if plan.transpose else u_MN
      assert np.linalg.norm(u_MN) > 1e-3
      np.testing.assert_allclose(proj @ (proj.T @ u_MN), u_MN, atol=1e-6)
    if step == 0:  # dense leaves: the first Adam step is -lr * sign(g)
      np.testing.assert_allclose(updates["norm_D"], -3e-2 * np.sign(_random_grads(0)["norm_D"]), rtol=1e-5)


def _run(update, params, state, steps):
  for step in steps:
    updates, state = update(_random_grads(step), state, params)
    params = _apply(params, updates)
  return params, jax.device_get(state)


@pytest.mark.slow
def test_exact_resume_through_host_numpy_and_orbax(tmp_path):
  tx = logra.logra(1e-2, 2, refresh_every=2, weight_decay=0.05, seed=3)  # refreshes at 0, 2 | 4
  params, update = _params(), jax.jit(tx.update)
  straight = _run(update, params, tx.init(params), range(6))
  half = _run(update, params, tx.init(params), range(3))
  host = jax.tree.map(jnp.asarray, half)  # _run hands the state back through jax.device_get
  chex.assert_trees_all_equal(_run(update, *host, range(3, 6)), straight)
  ckpt = ocp.StandardCheckpointer()
  path = os.path.join(tmp_path, "half")
  ckpt.save(path, host)
  ckpt.wait_until_finished()
  restored = ckpt.restore(path, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                              host))
  assert isinstance(restored[1], logra.LograState)
  chex.assert_trees_all_equal(restored, host)  # bitwise, None leaves and LograState included: resumes as above


def test_composes_with_clipping_and_schedule():
  sched = optax.cosine_decay_schedule(2e-2, 4)
  max_norm = 0.5
  chained = optax.chain(optax.clip_by_global_norm(max_norm), logra.logra(sched, 2, refresh_every=2, weight_decay=0.1))
  unit = logra.logra(1.0, 2, refresh_every=2, weight_decay=0.1)
  names = ("wq_DNH", "norm_D")  # one sketched and one dense leaf keep the two compilations short
  params = {k: v for k, v in _params().items() if k in names}
  s_chain, s_unit = chained.init(params), unit.init(params)
  chain_update, unit_update = jax.jit(chained.update), jax.jit(unit.update)
  for step in range(4):
    grads = _random_grads(step, names)
    norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in grads.values()))
    assert norm > max_norm  # clipping is active
    clipped = {k: (g * (max_norm / norm)).astype(np.float32) for k, g in grads.items()}
    u_chain, s_chain = chain_update(grads, s_chain, params)
    u_unit, s_unit = unit_update(clipped, s_unit, params)
    # the same moments: lr only scales the update, so the scheduled update is sched(step) times the lr=1 one
    lr = float(sched(step))
    chex.assert_trees_all_close(jax.device_get(u_chain), {k: lr * np.asarray(u) for k, u in u_unit.items()},
                                atol=1e-6)
    params = _apply(params, u_chain)
  assert logra.find_state(s_chain).count == 4


def test_state_and_sketch_bytes_far_below_adam():
  cfg = ModelConfig(vocab_size=31, hidden_size=48, intermediate_size=101, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False)
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.PRNGKey(0)))
  rank = cfg.hidden_size // 8
  tx = optax.chain(optax.clip_by_global_norm(1.0), logra.logra(1e-3, rank, refresh_every=10))
  state = jax.eval_shape(tx.init, params)
  # per layer, [M, N] views: wq, wo [48, 48]; wk, wv [24, 48]; wgate, wup, wdown [48, 101]; biases stay dense
  mats = 2 * ([(48, 48)] * 2 + [(24, 48)] * 2 + [(48, 101)] * 3)
  ours = sum(4 * (2 * rank * n + m * rank) for m, n in mats)
  adam = sum(4 * 2 * m * n for m, n in mats)
  got = logra.state_bytes(state)
  assert got["logra/sketched_bytes"] == ours and got["logra/sketched_adam_bytes"] == adam
  total_elems = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  dense_elems = total_elems - sum(m * n for m, n in mats)
  assert got["logra/dense_bytes"] == 4 * 2 * dense_elems
  assert ours / adam == pytest.approx(7668 / 42912) and ours / adam < 0.25
  sk = logra.sketch_bytes(state, itemsize=2)
  assert sk["logra/sketch_bytes"] == 2 * (sum((m + n) * rank for m, n in mats) + dense_elems)
  assert sk["logra/factor_bytes"] == 2 * (sum(n * rank for _, n in mats) + dense_elems)
  assert sk["logra/update_bytes"] == 2 * total_elems


def test_stacked_layers_get_one_projection_each():
  """A stacked layer axis named as a batch axis: each layer's matrix is sketched on its own."""
  rng = np.random.default_rng(3)
  L, D, F, rank = 3, 7, 13, 2
  params = {"layers": {"mlp": {"wup_DF": jnp.zeros((L, D, F))}}, "embed_VD": jnp.zeros((5, D))}
  stacked = lambda path: int(getattr(path[0], "key", None) == "layers")
  tx = logra.logra(1e-2, rank, refresh_every=5, batch_axes=stacked)
  state = tx.init(params)
  chex.assert_shape(logra.find_state(state).proj["layers"]["mlp"]["wup_DF"], (L, D, rank))
  # each layer's gradient has its own rank-2 column space
  g = np.stack([rng.standard_normal((D, 2)) @ rng.standard_normal((2, F)) for _ in range(L)]).astype(np.float32)
  grads = {"layers": {"mlp": {"wup_DF": g}}, "embed_VD": np.ones((5, D), np.float32)}
  updates, state = jax.device_get(jax.jit(tx.update)(grads, state, params))
  proj = state.proj["layers"]["mlp"]["wup_DF"]
  for layer in range(L):
    p = proj[layer]
    np.testing.assert_allclose(p @ (p.T @ g[layer]), g[layer], atol=1e-4)  # its own span, not a shared one
    u = updates["layers"]["mlp"]["wup_DF"][layer]
    np.testing.assert_allclose(p @ (p.T @ u), u, atol=1e-6)
  assert np.abs(proj[0].T @ proj[1]).max() < 0.99  # different layers, different subspaces
