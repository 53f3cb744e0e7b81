"""What the token budget's tests share: a stepper, and the check that packed microbatches give the unpacked
minibatch's loss, metrics, gradient and log-probs."""

import jax
import numpy as np
import optax

from hilore_jax import model, sharding
from hilore_jax.loop import engine
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig


def rel(a, b) -> float:
  """max |a - b| / max |b|."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def stepper(params, with_state: bool = False):
  """A one-device Stepper holding params (SGD); with_state: (the Stepper, its state)."""
  mesh, opt = sharding.make_mesh(), optax.sgd(0.1)
  state, shardings = engine.init_state(mesh, opt, jax.eval_shape(lambda: params), lambda sh: jax.device_put(params, sh))
  st = engine.Stepper(mesh, opt, state, shardings)
  return (st, state) if with_state else st


def spec(cfg, loss_agg: str, N: int) -> train_step.StepSpec:
  """A full-remat off-policy step with a reference (beta 0.05) under loss_agg."""
  lc = GRPOConfig(loss_agg=loss_agg, max_completion_len=N, beta=0.05)
  return train_step.StepSpec(cfg, lc, model.uniform(cfg.num_hidden_layers, model.FULL_REMAT), use_old_logp=True,
                             use_ref_logp=True)


def assert_packed_equals_unpacked(params, batch, packed_batch, micros, spec) -> dict:
  """The packed gradient over micros (of packed_batch) equals batch's unpacked one to 1e-5; its metrics."""
  want_g, want_m = jax.jit(lambda p, b: train_step.gradient_step(p, b, spec))(params, batch)
  run = jax.jit(lambda p, b, i, n, a, layout: train_step.packed_gradient(p, b, i, n, a, spec, layout),
                static_argnums=5)
  acc, norm = jax.jit(train_step.packed_start)(params, packed_batch)
  for m in micros:
    acc = run(params, packed_batch, m.arrays(), norm, acc, m.layout)
  grads, stats, logp = acc
  got_m = train_step.step_metrics({**stats, train_step.TOKEN_LOGP: logp})
  assert rel(got_m["loss"], want_m["loss"]) <= 1e-5
  for k in ("tokens", "clipfrac", "kl", "entropy", "abs_log_ratio"):
    np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=1e-5, atol=1e-7)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g)):
    assert rel(g, w) <= 1e-5
  mask = batch.mask > 0
  np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(want_m[train_step.TOKEN_LOGP])[mask], rtol=1e-5)
  return want_m
