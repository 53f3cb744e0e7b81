"""The token budget (rl/token_budget.py, packed_step.py): packed microbatches give the unpacked minibatch's loss,
gradient and log-probs for every loss aggregation; every row is packed once within the budget; a run with the
budget on updates as one with it off, on fewer positions; bad values are config errors. On a 2-device fsdp mesh:
tests/loop/test_packing_trainer.py, beside packing's, for one unpacked run in one subprocess."""

import dataclasses

import builders
import jax
import numpy as np
import packed_util
import pytest
from trainer_util import stable, tiny_config

from hilore_jax.loop import metrics, packed_step
from hilore_jax.errors import ConfigError
from hilore_jax.rl import token_budget
from hilore_jax.rl.update_batch import UpdateBatch
from hilore_jax.memory import MemoryManager
from hilore_jax.loop.shaped_memory import ShapedMemory
from hilore_jax.loop.trainer import Trainer

CFG = builders.tiny_model()
B, P, N = 7, 5, 13
LENGTHS = np.array([13, 2, 0, 7, 1, 13, 4])  # a row of zero length: a short minibatch's padding row


def _batch(rng=np.random.default_rng(0)) -> UpdateBatch:
  # left-padded prompts of 3..5 tokens; a fresh row (on_policy) without a stored old log-prob, the others with one
  return builders.update_batch(rng, P, N, 31, LENGTHS, prompt_lens=rng.integers(3, P + 1, B), old_logp=True,
                               ref_logp=True, on_policy=[1, 0, 0, 0, 1, 0, 0])


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


@pytest.mark.parametrize("loss_agg", ["token-mean", *(pytest.param(a, marks=pytest.mark.slow)  # the quick tier: one
                                                        for a in ("seq-mean-token-mean", "seq-mean-token-sum-norm"))])
def test_packed_loss_and_gradient_equal_the_unpacked_minibatch(loss_agg):
  spec = packed_util.spec(CFG, loss_agg, N)
  params = builders.params(CFG, 3)
  batch = _batch()
  micros = token_budget.plan(LENGTHS, P, token_budget.bucket_caps(N, 3), budget=3 * (P + N), max_rows=B)
  assert {m.cap for m in micros} > {N}  # shorter buckets are used
  packed_util.assert_packed_equals_unpacked(params, batch, batch, micros, spec)
  mask = batch.mask > 0
  # the log-prob forward: the same values scattered back to the minibatch's row order
  st = packed_util.stepper(params)
  packed = packed_step.PackedStepper(st).logprobs(spec, params, batch, micros)
  np.testing.assert_allclose(np.asarray(packed)[mask], np.asarray(st.logprobs(spec, params, batch))[mask], rtol=1e-5)


def test_completion_length_metrics_count_only_rows_the_cap_cut():
  from hilore_jax.rl.rollout import Rollout

  mask = (np.arange(5)[None] < np.array([5, 5, 2, 1, 3, 5, 4])[:, None]).astype(np.int32)
  tokens = np.where(mask > 0, 7, 0).astype(np.int32)
  tokens[1, 4] = 2  # the stop id at the last position: stopped, not cut
  roll = Rollout(tokens, mask, tokens, mask, np.zeros(mask.shape, np.float32), [""] * 7, np.zeros(7, np.float32),
                 cut_at_cap=(mask.sum(1) == 5) & (tokens[:, -1] != 2))
  m = metrics.completion_lengths(roll)
  assert (m["completion_len/p50"], m["completion_len/max"]) == (4.0, 5.0)
  assert m["completion_len/p90"] == pytest.approx(5.0) and m["completion_len/truncated_frac"] == pytest.approx(2 / 7)
  assert roll.lengths.tolist() == [5, 5, 2, 1, 3, 5, 4]
  legacy = dataclasses.replace(roll, cut_at_cap=None)  # without the flag: every row at the cap
  assert metrics.completion_lengths(legacy)["completion_len/truncated_frac"] == pytest.approx(3 / 7)


def test_bad_budget_values_are_config_errors(tmp_path):
  with pytest.raises(ConfigError, match=r"train.max_tokens_per_microbatch \(10\) is smaller than one row at the cap.*"
                                        r"6 \+ 7 = 13"):
    tiny_config(tmp_path, "rollout.max_new_tokens=7", "train.max_tokens_per_microbatch=10")
  with pytest.raises(ConfigError, match=r"train.max_tokens_per_logprob_pass \(12\) is smaller.*13"):
    tiny_config(tmp_path, "rollout.max_new_tokens=7", "train.max_tokens_per_logprob_pass=12")
  with pytest.raises(ConfigError, match="train.max_tokens_per_microbatch must be >= 0"):
    tiny_config(tmp_path, "train.max_tokens_per_microbatch=-1")
  with pytest.raises(ConfigError, match="train.length_buckets must be > 0"):
    tiny_config(tmp_path, "train.length_buckets=0")
  with pytest.raises(ConfigError, match="train.microbatch_size .* and train.max_tokens_per_microbatch"):
    tiny_config(tmp_path, "train.microbatch_size=6", "train.max_tokens_per_microbatch=100")


@pytest.mark.slow
def test_a_run_with_the_budget_updates_as_one_without_on_fewer_positions(tmp_path, tmp_path_factory):
  off, rows_off = packed_util.unpacked(tmp_path_factory)
  # 3 rows at the cap (6 + 7 tokens) per microbatch; the log-prob passes 2
  on, rows_on = packed_util.run(tmp_path / "on", "train.max_tokens_per_microbatch=40",
                                "train.max_tokens_per_logprob_pass=26")
  assert off.packer is None and "budget/microbatches" not in rows_off[0]
  # both share the prompt: packed, fewer positions (and another share of them real)
  budget_keys = ("budget/", "completion_len/", "tokens/computed", "tokens/real", "tokens/fill")
  for a, b in zip(stable(rows_off), stable(rows_on)):
    assert set(a) - {k for k in a if k.startswith(budget_keys)} == set(b) - {k for k in b if k.startswith(budget_keys)}
    for k, v in a.items():
      if isinstance(v, float) and not k.startswith(budget_keys):
        np.testing.assert_allclose(b[k], v, rtol=2e-4, atol=1e-6, err_msg=k)
  for x, y in zip(jax.tree.leaves(on.state["params"]), jax.tree.leaves(off.state["params"])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
  # packing is on: short buckets compiled, fewer positions computed, a bounded set of shapes
  for kind in ("grad", "logp"):  # both the update and the log-prob passes ran short buckets
    assert min(cap for k, _, cap in on.packer.shapes if k == kind) < 7, on.packer.shapes
  assert all(r["budget/padding_frac"] < s["budget/padding_frac"] for r, s in zip(rows_on, rows_off))
  assert rows_on[-1]["budget/compiled_shapes"] <= 2 * 3  # gradient and log-prob passes, 3 buckets each
  assert all(r["budget/microbatches"] >= 2 * r["updates"] for r in rows_on)  # 12 rows never fit one microbatch
  assert {"completion_len/p50", "completion_len/p90", "completion_len/max",
          "completion_len/truncated_frac"} <= set(rows_off[0])


@pytest.mark.slow
def test_hilore_plans_each_microbatch_shape_with_its_own_manager(tmp_path):
  t = Trainer(tiny_config(tmp_path, "memory.policy=hilore", "memory.group_size=8", "memory.buckets=1",
                          "memory.budget_probes=1", "memory.warmup=none", "train.steps=1", "eval.at_start=false",
                          "eval.at_end=false", "grpo.filter_zero_std=false", "rollout.max_new_tokens=7",
                          "train.max_tokens_per_microbatch=40"))
  t.train()
  rows = metrics.read_metrics(tmp_path / "metrics.jsonl")
  grad_shapes = {f"{r}x{6 + cap}" for kind, r, cap in t.packer.shapes if kind == "grad"}
  # one step's microbatches take two shapes (one bucket, one probe: what each manager plans is not this test's)
  assert len(grad_shapes) > 1 and set(t.memory.managers) == grad_shapes  # one manager per compiled shape
  gc_bytes = {k: m.state.gc_bytes for k, m in t.memory.managers.items()}
  assert len(set(gc_bytes.values())) == len(gc_bytes), gc_bytes  # each measured its own shape's GC step
  assert all("alloc/frac_H" in r for r in rows)
  saved = t.memory.state_json()
  fresh = ShapedMemory(lambda: MemoryManager(t.config.memory, t.memory.managers[next(iter(grad_shapes))].hooks))
  fresh.load_state(saved)
  assert fresh.state_json() == saved
