"""The shared prompt inside the token budget's packed microbatches (token_budget.share, packed_step.py): each
microbatch gathers a table of its own rows' distinct prompts, and loss, gradient and log-probs equal the unpacked,
unshared minibatch's (float32, relative 1e-5), with left padding and partial groups; the
packed program computes each prompt once; a run with both on updates as one with both off."""

import builders
import jax
import numpy as np
import packed_util
import pytest
from trainer_util import stable

from hilore_jax import model
from hilore_jax.loop import packed_step
from hilore_jax.rl import prompt_share, token_budget, train_step
from hilore_jax.rl.config import GRPOConfig
from hilore_jax.rl.update_batch import UpdateBatch

CFG = builders.tiny_model()
P, N = 5, 13
# 13 rows of 5 prompts (partial groups of 1..4 rows, as a shuffled minibatch holds them) and their completion lengths
# (0: a short minibatch's padding row)
ORDER = np.array([0, 2, 1, 0, 2, 0, 3, 2, 4, 3, 2, 0, 1])
LENGTHS = np.array([13, 2, 0, 7, 1, 13, 4, 3, 12, 2, 5, 6, 1])
BUDGET = 5 * (P + N)  # 5 rows at the cap, 7 at 7 tokens, 10 at 4


def _batch(rng=np.random.default_rng(0), order=ORDER, lengths=LENGTHS, P=P, N=N, **kw) -> UpdateBatch:
  # left-padded prompts of 2..P tokens; about a third of the rows fresh (on_policy)
  return builders.update_batch(rng, P, N, 31, lengths, order=order, prompt_lens=rng.integers(2, P + 1, order.max() + 1),
                               old_logp=True, on_policy=rng.uniform(size=len(order)) < 0.3, **kw)


def _micros(batch, budget=BUDGET, distinct=0):
  plan = token_budget.plan(batch.mask.sum(1), batch.prompt_len, token_budget.bucket_caps(batch.completion_len, 3),
                           budget, batch.rows)
  return token_budget.share(plan, prompt_share.prompt_keys(batch), distinct)


def test_each_microbatch_tables_the_distinct_prompts_of_its_own_rows():
  batch = _batch()
  keys = prompt_share.prompt_keys(batch)
  np.testing.assert_array_equal(keys[:, None] == keys[None], ORDER[:, None] == ORDER[None])  # one id a prompt
  micros = _micros(batch)
  shared = [m for m in micros if m.table is not None]
  assert shared
  for m in shared:
    distinct = len(set(keys[m.rows].tolist()))
    assert len(m.table) == prompt_share.table_size(distinct, len(m.rows)) < len(m.rows)
    assert m.key == (*m.shape, len(m.table))
    # every slot (dummy slots too) finds its own prompt in its microbatch's table
    np.testing.assert_array_equal(batch.prompt_ids[m.table[m.index]], batch.prompt_ids[m.rows])
    np.testing.assert_array_equal(batch.prompt_mask[m.table[m.index]], batch.prompt_mask[m.rows])
  # a run-wide bound fixes the table length per row count (one compiled shape), and a table not below the rows
  # leaves the microbatch unshared
  for m in _micros(batch, distinct=4):
    assert m.table is None if len(m.rows) <= 4 else len(m.table) == 4
  assert all(m.table is None for m in _micros(batch, distinct=8))
  # the positions a shared microbatch computes: its table's prompts once, every row's completion up to the cap
  assert token_budget.computed_positions(micros, P) == sum(
      len(m.rows) * (P + m.cap) if m.table is None else len(m.table) * P + len(m.rows) * m.cap for m in micros)
  assert token_budget.computed_positions(micros, P) < token_budget.positions(micros, P)


@pytest.mark.slow  # the quick tier packs a shared minibatch in tests/rl/test_packing.py (blockwise-shared)
def test_packed_shared_loss_gradient_and_logprobs_equal_the_unpacked_unshared_minibatch():
  # one aggregation: the shared table touches the prompt side only, and each loss aggregation is checked packed
  # (test_token_budget.py) and shared (tests/rl/test_prompt_share.py); the per-row mean reads each row's own tokens
  spec = packed_util.spec(CFG, "seq-mean-token-mean", N)
  params = builders.params(CFG, 3)
  batch = _batch(ref_logp=True)
  micros = _micros(batch)
  assert {m.cap for m in micros} > {N} and any(m.table is not None for m in micros)
  # the trainer's minibatch carries its own table (the unpacked passes read it); each microbatch gathers its own
  placed = prompt_share.share_prompts(batch)
  assert prompt_share.shared(placed)
  want_m = packed_util.assert_packed_equals_unpacked(params, batch, placed, micros, spec)
  assert float(want_m["loss"]) != 0.0
  st = packed_util.stepper(params)
  mask = batch.mask > 0
  # the packed log-prob pass (its own plan, larger microbatches) against the unpacked, unshared forward
  want = np.asarray(st.logprobs(spec, params, batch))[mask]
  logp_micros = _micros(batch, 2 * BUDGET)
  assert any(m.table is not None for m in logp_micros)
  got = packed_step.PackedStepper(st).logprobs(spec, params, placed, logp_micros)
  np.testing.assert_allclose(np.asarray(got)[mask], want, rtol=1e-5)


def test_the_packed_program_computes_each_prompt_once():
  # 2 prompts x 4 rows, prompt 48, completions up to 8, one microbatch of the 8 rows: unshared it runs 8 x 56
  # positions, shared 2 x 48 + 8 x 8 = 160 (0.36). Fails with sharing switched off inside packed microbatches
  order = np.array([0, 1, 0, 0, 1, 1, 0, 1])
  batch = _batch(order=order, lengths=np.array([8, 3, 5, 8, 1, 7, 2, 6]), P=48, N=8)
  micros = _micros(batch, budget=8 * 56)
  assert len(micros) == 1 and micros[0].key == (8, 8, 2)
  params = builders.params(CFG, 3)
  packer = packed_step.PackedStepper(packed_util.stepper(params))
  spec = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(CFG.num_hidden_layers, model.FULL_REMAT))
  unshared = token_budget.Micro(micros[0].rows, micros[0].live, micros[0].cap)
  flops = {name: packer._gradient(spec, batch, m)[0].cost_analysis()["flops"]
           for name, m in (("shared", micros[0]), ("unshared", unshared))}
  assert flops["shared"] < 0.5 * flops["unshared"], flops
  assert token_budget.step_tokens([batch], [micros]) == (2 * 48 + 8 * 8, 8 * 56)


@pytest.mark.slow
def test_a_run_with_budget_and_sharing_updates_as_one_with_both_off(tmp_path, tmp_path_factory):
  off, rows_off = packed_util.unpacked(tmp_path_factory, "train.share_prompt=false")
  # 6 rows at the cap (6 + 7 tokens), 8 at 4, 10 at 2: tables of 4 for the 3 prompts (the run's bound); the
  # log-prob passes 4 rows at the cap (unshared: a table of 4 is no smaller), 5 at 4, 6 at 2
  on, rows_on = packed_util.run(tmp_path / "on", "train.max_tokens_per_microbatch=80",
                                "train.max_tokens_per_logprob_pass=52")
  assert off.packer is None and not off.config.train.share_prompt and on.config.train.share_prompt
  differ = ("budget/", "completion_len/", "tokens/computed", "tokens/real", "tokens/fill")
  for a, b in zip(stable(rows_off), stable(rows_on)):
    assert {k for k in a if not k.startswith(differ)} == {k for k in b if not k.startswith(differ)}
    for k, v in a.items():
      if isinstance(v, float) and not k.startswith(differ):
        np.testing.assert_allclose(b[k], v, rtol=2e-4, atol=1e-6, err_msg=k)
    assert a["tokens/computed"] == a["tokens/unshared"] == b["tokens/unshared"] > b["tokens/computed"]
  for x, y in zip(jax.tree.leaves(on.state["params"]), jax.tree.leaves(off.state["params"])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
  # packed gradient programs with a table compiled; the log-prob passes ran short buckets (shared: 5 and 6 rows)
  assert any(", 4 prompts" in e["reason"] for e in on.stepper.compile_log), on.stepper.compile_log
  assert min(cap for k, _, cap in on.packer.shapes if k == "logp") < 7, on.packer.shapes
