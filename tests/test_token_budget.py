"""The token budget (rl/token_budget.py, packed_step.py): packed microbatches give the unpacked minibatch's loss,
gradient and log-probs for every loss aggregation; every row is packed once within the budget; a run with the
budget on updates as one with it off, on fewer positions; bad values are config errors."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from trainer_util import stable, tiny_config

from hilore_jax import cli, engine, model, packed_step, sharding
from hilore_jax.errors import ConfigError
from hilore_jax.model import ModelConfig
from hilore_jax.rl import token_budget, train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import UpdateBatch

CFG = ModelConfig(vocab_size=31, hidden_size=24, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
B, P, N = 7, 5, 13
LENGTHS = np.array([13, 2, 0, 7, 1, 13, 4])  # a row of zero length: a short minibatch's padding row


def _batch(rng=np.random.default_rng(0)) -> UpdateBatch:
  mask = (np.arange(N)[None] < LENGTHS[:, None]).astype(np.int32)
  prompt_mask = (np.arange(P)[None] >= rng.integers(0, 3, B)[:, None]).astype(np.int32)  # left-padded
  return UpdateBatch((rng.integers(1, 31, (B, P)) * prompt_mask).astype(np.int32), prompt_mask,
                     (rng.integers(1, 31, (B, N)) * mask).astype(np.int32), mask,
                     rng.normal(size=B).astype(np.float32),
                     old_logp=(np.log(rng.uniform(0.02, 0.2, (B, N))) * mask).astype(np.float32),
                     on_policy=np.array([1, 0, 0, 0, 1, 0, 0], np.int32))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def test_bucket_caps_and_the_plan_keep_every_row_once_within_the_budget():
  assert token_budget.bucket_caps(5, 3) == (5, 3, 2)
  assert token_budget.bucket_caps(256, 3) == (256, 128, 64)
  assert token_budget.bucket_caps(100, 3) == (100, 56, 32)  # multiples of 8 from 64 tokens on
  assert token_budget.bucket_caps(1, 4) == (1,)
  rng = np.random.default_rng(1)
  caps = token_budget.bucket_caps(N, 3)
  for budget in (18, 40, 77, 200):
    lengths = rng.integers(0, N + 1, 41)
    micros = token_budget.plan(lengths, P, caps, budget, max_rows=41)
    real = np.concatenate([m.rows[m.live > 0] for m in micros])
    assert sorted(real.tolist()) == np.flatnonzero(lengths > 0).tolist()  # every row with a token, exactly once
    for m in micros:
      assert m.cap in caps and len(m.rows) * (P + m.cap) <= budget
      assert np.all(lengths[m.rows[m.live > 0]] <= m.cap)
    # one row count per bucket: at most len(caps) shapes
    assert len({m.shape for m in micros}) <= len(caps)
    assert len({m.shape[0] for m in micros if m.cap == caps[0]}) <= 1
  with pytest.raises(ValueError, match="holds no 2 row"):
    token_budget.plan(np.array([13]), P, caps, P + N, max_rows=4, multiple=2)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_loss_and_gradient_equal_the_unpacked_minibatch(loss_agg):
  lc = GRPOConfig(loss_agg=loss_agg, max_completion_len=N, beta=0.05)
  spec = train_step.StepSpec(CFG, lc, model.uniform(CFG.num_hidden_layers, model.FULL_REMAT), use_old_logp=True,
                             use_ref_logp=True)
  params = model.init_params(CFG, jax.random.PRNGKey(3), init_std=0.2)
  batch = _batch()
  batch = batch.replace(ref_logp=(batch.old_logp * 1.1).astype(np.float32))
  want_g, want_m = jax.jit(lambda p, b: train_step.gradient_step(p, b, spec))(params, batch)
  micros = token_budget.plan(LENGTHS, P, token_budget.bucket_caps(N, 3), budget=3 * (P + N), max_rows=B)
  assert {m.cap for m in micros} > {N}  # shorter buckets are used
  run = jax.jit(lambda p, b, r, lv, n, a, cap: train_step.packed_gradient(p, b, r, lv, n, a, spec, cap),
                static_argnums=6)
  acc, norm = jax.jit(train_step.packed_start)(params, batch)
  for m in micros:
    acc = run(params, batch, m.rows, m.live, norm, acc, m.cap)
  grads, stats, logp = acc
  got_m = train_step.step_metrics({**stats, train_step.TOKEN_LOGP: logp})
  assert _rel(got_m["loss"], want_m["loss"]) <= 1e-5
  for k in ("tokens", "clipfrac", "kl", "entropy", "abs_log_ratio"):
    np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=1e-5, atol=1e-7)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g)):
    assert _rel(g, w) <= 1e-5
  mask = batch.mask > 0
  np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(want_m[train_step.TOKEN_LOGP])[mask], rtol=1e-5)
  # the log-prob forward: the same values scattered back to the minibatch's row order
  mesh, opt = sharding.make_mesh(), optax.sgd(0.1)
  state, shardings = engine.init_state(mesh, opt, jax.eval_shape(lambda: params), lambda sh: jax.device_put(params, sh))
  st = engine.Stepper(mesh, opt, state, shardings)
  packed = packed_step.PackedStepper(st).logprobs(spec, params, batch, micros)
  np.testing.assert_allclose(np.asarray(packed)[mask], np.asarray(st.logprobs(spec, params, batch))[mask], rtol=1e-5)
