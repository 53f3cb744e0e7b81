"""The update's typed plan (loop/update_plan.py): the trainer builds it once per rollout, with each minibatch's host
lengths and the token budget's microbatches for both passes (packed only where that saves enough); later passes turn
the first minibatch off-policy."""

import builders
import numpy as np
from trainer_util import tiny_config

from hilore_jax.loop.trainer import Trainer
from hilore_jax.loop.update_plan import UpdatePlan, microbatches
from hilore_jax.rl import packing, prompt_share, token_budget
from hilore_jax.rl.rollout import Rollout

B, P, N = 12, 6, 3


def _rollout() -> Rollout:
  lengths = np.array([3, 1, 2, 3, 1, 1, 2, 3, 1, 2, 1, 1])
  mask = (np.arange(N)[None] < lengths[:, None]).astype(np.int32)
  rewards = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 1], np.float32)
  return Rollout(np.arange(B * P).reshape(B, P).astype(np.int32) % 70 + 3, np.ones((B, P), np.int32),
                 np.full((B, N), 5, np.int32) * mask, mask, np.zeros((B, N)), [""] * B, rewards)


def test_the_plan_carries_each_minibatchs_lengths_and_both_passes_microbatches(tmp_path):
  t = Trainer(tiny_config(tmp_path, "train.minibatch_size=6", "grpo.num_iterations=2",
                          "train.max_tokens_per_microbatch=27", "train.max_tokens_per_logprob_pass=45"))
  roll = _rollout()
  plan = t.plan_update(roll, np.random.default_rng(0), 0)
  assert len(plan) == 2 and plan.stats["rows_updated"] == 12
  for b, n, grad, logp in zip(plan.batches, plan.lengths, plan.grad, plan.logp):
    np.testing.assert_array_equal(n, np.asarray(b.mask).sum(1))  # host lengths: the placed rows'
    for micros, budget in ((grad, 27), (logp, 45)):  # each pass packed under its own budget
      rows = np.concatenate([m.rows[m.live > 0] for m in micros])
      assert sorted(rows.tolist()) == list(range(6)) and all(len(m.rows) * (P + m.cap) <= budget for m in micros)
  assert max(len(m.rows) for m in plan.logp[0]) > max(len(m.rows) for m in plan.grad[0])  # the larger budget
  first, later = plan.pass_batches(0, True), plan.pass_batches(1, True)
  assert np.asarray(first[0].on_policy).any() and not np.asarray(later[0].on_policy).any()
  assert later[1] is plan.batches[1] and plan.pass_batches(1, False)[0] is plan.batches[0]
  micro, _ = plan.memory_batches(plan.batches)  # what the memory manager plans for: every microbatch
  assert len(micro) == sum(len(m) for m in plan.grad)
  assert 0 < plan.padding_frac() < UpdatePlan.of(plan.batches).padding_frac()  # packing pads less


def test_packing_falls_back_to_the_padded_layout_where_it_saves_too_little(tmp_path):
  # the 12 rows (3 prompts x 4) at the 3-token cap: buffers and padded buckets compute the same 2 x (18 + 4 x 6)
  # positions, so the buckets run (on 2 devices too: their rows a multiple of 2); ragged rows pack; a budget that
  # holds every row at the cap leaves the minibatch unbudgeted (None)
  def plan(lengths, budget=18, shards=1, *more):
    c = tiny_config(tmp_path, "train.packing=true", f"train.max_tokens_per_microbatch={budget}", *more)
    batch = builders.update_batch(np.random.default_rng(0), P, N, 31, lengths, order=np.repeat(np.arange(3), 4))
    return microbatches(c, "max_tokens_per_microbatch", batch, prompt_share.prompt_keys(batch), shards)

  at_cap = [3] * 12
  for shards in (1, 2):
    micros = plan(at_cap, 18, shards)
    assert all(isinstance(m, token_budget.Micro) for m in micros) and [m.key for m in micros] == [(6, 3, 4)] * 2
  assert {type(m) for m in plan(at_cap, 18, 1, "train.packing_min_saving=0")} == {packing.Buffer}
  assert [b.key for b in plan([3, 1, 1, 1, 2, 1, 1, 1, 3, 1, 1, 1])] == [(1, 18, 4)]  # 17 tokens: 42 positions, not 84
  assert plan(at_cap, 36) is None
