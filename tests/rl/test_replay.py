"""Rollout-level replay: age bound, capacity order, fresh anchoring, |A|^alpha priority, naive baseline, resume."""

import collections
import dataclasses
import io

import numpy as np
import pytest
from scipy.stats import chisquare

from hilore_jax.rl.replay import STAT_KEYS, ReplayBuffer, ReplayConfig
from hilore_jax.rl.rollout import Rollout

P, N, G = 5, 7, 3  # odd widths catch a transposed [C, P] / [C, N]
ROW_ID = 1000  # tokens[:, 0] = step * ROW_ID + row: every row is identified by its content


def make_rollout(step, adv_B, seed=0):
  """A fake rollout of len(adv_B) rows born at `step`, with random content and the row id in tokens[:, 0]."""
  rng = np.random.default_rng([seed, step, 7])
  B = len(adv_B)
  prompt_mask = (np.arange(P)[None] >= rng.integers(0, P - 1, (B, 1))).astype(np.int32)  # left-padded
  mask = (np.arange(N)[None] < rng.integers(1, N + 1, (B, 1))).astype(np.int32)  # right-padded
  tokens = rng.integers(1, 50, (B, N)).astype(np.int32)
  tokens[:, 0] = step * ROW_ID + np.arange(B)
  return Rollout(rng.integers(1, 50, (B, P)).astype(np.int32) * prompt_mask, prompt_mask, tokens, mask,
                 -rng.random((B, N)).astype(np.float32), [""] * B, rng.random(B).astype(np.float32))


def fresh_of(roll, adv_B, with_old=True):
  d = {"prompt_ids": roll.prompt_ids, "prompt_mask": roll.prompt_mask, "tokens": roll.tokens, "mask": roll.mask,
       "adv": np.asarray(adv_B, np.float32)}
  return {**d, "old_logp": roll.sample_logprobs} if with_old else d


def group_advantages(rewards_B):
  r = rewards_B.reshape(-1, G)
  return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def random_step(step, groups=4, seed=0):
  """Rewards in {0, 1, 2}: some groups are constant (A == 0) and [0, 1, 2] has a zero-advantage middle row."""
  rewards = np.random.default_rng([seed, step]).integers(0, 3, groups * G).astype(np.float32)
  adv = group_advantages(rewards)
  return make_rollout(step, adv, seed), adv


def cfg(**kw):
  base = dict(enabled=True, mode="fresh_anchored", tau_max=3, capacity=64, share=0.5, priority_exponent=1.0,
              group_size=G)
  return ReplayConfig(**{**base, **kw})


def stored_ids(buf):
  s = buf.state()
  return sorted(int(t) for t in s["tokens"][s["valid"], 0])


def run(buf, steps, seed=0):
  """The trainer's order: compose from the buffer, then add this step's fresh rows."""
  out = []
  for t in steps:
    roll, adv = random_step(t, seed=seed)
    out.append(buf.compose(fresh_of(roll, adv), t, np.random.default_rng([seed, t, 1])))
    buf.add(roll, adv, t)
  return out


def test_config_errors_name_the_key():
  for kw, key in [(dict(mode="fifo"), "replay.mode"), (dict(tau_max=0), "replay.tau_max"),
                  (dict(capacity=0), "replay.capacity"), (dict(share=-0.1), "replay.share"),
                  (dict(priority_exponent=-1.0), "replay.priority_exponent"), (dict(group_size=1), "replay.group_size"),
                  (dict(mode="naive", capacity=10), "replay.capacity")]:
    with pytest.raises(ValueError, match=key):
      cfg(**kw)
  assert not ReplayConfig().enabled


def test_age_eviction_exactly_at_tau_max():
  buf = ReplayBuffer(cfg(tau_max=3, share=10.0), P, N)
  adv = np.array([1.0, -0.5, 2.0])
  roll = make_rollout(5, adv)
  buf.add(roll, adv, 5)
  fresh = fresh_of(make_rollout(99, adv), adv)
  _, replayed, stats = buf.compose(fresh, 5, np.random.default_rng(0))
  assert not replayed.any()  # rows born at step 5 are never replayed at step 5
  for t in (6, 7, 8):
    _, replayed, stats = buf.compose(fresh, t, np.random.default_rng(t))
    assert replayed.sum() == 3 and stats["replay/age_max"] == t - 5 and stats["replay/evicted"] == 0
  assert buf.evict(8) == 0 and buf.size == 3  # age 3 == tau_max: still usable
  _, replayed, stats = buf.compose(fresh, 9, np.random.default_rng(9))
  assert not replayed.any() and stats["replay/evicted"] == 3 and buf.size == 0  # age 4 > tau_max: gone


def test_capacity_evicts_oldest_then_lowest_abs_advantage():
  buf = ReplayBuffer(cfg(tau_max=100, capacity=4), P, N)
  buf.add(make_rollout(1, [0.5, -2.0, 1.0]), [0.5, -2.0, 1.0], 1)
  buf.add(make_rollout(2, [3.0, -0.1, 0.2]), [3.0, -0.1, 0.2], 2)
  # 6 rows for 4 slots: both leavers come from step 1, smallest |A| first (0.5, then 1.0)
  assert stored_ids(buf) == [1001, 2000, 2001, 2002]
  adv3 = [0.3, -4.0, 0.6, 0.25, 5.0, -0.7]
  buf.add(make_rollout(3, adv3), adv3, 3)
  # 4 + 6 rows: all older rows leave first, then the two smallest-|A| incoming rows (0.25, 0.3)
  assert stored_ids(buf) == [3001, 3002, 3004, 3005]
  _, _, stats = buf.compose(fresh_of(make_rollout(4, [1.0] * 3), [1.0] * 3), 4, np.random.default_rng(0))
  assert stats["replay/evicted"] == 2 + 6 and stats["replay/size"] == 4


def test_zero_advantage_rows_never_stored():
  adv = np.array([0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.7, 0.0, -0.7])
  buf = ReplayBuffer(cfg(), P, N)
  assert buf.add(make_rollout(0, adv), adv, 0) == 4
  assert stored_ids(buf) == [1, 2, 6, 8]
  assert np.all(buf.state()["adv"][buf.state()["valid"]] != 0)


def test_fresh_rows_all_kept_and_replayed_rows_are_stored_rows():
  c = cfg(tau_max=2, share=0.5)
  buf = ReplayBuffer(c, P, N)
  steps = range(8)
  history = {t: random_step(t) for t in steps}
  for t, (batch, replayed, stats) in zip(steps, run(buf, steps)):
    roll, adv = history[t]
    n = len(adv)
    assert not replayed[:n].any() and replayed[n:].all()
    for k, v in fresh_of(roll, adv).items():  # every fresh row, unchanged and first
      np.testing.assert_array_equal(batch[k][:n], v)
    # replayable, computed independently: nonzero-advantage rows of steps t - tau_max .. t - 1
    pool = [s for s in range(max(t - c.tau_max, 0), t) for a in history[s][1] if a != 0]
    expect = min(int(np.floor(c.share * n + 0.5)), len(pool))
    assert replayed.sum() == expect and stats["replay/frac"] == expect / (n + expect)
    ids = batch["tokens"][replayed, 0]
    assert len(set(ids.tolist())) == len(ids)  # without replacement
    for r, i in zip(np.flatnonzero(replayed), ids):
      born, row = divmod(int(i), ROW_ID)
      src, src_adv = history[born]
      assert 1 <= t - born <= c.tau_max and src_adv[row] != 0
      np.testing.assert_array_equal(batch["prompt_ids"][r], src.prompt_ids[row])
      np.testing.assert_array_equal(batch["mask"][r], src.mask[row])
      np.testing.assert_array_equal(batch["tokens"][r], src.tokens[row])
      assert batch["adv"][r] == np.float32(src_adv[row])
      # the behaviour log-probs it was sampled with, not anything recomputed
      np.testing.assert_array_equal(batch["old_logp"][r], src.sample_logprobs[row])
  assert replayed.any()


def test_fresh_old_logp_left_to_caller_is_nan():
  buf = ReplayBuffer(cfg(share=1.0), P, N)
  adv = np.array([1.0, -1.0, 0.5])
  buf.add(make_rollout(0, adv), adv, 0)
  roll = make_rollout(1, adv)
  batch, replayed, _ = buf.compose(fresh_of(roll, adv, with_old=False), 1, np.random.default_rng(0))
  assert np.isnan(batch["old_logp"][~replayed]).all() and np.isfinite(batch["old_logp"][replayed]).all()


def test_stats_keys_and_age_never_above_tau_max():
  c = cfg(tau_max=2, share=1.0, capacity=20)
  for t, (batch, replayed, stats) in enumerate(run(ReplayBuffer(c, P, N), range(12))):
    assert set(stats) == set(STAT_KEYS)
    age = t - batch["tokens"][replayed, 0] // ROW_ID  # from the row ids, not from the buffer's birth steps
    assert stats["replay/age_max"] == (age.max() if replayed.any() else 0) <= c.tau_max
    assert np.all(age >= 1) and stats["replay/size"] <= c.capacity
    np.testing.assert_allclose(stats["replay/age_mean"], age.mean() if replayed.any() else 0.0)
    np.testing.assert_allclose(stats["replay/adv_abs_mean_replayed"],
                               np.abs(batch["adv"][replayed]).mean() if replayed.any() else 0.0, rtol=1e-6)
    np.testing.assert_allclose(stats["replay/adv_abs_mean_fresh"], np.abs(batch["adv"][~replayed]).mean(), rtol=1e-6)


def _priority_counts(alpha, draws=6000):
  adv = np.array([0.1, -0.4, 1.0, -2.5, 0.7, 3.0, -0.2])
  buf = ReplayBuffer(cfg(priority_exponent=alpha, tau_max=10), P, N)
  buf.add(make_rollout(0, np.r_[adv, 1.0, 1.0]), np.r_[adv, 0.0, 0.0], 0)  # 9 rows = 3 groups, last 2 unstored
  rng = np.random.default_rng(1234)
  row = np.array([int(buf.rows(buf.sample(1, 1, rng))["tokens"][0, 0]) for _ in range(draws)])
  return np.bincount(row, minlength=len(adv)), adv


def test_priority_frequencies_follow_abs_advantage_power():
  counts, adv = _priority_counts(alpha=1.5)
  w = np.abs(adv) ** 1.5
  assert chisquare(counts, counts.sum() * w / w.sum()).pvalue > 0.01
  # the same data reject a uniform sampler, so the test would catch one
  assert chisquare(counts, np.full(len(adv), counts.sum() / len(adv))).pvalue < 1e-6


def test_alpha_zero_is_uniform():
  counts, adv = _priority_counts(alpha=0.0)
  assert chisquare(counts, np.full(len(adv), counts.sum() / len(adv))).pvalue > 0.01
  assert chisquare(counts, counts.sum() * np.abs(adv) / np.abs(adv).sum()).pvalue < 1e-6


def test_naive_stores_whole_groups_and_ignores_age():
  c = cfg(mode="naive", tau_max=1, capacity=9, share=0.5)
  buf = ReplayBuffer(c, P, N)
  adv0 = np.array([1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, -0.5])  # group 1 carries no signal
  assert buf.add(make_rollout(0, adv0), adv0, 0) == 6
  assert stored_ids(buf) == [0, 1, 2, 6, 7, 8]  # zero-advantage members kept with their groups
  adv1 = np.array([2.0, -2.0, 0.0, 0.3, 0.0, -0.3])
  buf.add(make_rollout(1, adv1), adv1, 1)  # 6 + 6 rows in 9 slots: the oldest group (first in the batch) leaves
  assert stored_ids(buf) == [6, 7, 8, 1000, 1001, 1002, 1003, 1004, 1005]
  fresh = fresh_of(make_rollout(2, np.ones(12)), np.ones(12))
  batch, replayed, stats = buf.compose(fresh, 50, np.random.default_rng(0))  # age 49 > tau_max: still replayed
  ids = batch["tokens"][replayed, 0]
  assert len(ids) == 6  # round(0.5 * 12 / 3) = 2 whole groups
  assert stats["replay/age_max"] == 50 - (ids // ROW_ID).min() >= 49
  groups = collections.Counter((int(i) // ROW_ID, int(i) % ROW_ID // G) for i in ids)
  assert set(groups.values()) == {G}  # every replayed group complete
  # uniform over groups whatever their mean |A| (1/3, 4/3 and 1/5 here)
  rng = np.random.default_rng(5)
  first = [int(buf.rows(buf.sample(G, 60, rng))["tokens"][0, 0]) for _ in range(3000)]
  counts = np.array([first.count(6), first.count(1000), first.count(1003)])
  assert chisquare(counts, [1000, 1000, 1000]).pvalue > 0.01


def test_exact_resume_from_saved_state():
  c = cfg(tau_max=3, capacity=10, share=0.75, priority_exponent=0.7)
  straight = ReplayBuffer(c, P, N)
  expected = run(straight, range(10))
  first = ReplayBuffer(c, P, N)
  run(first, range(5))
  f = io.BytesIO()
  np.savez(f, **first.state())
  f.seek(0)
  loaded = dict(np.load(f))
  loaded = {k: (v.item() if v.ndim == 0 else v) for k, v in loaded.items()}  # counters as plain JSON-able ints
  resumed = ReplayBuffer.from_state(c, loaded)
  got = run(resumed, range(5, 10))
  for (b0, r0, s0), (b1, r1, s1) in zip(expected[5:], got):
    assert s0 == s1
    np.testing.assert_array_equal(r0, r1)
    for k in b0:
      np.testing.assert_array_equal(b0[k], b1[k])
  assert any(r.any() for _, r, _ in got)
  for k, v in straight.state().items():
    np.testing.assert_array_equal(v, resumed.state()[k])


def test_state_round_trips_through_orbax(tmp_path):
  import jax

  from hilore_jax.loop import checkpointing

  c = cfg(capacity=11)
  buf = ReplayBuffer(c, P, N)
  run(buf, range(4))
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=1)
  ckpt.save(4, {"replay": buf.state()}, {"step": 4})
  donor = {"replay": ReplayBuffer(c, P, N).state()}
  dev = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  tree, _ = ckpt.restore(4, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), donor))
  ckpt.close()
  back = ReplayBuffer.from_state(c, tree["replay"])
  for k, v in buf.state().items():
    np.testing.assert_array_equal(v, back.state()[k])


def test_disabled_is_a_pass_through():
  off = ReplayBuffer(dataclasses.replace(cfg(), enabled=False), P, N)
  for _, replayed, stats in run(off, range(4)):
    assert not replayed.any() and stats["replay/frac"] == 0.0 and off.size == 0
  assert any(r.any() for _, r, _ in run(ReplayBuffer(cfg(), P, N), range(4)))


def test_width_mismatch_is_a_clear_error():
  buf = ReplayBuffer(cfg(), P, N)
  roll = make_rollout(0, np.ones(3))
  roll.tokens = roll.tokens[:, :-1]
  with pytest.raises(ValueError, match="rollout.max_new_tokens"):
    buf.add(roll, np.ones(3), 0)
