"""Minibatches drawn from a rollout (rl/update_batch.py): whole groups shuffled by default, so a minibatch's prompt
table serves G rows (the tiny default computes <= 0.55 of its unshared positions), rows shuffled as before with
train.shuffle=row; replayed rows join their prompt's group."""

import os

import numpy as np
import pytest

import repo
from hilore_jax import cli
from hilore_jax.loop import update_plan
from hilore_jax.rl import update_batch
from hilore_jax.rl.rollout import Rollout


def _rollout(prompts: int, G: int, P: int, N: int, seed: int = 0) -> Rollout:
  """G consecutive rows per prompt (as the sampler gives them), distinct prompts, ragged lengths, mixed rewards."""
  rng = np.random.default_rng(seed)
  plen = rng.integers(P // 2, P + 1, prompts)
  pm = np.repeat((np.arange(P)[None] >= P - plen[:, None]).astype(np.int32), G, axis=0)
  pids = np.repeat(np.arange(1, prompts + 1)[:, None] * np.ones((1, P), np.int32), G, axis=0) * pm  # distinct
  mask = (np.arange(N)[None] < rng.integers(1, N + 1, prompts * G)[:, None]).astype(np.int32)
  rewards = rng.integers(0, 2, prompts * G).astype(np.float32)
  rewards[::G] = 1.0 - rewards[1::G]  # no group with all-equal rewards
  return Rollout(pids.astype(np.int32), pm, mask * 3, mask, np.zeros(mask.shape, np.float32), [""] * len(mask),
                 rewards)


def _config(*overrides):
  return cli.load_config(None, ["rollout.num_prompts=6", "rollout.num_generations=4", "rollout.max_prompt_len=5",
                                "rollout.max_new_tokens=3", "train.minibatch_size=8", "out_dir=/tmp/unused",
                                *overrides])


def _prompts(batch) -> list[int]:
  return [int(r[r > 0][0]) for r in batch.prompt_ids]


def test_minibatches_hold_whole_groups_and_rows_shuffle_as_before():
  roll = _rollout(6, 4, 5, 3)
  batches, _ = update_batch.minibatches(_config(), roll, np.random.default_rng(3))
  assert len(batches) == 3
  seen = []
  for b in batches:  # 8 rows: two whole groups of 4, each group's rows in their rollout order
    p = _prompts(b)
    assert len(set(p)) == 2 and all(p.count(x) == 4 for x in set(p))
    assert p[:4] == [p[0]] * 4  # contiguous
    seen += p
  assert sorted(seen) == sorted(_prompts(roll)) and seen != sorted(seen)  # every row once, groups shuffled
  # train.shuffle=row: the permutation rows were always drawn with (the same random draws)
  rows, _ = update_batch.minibatches(_config("train.shuffle=row"), roll, np.random.default_rng(3))
  order = np.arange(24)
  np.random.default_rng(3).shuffle(order)
  np.testing.assert_array_equal(np.concatenate([b.prompt_ids for b in rows]), roll.prompt_ids[order])
  assert max(len(set(_prompts(b))) for b in rows) > 2


def test_a_group_split_by_the_minibatch_size_and_replayed_rows_stay_next_to_their_prompt():
  roll = _rollout(3, 4, 5, 3)
  rng = np.random.default_rng(0)
  # two rows replayed (prompt 2's and a prompt not in this rollout), then shuffled by group
  ids = np.concatenate([roll.prompt_ids, roll.prompt_ids[[5]], np.full((1, 5), 9, np.int32)])
  order = update_batch.shuffled(ids, np.ones_like(ids), rng, "group")
  prompts = [int(r[-1]) for r in ids[order]]
  runs = [p for i, p in enumerate(prompts) if i == 0 or p != prompts[i - 1]]
  assert sorted(runs) == sorted(set(prompts))  # each prompt's rows contiguous: 5 of prompt 2 (4 + its replayed)
  assert prompts.count(2) == 5 and prompts.count(9) == 1
  with pytest.raises(ValueError, match="train.shuffle must be one of"):
    update_batch.shuffled(ids, ids, rng, "rows")


def _tiny_default(*overrides):
  return cli.load_config(os.path.join(repo.ROOT, "configs", "tiny.yaml"), ["out_dir=/tmp/unused", *overrides])


def test_the_tiny_default_computes_at_most_055_of_its_unshared_positions_with_whole_groups():
  # 64 prompts x 8 completions, minibatches of 128: each minibatch's table holds 16 prompts, not ~64
  ratios = {}
  for mode in ("group", "row"):
    c = _tiny_default(f"train.shuffle={mode}")
    roll = _rollout(c.rollout.num_prompts, c.rollout.num_generations, c.rollout.max_prompt_len,
                    c.rollout.max_new_tokens)
    plan = update_plan.build(c, roll, np.random.default_rng(0), None, 0, True, 1, 1, lambda b: b)
    computed, real, unshared = plan.tokens()
    assert len(plan) == 4 and real <= computed
    ratios[mode] = computed / unshared
  assert ratios["group"] == pytest.approx((16 * 8 + 128 * 5) / (128 * 13))  # 0.46
  assert ratios["group"] <= 0.55 and ratios["row"] == pytest.approx((64 * 8 + 128 * 5) / (128 * 13))  # 0.69


@pytest.mark.parametrize("mb,replay", [(8, False), (6, False), (12, False), (8, True)])
def test_the_table_bound_holds_for_every_minibatch(mb, replay):
  # whole groups: a minibatch cut at group boundaries holds mb / G prompts; otherwise the groups inside it, a
  # partial one at each end and every replayed row; drawn 30 times, no minibatch exceeds the bound
  from hilore_jax.rl import prompt_share, replay as replay_lib

  over = ["replay.enabled=true", "replay.share=0.5", "replay.tau_max=8"] if replay else []
  c = _config(f"train.minibatch_size={mb}", *over)
  bound = prompt_share.max_distinct(c)
  G, prompts = 4, 6
  replayed = replay_lib.max_replay_rows(c.replay, 24) if replay else 0
  want = {8: 2, 6: 6 // G + 2, 12: 3}[mb] if not replay else min(prompts, mb // G + 2) + replayed
  assert bound == want
  rng = np.random.default_rng(0)
  for _ in range(30):
    roll = _rollout(prompts, G, 5, 3, seed=int(rng.integers(1 << 30)))
    ids = roll.prompt_ids
    if replay:  # replayed rows: some of this rollout's prompts, some of others'
      others = replayed - replayed // 2
      new = 50 + np.arange(others)[:, None] + 0 * ids[:others]  # prompts not in the rollout
      extra = np.concatenate([ids[rng.integers(0, 24, replayed // 2)], new])
      ids = np.concatenate([ids, extra.astype(np.int32)])
    order = update_batch.shuffled(ids, np.ones_like(ids), rng, "group")
    for i in range(0, len(order), mb):
      assert len({tuple(r) for r in ids[order[i:i + mb]]}) <= bound
  rows = _config(f"train.minibatch_size={mb}", "train.shuffle=row", *over)
  assert prompt_share.max_distinct(rows) == prompts + replayed
