"""Several updates per rollout: later ones see the sampling policy's log-probs (old_logp), the first one is
on-policy without an extra forward, and training log-probs are under the sampling temperature."""

import dataclasses

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_util import tiny_config

from hilore_jax import model
from hilore_jax.loop import update_plan
from hilore_jax.rl import grpo, rollout, train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import UpdateBatch
from hilore_jax.loop.trainer import Trainer

CFG = builders.tiny_model()
B, P, N = 6, 5, 7


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  return builders.update_batch(rng, P, N, 31, rng.integers(2, N + 1, B), adv_B=[1.0, -0.5, 2.0, 1.5, 0.5, 1.0])


def _params(seed):
  return jax.jit(model.init_params, static_argnums=(0, 2))(CFG, jax.random.PRNGKey(seed), 0.3)


@pytest.mark.slow
def test_on_policy_rows_ignore_old_logp_in_one_compiled_program():
  params = _params(0)
  spec = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(2, model.NO_REMAT), use_old_logp=True)
  batch = _batch()
  flags = np.array([1, 1, 1, 0, 0, 0], np.int32)

  @jax.jit
  def expected(p, b):  # (logp, loss with the flagged rows' old = logp and the others' = logp - 0.5, clipped count)
    logp, _ = train_step.completion_logprobs(CFG, p, b)
    old = jnp.where(flags[:, None] > 0, logp, logp - 0.5)
    loss, stats = grpo.grpo_loss(logp, old, logp, b.adv, b.mask, spec.loss_cfg)
    return logp, loss, stats["clipped_tokens"], grpo.grpo_loss(logp, logp, logp, b.adv, b.mask,
                                                                 spec.loss_cfg)[0]

  logp, want_loss, want_clipped, on_policy_loss = expected(params, batch)
  # on-policy rows carry garbage (a placeholder nobody computed); the others a policy ratio e^0.5 > 1 + eps_high
  old = np.where(flags[:, None] > 0, np.nan, np.asarray(logp) - 0.5).astype(np.float32)
  step = jax.jit(lambda p, b: train_step.gradient_step(p, b, spec))
  grads, m = step(params, batch.replace(old_logp=old, on_policy=flags))
  np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-5)
  off_tokens = batch.mask[3:].sum()  # every off-policy token has A > 0 and ratio 1.65: all clipped
  assert float(want_clipped) == off_tokens
  np.testing.assert_allclose(m["clipfrac"], off_tokens / batch.mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(m["abs_log_ratio"], 0.5 * off_tokens / batch.mask.sum(), rtol=1e-4)
  jax.tree_util.tree_map(lambda g: np.testing.assert_(np.isfinite(np.asarray(g)).all()), grads)
  # the flag is data: all rows on-policy is the single-update step (ratio 1), in the same compiled program
  _, m1 = step(params, batch.replace(old_logp=old, on_policy=np.ones(B, np.int32)))
  assert float(m1["clipfrac"]) == float(m1["abs_log_ratio"]) == 0.0
  np.testing.assert_allclose(m1["loss"], on_policy_loss, rtol=1e-5)
  assert step._cache_size() == 1


@pytest.mark.slow
def test_sequence_logprobs_in_row_slices_equal_one_forward():
  params = _params(1)
  batch = _batch()
  spec = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(2, model.NO_REMAT), microbatches=3, logprob_chunk=3,
                             temperature=0.7)
  got = jax.jit(lambda p, b: train_step.sequence_logprobs(spec, p, b))(params, batch)
  want, _ = train_step.completion_logprobs(CFG, params, batch, temperature=0.7)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  cold, _ = train_step.completion_logprobs(CFG, params, batch)
  assert np.abs(np.asarray(want) - np.asarray(cold)).max() > 1e-2  # the temperature reaches the log-probs


def _recording(t: Trainer):
  """Per-update (metrics, on_policy flags) and the number of old/ref log-prob forwards the trainer runs."""
  seen, calls = [], []
  get, forward = t.stepper.get, t.stepper.logprobs

  def recording_get(spec, b, **kw):
    step = get(spec, b, **kw)

    def grad(params, batch):
      g, m = step.grad(params, batch)
      seen.append((jax.device_get(m), np.asarray(np.ones(1) if batch.on_policy is None else batch.on_policy)))
      return g, m

    return dataclasses.replace(step, grad=grad)

  def counting(spec, p, b):
    calls.append(np.asarray(b.tokens))
    return forward(spec, p, b)

  t.stepper.get, t.stepper.logprobs = recording_get, counting
  return seen, calls


@pytest.mark.slow
@pytest.mark.parametrize("iterations", [1, 2])
def test_later_minibatches_are_off_policy_and_the_first_skips_the_forward(tmp_path, iterations):
  # 12 rows in 2 minibatches, a learning rate large enough that one update moves the policy past the clip range
  t = Trainer(tiny_config(tmp_path, "train.minibatch_size=6", "grpo.filter_zero_std=false", "train.warmstart_steps=0",
                          "optimizer.lr=0.05", f"grpo.num_iterations={iterations}"))
  assert t.spec.use_old_logp
  t.task.reward = lambda text, ref: float(ord(text[0]) % 2) if text else 0.0  # varied rewards from a random policy
  seen, calls = _recording(t)
  t.run_step(0)
  assert len(seen) == 2 * iterations
  # the first update is on-policy: flagged, ratio exactly 1; its old-policy forward is skipped unless a second
  # pass over the same minibatch will need it
  m, flags = seen[0]
  assert float(m["abs_log_ratio"]) == 0.0 and float(m["clipfrac"]) == 0.0
  for m, _ in seen[1:]:  # every later update sees the policy that sampled, not itself
    assert float(m["abs_log_ratio"]) > 0.05 and float(m["clipfrac"]) > 0.0
  assert flags.all() and not any(f.any() for _, f in seen[1:])
  assert len(calls) == (1 if iterations == 1 else 2)


def test_one_update_per_rollout_keeps_the_on_policy_step(tmp_path):
  t = Trainer(tiny_config(tmp_path, "train.minibatch_size=0", "train.warmstart_steps=0"))
  assert t.updates_per_step == 1 and not t.spec.use_old_logp
  _, calls = _recording(t)
  minibatches = [t.place(_batch())]
  plan = t.add_logprobs(update_plan.UpdatePlan.of(minibatches))
  # no old_logp, no flag, no forward
  assert plan.batches[0] is minibatches[0] and plan.current == (None,) and calls == []


@pytest.mark.slow
def test_training_logprobs_are_the_samplers_at_temperature(tmp_path):
  # init_std 0.3: logits far enough from uniform that the temperature matters
  t = Trainer(tiny_config(tmp_path, "rollout.temperature=0.7", "rollout.top_p=1.0", "rollout.top_k=0",
                          "model.init_std=0.3", "train.minibatch_size=6"))
  assert t.spec.temperature == 0.7
  c = t.config
  params = t.state["params"]
  roll = rollout.sample_completions(t.model_cfg, params, t.prompter, t.task.train_batch(0, c.rollout.num_prompts),
                                    c.rollout.num_generations, c.rollout.max_prompt_len, c.rollout.sampling(),
                                    jax.random.PRNGKey(3), t.task.reward)
  mask = roll.mask > 0
  assert mask.sum() > 10
  batch = UpdateBatch(roll.prompt_ids, roll.prompt_mask, roll.tokens, roll.mask,
                      np.where(np.arange(len(roll.mask)) % 2, 1.0, -1.0).astype(np.float32))
  placed = t.place(batch)
  # the old/reference forward the trainer runs
  np.testing.assert_allclose(np.asarray(t.stepper.logprobs(t.spec, params, placed))[mask], roll.sample_logprobs[mask],
                             atol=2e-5)
  # and the compiled step: with the sampler's log-probs as old_logp the first ratio is 1 (nothing clipped)
  off = t.place(batch.replace(old_logp=roll.sample_logprobs.astype(np.float32),
                              on_policy=np.zeros(len(roll.mask), np.int32)))
  _, m = t.stepper.get(t.spec, off).grad(params, off)
  assert float(m["abs_log_ratio"]) < 2e-5 and float(m["clipfrac"]) == 0.0
  ignored = dataclasses.replace(t.spec, temperature=1.0)  # what the trainer computed before
  cold = jax.jit(lambda p, b: train_step.sequence_logprobs(ignored, p, b))(params, placed)
  assert np.abs(np.asarray(cold)[mask] - roll.sample_logprobs[mask]).mean() > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_logp_from_the_sampler_needs_no_forward_and_trains_as_the_forward_does(tmp_path, temperature):
  from hilore_jax.loop import metrics

  args = ["train.steps=2", "train.minibatch_size=4", "grpo.num_iterations=2", "grpo.filter_zero_std=false",
          "eval.at_start=false", "eval.at_end=false", f"rollout.temperature={temperature}"]
  runs = {}
  for source in ("forward", "sampler"):
    t = Trainer(tiny_config(tmp_path / source, *args, f"grpo.old_logp={source}"))
    t.train()
    runs[source] = (t, metrics.read_metrics(tmp_path / source / "metrics.jsonl"))
  (tf, rf), (ts, rs) = runs["forward"], runs["sampler"]
  assert tf.stepper._forwards and not ts.stepper._forwards  # the sampler's log-probs replaced the forward pass
  # the same rollouts, and updates within the KV-cache path's float32 differences of each other
  assert [r["reward/mean"] for r in rf] == [r["reward/mean"] for r in rs]
  # the two old log-probs differ by the KV-cache path's float32 rounding: a few ulps of log-probs of size |logp|, so
  # quantities made of log-prob differences agree to that scale, the rest relatively
  logp_scale = max(float(np.abs(np.asarray(ts.last_rollout.sample_logprobs)).max()), 1.0)
  ulps = 64 * np.finfo(np.float32).eps * logp_scale
  for key in ("loss", "grad_norm", "entropy"):
    np.testing.assert_allclose([r[key] for r in rs], [r[key] for r in rf], rtol=1e-4, atol=ulps, err_msg=key)
  for key in ("kl", "abs_log_ratio"):
    np.testing.assert_allclose([r[key] for r in rs], [r[key] for r in rf], rtol=0, atol=ulps, err_msg=key)
  assert max(r["abs_log_ratio"] for r in rs) > 0  # later updates were off-policy: the old log-probs were read


def test_old_logp_from_the_sampler_refuses_a_truncated_sampler(tmp_path):
  from hilore_jax.errors import ConfigError

  with pytest.raises(ConfigError, match=r"grpo.old_logp=sampler .* rollout.top_k must be 0 and rollout.top_p 1.0 "
                                        r"\(got 5 and 1.0\)"):
    tiny_config(tmp_path, "grpo.old_logp=sampler", "rollout.top_k=5")
