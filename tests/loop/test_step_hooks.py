"""The memory manager's hooks of this trainer (hilore_jax/loop/step_hooks.py): the instrumented backward's error
channels under LoRA, where a weight-read unit's int8 error reaches the update through the adapters' A gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hilore_jax import model
from hilore_jax.capacity import synthetic
from hilore_jax.loop import step_hooks
from hilore_jax.memory import calibration
from hilore_jax.model import codec, decoder, lora, lowp, ops
from hilore_jax.model import units as U
from hilore_jax.model.config import LoraSpec
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig

GROUP = 8  # code groups of 8: D 24 and F 37 split into several, the last of F's partial


def _lora_params(cfg, seed=0):
  """cfg's params with every adapter's B moved off zero (at B = 0 no A has a gradient, so no error to see)."""
  p = model.init_params(cfg, jax.random.PRNGKey(seed), init_std=0.3)
  keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 8 * cfg.num_hidden_layers))
  moved = lambda ad: {"A": ad["A"], "B": 0.3 * jax.random.normal(next(keys), ad["B"].shape)}
  return {**p, "layers": [{**layer, lora.KEY: {t: moved(ad) for t, ad in layer[lora.KEY].items()}}
                          for layer in p["layers"]]}


def test_a_lora_channel_is_the_a_gradients_error_by_hand(tiny_cfg):
  # y_t = x W_t + s (x A_t) B_t for q, k, v on one input x [B, T, D]: the A gradient reads x as dA_t = x^T du_t with
  # du_t = s dy_t B_t^T, so x's int8 round trip (e = decoded - x) adds e^T du_t to it, and nothing to W_t (frozen)
  cfg = tiny_cfg.replace(lora=LoraSpec(3, 5.0, ("q", "v", "down")))  # k: no adapter, so no channel
  layer = _lora_params(cfg)["layers"][0]
  x = jax.random.normal(jax.random.PRNGKey(7), (2, 5, cfg.hidden_size))
  dy = {t: jax.random.normal(jax.random.PRNGKey(i), (2, 5, n, cfg.head_size))
        for i, (t, n) in enumerate((("q", 4), ("k", 2), ("v", 2)))}
  keep = lowp.Keep(U.ATTN_NORM, "int8", GROUP, cfg.hidden_size, "float32", probe=True)
  zeros = tuple(jnp.zeros(layer[lora.KEY][t]["A"].shape) for t in ("q", "v"))

  def loss(adapters, channels):
    p = {**layer, lora.KEY: adapters}
    ys = ops.projections(cfg, p, x, ("q", "k", "v"), (keep, (jnp.float32(0.0), channels)))
    return sum(jnp.sum(y * dy[t]) for y, t in zip(ys, ("q", "k", "v")))

  g, ch = jax.grad(loss, argnums=(0, 1))(layer[lora.KEY], zeros)
  x_np = np.asarray(x, np.float64)
  e = np.asarray(codec.decode(*codec.encode(x, "int8", GROUP), x.shape, jnp.float32), np.float64) - x_np
  s = cfg.lora.scale
  for t, c in zip(("q", "v"), ch):
    du = s * np.einsum("btnh,rnh->btr", np.asarray(dy[t], np.float64), np.asarray(layer[lora.KEY][t]["B"]))
    np.testing.assert_allclose(g[t]["A"], np.einsum("btd,btr->dr", x_np, du), rtol=1e-5, atol=1e-5)  # mix 0: exact
    np.testing.assert_allclose(c, np.einsum("btd,btr->dr", e, du), rtol=1e-4, atol=1e-6)
    assert np.abs(np.asarray(c)).max() > 1e-4  # an error to see


def _spec(cfg, microbatches=1):
  return train_step.StepSpec(cfg, GRPOConfig(beta=0.02), model.uniform(cfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True, use_ref_logp=True, microbatches=microbatches)


# the quick tier checks one channel by hand (above); this runs every target, then a split minibatch, in the full run
@pytest.mark.slow
@pytest.mark.parametrize("targets,microbatches", [(model.config.LORA_TARGETS, 1), (("k", "o", "down"), 2)])
def test_lora_error_channels_are_each_units_own_probe_against_the_exact_gradient(tiny_cfg, targets, microbatches):
  # the slow way, one unit at a time: the adapters' gradient with only that unit read from its int8 code, against
  # the exact one (the same probe program at zero mix), over every trained leaf; the instrumented backward gives
  # every unit's norm of that difference at once. A kind no adapter reads (mlp_norm without gate or up) is 0
  # exactly. Calibration then takes the LoRA units' errors from the channels, with no probe run
  cfg = tiny_cfg.replace(lora=LoraSpec(3, 5.0, targets))
  p = _lora_params(cfg)
  hooks = step_hooks.memory_hooks(None, _spec(cfg, microbatches), max_grad_norm=1e-3)
  batch = synthetic.grpo_batch(cfg, p, np.random.default_rng(6), 8, 5, 7, group=4, zero_adv_frac=0.25)
  g, dg = hooks.probe_errors(p, batch, "int8", GROUP)
  kinds, L = list(decoder.WEIGHT_READS), cfg.num_hidden_layers
  units = calibration.lowp_units(L, tuple(kinds))
  exact = hooks.probe_gradient(p, batch, calibration.probe_mix(L, units, []), "int8", GROUP)
  assert jax.tree.structure(g) == jax.tree.structure(exact) == jax.tree.structure(lora.trainable(p))
  np.testing.assert_allclose(np.concatenate([np.ravel(a) for a in jax.tree.leaves(g)]),
                             np.concatenate([np.ravel(a) for a in jax.tree.leaves(exact)]), rtol=1e-5, atol=1e-7)
  slow = np.zeros((L, len(kinds)))
  for i, (layer, kind) in enumerate(units):
    g_u = hooks.probe_gradient(p, batch, calibration.probe_mix(L, units, [i]), "int8", GROUP)
    slow[layer, kinds.index(kind)] = np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64) - np.asarray(b)))
                                                 for a, b in zip(jax.tree.leaves(g_u), jax.tree.leaves(exact))))
  read = [k for k, paths in decoder.weight_read_leaves(cfg).items() if paths]
  cols = [kinds.index(k) for k in read]
  assert np.all(slow[:, cols] > 1e-4 * float(calibration.norm(exact)))  # every read unit's error is seen
  np.testing.assert_allclose(dg[:, cols], slow[:, cols], rtol=2e-4)
  unread = [j for j in range(len(kinds)) if j not in cols]
  assert set(unread) == ({kinds.index(U.MLP_NORM)} if targets != model.config.LORA_TARGETS else set())
  assert np.all(np.asarray(dg)[:, unread] == 0.0) and np.all(slow[:, unread] == 0.0)
  # calibration's units through the channels: no probe, each unit's error the slow way's over ||g|| (relative)
  calls = []
  probe = hooks.probe_gradient
  hooks = dataclasses.replace(hooks, probe_gradient=lambda *a: calls.append(1) or probe(*a))
  ref = calibration.reference(hooks, calibration.UpdateContext(p), batch, "relative", group_size=GROUP,
                              weight_errors=True)
  got = calibration.decomposed_unit_errors(hooks, p, batch, units, GROUP, exact=ref)
  assert not calls
  np.testing.assert_allclose(got, [slow[layer, kinds.index(k)] / ref.grad_norm for layer, k in units], rtol=2e-4)
