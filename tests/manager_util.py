"""A tiny decoder's memory hooks and batches with given advantages: what the memory manager's tests share."""

import builders
import jax
import numpy as np
import optax

from hilore_jax import model, sharding
from hilore_jax.loop import engine, step_hooks
from hilore_jax.rl import train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import UpdateBatch

CFG = builders.tiny_model(tie_word_embeddings=False)
P, N = 5, 7


def batch(rng, adv_B) -> UpdateBatch:
  """len(adv_B) rows of random prompts and completions (3..N tokens), old log-probs -3."""
  B = len(adv_B)
  mask = (np.arange(N)[None] < rng.integers(3, N + 1, B)[:, None]).astype(np.int32)
  return UpdateBatch(rng.integers(3, 31, (B, P)).astype(np.int32), np.ones((B, P), np.int32),
                     (rng.integers(3, 31, (B, N)) * mask).astype(np.int32), mask, np.asarray(adv_B, np.float32),
                     old_logp=np.full((B, N), -3.0, np.float32) * mask)


def hooks(*clip):
  """(StepHooks of CFG's no-remat off-policy step on one device, its params); clip: the hooks' clip norm c."""
  params = model.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)
  mesh = sharding.make_mesh(1, 1)
  opt = optax.sgd(1e-3)
  state, sh = engine.init_state(mesh, opt, jax.eval_shape(lambda: params), lambda s: jax.device_put(params, s))
  spec = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(2, model.NO_REMAT), use_old_logp=True)
  return step_hooks.memory_hooks(engine.Stepper(mesh, opt, state, sh), spec, *clip), params
