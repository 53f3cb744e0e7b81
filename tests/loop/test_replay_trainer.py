"""Replay in the trainer: fresh-anchored minibatches, stored behaviour log-probs as the ratio's denominator, zero
exposure for replayed tokens outside the clip range, the replay/* metrics, and exact resume with a full buffer."""

import numpy as np
import pytest
from trainer_util import tiny_config

from hilore_jax import cli
from hilore_jax.loop import step_hooks
from hilore_jax.errors import ConfigError
from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.rl import grpo, train_step
from hilore_jax.rl.rollout import Rollout
from hilore_jax.rl.update_batch import UpdateBatch
from hilore_jax.loop.trainer import Trainer

G, P, N = 4, 6, 3  # tiny_config: 3 prompts x 4 generations, prompts padded to 6, 3 new tokens
OFFSETS = np.array([-1.0, 0.05, 1.0, -0.05, 0.5, 0.0])  # stored - current log-prob: some ratios far outside the clip


def _rollout(step: int, rewards) -> Rollout:
  """Synthetic rows identified by tokens[:, 0] = 20 * step + row (the tiny vocabulary has 80 ids)."""
  rng = np.random.default_rng(step)
  B = len(rewards)
  tokens = rng.integers(1, 50, (B, N)).astype(np.int32)
  tokens[:, 0] = 20 * step + np.arange(B)
  return Rollout(rng.integers(1, 50, (B, P)).astype(np.int32), np.ones((B, P), np.int32), tokens,
                 np.ones((B, N), np.int32), np.zeros((B, N), np.float32), [""] * B, np.asarray(rewards, np.float32))


def _rows(minibatches, key):
  return np.concatenate([np.asarray(getattr(b, key)) for b in minibatches])


def _current(t, params, roll):
  """The current policy's log-probs of a rollout's rows (the trainer's own forward)."""
  return np.asarray(t.stepper.logprobs(t.spec, params, t.place(UpdateBatch(roll.prompt_ids, roll.prompt_mask,
                                                                            roll.tokens, roll.mask))))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
  return Trainer(tiny_config(tmp_path_factory.mktemp("replay"), "replay.enabled=true", "replay.share=1.0",
                             "replay.tau_max=2", "train.minibatch_size=4", "train.warmstart_steps=0"))


@pytest.mark.slow
def test_replayed_rows_carry_their_behaviour_logprobs_into_the_ratio(trainer):
  t, params = trainer, trainer.state["params"]
  roll0 = _rollout(0, [1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 0])  # group 1 has zero std: never stored
  # behaviour log-probs that differ from the current policy's by known offsets
  current0 = _current(t, params, roll0)
  roll0.sample_logprobs = (current0 + np.resize(OFFSETS, current0.shape)).astype(np.float32)
  stats0 = t.plan_update(roll0, np.random.default_rng(0), 0).stats
  assert stats0["replay/frac"] == 0 and stats0["replay/size"] == 0
  assert t.replay.size == 8  # 3 groups with signal: every row has A != 0 (two 1s and two 0s, or 3:1)
  roll1 = _rollout(1, [0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0])
  plan = t.plan_update(roll1, np.random.default_rng(1), 1)
  mbs, stats = plan.batches, plan.stats
  ids, replayed = _rows(mbs, "tokens")[:, 0], _rows(mbs, "replayed").astype(bool)
  live = _rows(mbs, "mask").sum(1) > 0
  # fresh-anchored: every fresh row with signal (groups 0 and 1), then share 1.0 x 8 fresh = all 8 stored rows
  assert sorted(ids[live & ~replayed]) == list(range(20, 28))
  assert sorted(ids[live & replayed]) == [0, 1, 2, 3, 8, 9, 10, 11]  # distinct rows, none of this step's
  assert stats["replay/frac"] == 0.5 and stats["replay/age_max"] == 1 and stats["rows_updated"] == 16
  filled = t.add_logprobs(plan)
  placed, current = filled.batches, filled.current
  old, on_policy = _rows(placed, "old_logp"), _rows(placed, "on_policy")
  cur = np.concatenate([np.asarray(c) for c in current])
  for r in np.flatnonzero(live & replayed):
    np.testing.assert_array_equal(old[r], roll0.sample_logprobs[ids[r]])  # stored, not recomputed
    assert on_policy[r] == 0
  np.testing.assert_array_equal(old[~replayed], cur[~replayed])  # fresh rows: the current policy's
  # the loss's ratio: |log r| summed over the step's tokens is the stored offsets on replayed rows, 0 on fresh ones
  got = 0.0
  for b in placed:
    _, s = train_step.loss_and_stats(params, b, t.spec, *grpo.normalisers(b.mask))
    got += float(s["abs_log_ratio_sum"])
  want = np.abs(np.resize(OFFSETS, current0.shape))[ids[live & replayed]].sum()
  assert want > 1 and got == pytest.approx(want, rel=1e-4, abs=1e-4)


@pytest.mark.slow
def test_replayed_token_outside_the_clip_range_has_zero_exposure(trainer):
  t = trainer
  hooks = step_hooks.memory_hooks(t.stepper, t.spec)
  roll0 = _rollout(2, [1, 0, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1])
  current0 = _current(t, t.state["params"], roll0)
  roll0.sample_logprobs = (current0 + np.resize(OFFSETS, current0.shape)).astype(np.float32)
  t.plan_update(roll0, np.random.default_rng(2), 2)
  plan = t.add_logprobs(t.plan_update(_rollout(3, [1, 0, 0, 0] * 3), np.random.default_rng(3), 3))
  mbs, current = plan.batches, plan.current
  clipped_seen = kept_seen = 0
  for b, logp in zip(mbs, current):
    w = np.asarray(hooks.token_weights(None, b, ExposureSwitches(), logp))
    ratio = np.exp(np.asarray(logp) - np.asarray(b.old_logp))
    adv = np.asarray(b.adv)[:, None]
    on = np.asarray(b.mask) > 0
    outside = on & (((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8)))
    assert np.all(w[outside] == 0) and np.all(w[on & ~outside & (adv != 0)] > 0)
    clipped_seen += outside.sum()
    kept_seen += (on & ~outside & (adv != 0)).sum()
    # without the current log-probs the ratio would be taken as 1 and the same tokens exposed
    w_blind = np.asarray(hooks.token_weights(None, b, ExposureSwitches()))
    assert np.all(w_blind[outside] > 0)
  assert clipped_seen > 0 and kept_seen > 0


def test_config_section_is_validated():
  for override, msg in [("replay.tau_max=0", "replay.tau_max"), ("replay.mode=fifo", "replay.mode"),
                        ("replay.share=-1", "replay.share"),
                        ("replay.priority_exponent=-0.5", "replay.priority_exponent"),
                        ("replay.group_size=3", "rollout.num_generations"), ("replay.capacity=0", "replay.capacity")]:
    with pytest.raises(ConfigError, match=msg):
      cli.load_config(None, ["rollout.num_generations=4", override])
  with pytest.raises(ConfigError, match="multiple of replay.group_size"):
    cli.load_config(None, ["rollout.num_generations=4", "replay.mode=naive", "replay.capacity=10"])
  c = cli.load_config(None, ["rollout.num_generations=4"])
  assert not c.replay.enabled and c.replay.group_size == 4


def test_replay_off_keeps_the_batch_and_step_program(tmp_path):
  t = Trainer(tiny_config(tmp_path, "train.minibatch_size=0", "train.warmstart_steps=0"))
  plan = t.plan_update(_rollout(0, [1, 0, 0, 1] * 3), np.random.default_rng(0), 0)
  mbs, stats = plan.batches, plan.stats
  assert t.replay is None and not any(k.startswith("replay/") for k in stats)
  assert len(mbs) == 1 and [n for n, _, _ in mbs[0].signature()] == ["prompt_ids", "prompt_mask", "tokens", "mask",
                                                                     "adv"]
  assert not t.spec.use_old_logp  # one update per rollout: the on-policy program, as before replay existed
