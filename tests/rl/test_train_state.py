"""The typed train state: one optimizer step on what trains (LoRA's adapters alone), the checkpoint layout the dict
state wrote, and the dict's leaf order (the compiled programs' arguments)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hilore_jax import model
from hilore_jax.model import lora
from hilore_jax.model.config import LoraSpec
from hilore_jax.rl import train_state
from hilore_jax.rl.train_state import TrainState

OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def _params(cfg, adapters: bool):
  if adapters:
    cfg = cfg.replace(lora=LoraSpec(3, 5.0, ("q", "down")))
  return model.stacked(model.init_params(cfg, jax.random.PRNGKey(0)))


def _grads_like(tree, seed=1):
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(tree))))
  return jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, jnp.float32).astype(x.dtype), tree)


def test_take_step_moves_only_what_trains_and_counts(tiny_cfg):
  params = _params(tiny_cfg, adapters=True)
  state = train_state.create(params, OPT)
  grads = _grads_like(state.trainable)

  def step(s, g):
    updates, opt_state = OPT.update(g, s.opt_state, s.trainable)
    return s.take_step(updates, opt_state)

  new = jax.jit(step)(state, grads)
  assert isinstance(new, TrainState) and int(new.step) == 1
  chex.assert_trees_all_equal(lora.base_of(new.params), lora.base_of(params))  # the frozen base, bit for bit
  # what trains: the same as optax on the adapters alone
  updates, _ = OPT.update(grads, OPT.init(lora.trainable(params)), lora.trainable(params))
  chex.assert_trees_all_close(new.trainable, optax.apply_updates(lora.trainable(params), updates), rtol=1e-6)
  assert jax.tree.structure(new.opt_state) == jax.tree.structure(OPT.init(lora.trainable(params)))


def test_checkpoint_keeps_the_dict_states_layout_and_restores_onto_the_base(tiny_cfg):
  for adapters in (False, True):
    params = _params(tiny_cfg, adapters)
    state = train_state.create(params, OPT)
    tree = state.checkpoint()
    # the layout checkpoints have always had on disk: {"params": what trains, "opt_state", "step"}
    old = {"params": lora.trainable(params), "opt_state": OPT.init(lora.trainable(params)), "step": np.int32(0)}
    paths = lambda t: [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)]
    assert paths(tree) == paths(old)
    moved = jax.tree.map(lambda x: x + 1, tree)
    back = state.restored(moved)
    chex.assert_trees_all_equal(back.trainable, moved["params"])
    if adapters:  # the base is the live state's, not the checkpoint's
      chex.assert_trees_all_equal(lora.base_of(back.params), lora.base_of(params))


def test_leaves_flatten_in_the_dict_states_order(tiny_cfg):
  params = _params(tiny_cfg, adapters=False)
  state = train_state.create(params, OPT)
  as_dict = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
  assert all(a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(as_dict), strict=True))
  assert state["params"] is state.params  # the lab's reads by key
  abstract = train_state.abstract(params, OPT)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract) == jax.tree.map(lambda x: (x.shape, x.dtype), state)
