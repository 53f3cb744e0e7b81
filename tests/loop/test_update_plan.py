"""The update's typed plan (loop/update_plan.py): the trainer builds it once per rollout, with each minibatch's host
lengths and the token budget's microbatches for both passes; later passes turn the first minibatch off-policy."""

import numpy as np
from trainer_util import tiny_config

from hilore_jax.loop.trainer import Trainer
from hilore_jax.loop.update_plan import UpdatePlan
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
