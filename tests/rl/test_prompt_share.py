"""A group's prompt computed once (rl/prompt_share.py, model/shared.py): log-probs, loss and gradient equal the
unshared computation (float32, relative 1e-5) under every loss aggregation, both attention kernels, left-padded
prompts, partial groups and microbatches; the compiled gradient program computes the prompt once."""

import builders
import jax
import numpy as np
import pytest
from tolerance import assert_close, assert_trees_close

from hilore_jax import model
from hilore_jax.rl import grpo, prompt_share, train_step
from hilore_jax.rl.config import GRPOConfig

CFG = builders.tiny_model(vocab_size=61, hidden_size=32, intermediate_size=43, num_hidden_layers=3, attention_block_q=4,
                          attention_block_k=5)
P, N = 7, 11
ULPS = 84  # relative 1e-5 in float32 steps
# rows in order: slice 1 holds prompts 0, 1, 2 (group 2 split over both slices), slice 2 prompts 2, 3, 4; partial
# groups of any size from 1 work
ORDER = (0, 2, 1, 0, 2, 0, 3, 2, 4, 3, 2, 4)


def _batch(rng=np.random.default_rng(0), order=ORDER, P=P, N=N):
  rows = np.asarray(order)
  prompt_lens = rng.integers(1, P + 1, rows.max() + 1)  # left padding: prompts of 1..P real tokens
  lengths = rng.integers(1, N + 1, len(rows))
  lengths[-1] = 0  # a padding row (a short last minibatch)
  return builders.update_batch(rng, P, N, 61, lengths, order=rows, prompt_lens=prompt_lens)


def _params():
  return builders.params(CFG)


def test_the_table_holds_each_slice_distinct_prompts_once():
  batch = _batch()
  shared = prompt_share.share_prompts(batch, microbatches=2)
  table, index = shared.prompt_table, shared.prompt_index
  assert table.shape[0] % 2 == 0 and table.shape[0] < batch.rows
  U = table.shape[0] // 2
  assert U == 4  # 3 distinct prompts per slice, rounded up
  for j in range(2):  # every row finds its own prompt in its own slice's entries
    for i in range(j * 6, j * 6 + 6):
      np.testing.assert_array_equal(table[j * U + index[i]], batch.prompt_ids[i])
      np.testing.assert_array_equal(shared.prompt_table_mask[j * U + index[i]], batch.prompt_mask[i])
  # all-distinct rows stay unshared: a table would compute as much
  single = _batch(order=(0, 1, 2, 3))
  assert not prompt_share.shared(prompt_share.share_prompts(single))
  assert prompt_share.token_counts(shared) == (8 * P + 12 * N, 12 * (P + N))


# both kernels under token-mean; the other aggregations weigh the same per-row log-probs by the mask whatever the
# kernel, so they run under blockwise alone. One combination in the quick tier (-m "not slow"; a shared prompt under
# blockwise runs there in test_packing.py), the rest in the full run
QUICK = {("token-mean", "xla")}
GRID = [pytest.param(agg, attention, marks=() if (agg, attention) in QUICK else pytest.mark.slow)
        for agg in grpo.LOSS_AGGS for attention in ("xla", "blockwise") if agg == "token-mean" or attention != "xla"]


@pytest.mark.parametrize("loss_agg,attention", GRID)
def test_shared_logprobs_loss_and_gradient_equal_unshared(attention, loss_agg):
  cfg = CFG.replace(attention=attention)
  params = _params()
  batch = _batch()
  shared = prompt_share.share_prompts(batch, microbatches=2)
  assert prompt_share.shared(shared)
  # one policy (the layer scan) and a mixed plan (unrolled layers): the loss aggregation never meets the plan (it
  # weighs the log-probs the layers give by the mask), so the full run's other combinations check the scan alone
  plans = (model.uniform(3, model.FULL_REMAT), (model.NO_REMAT, model.FULL_REMAT, model.NO_REMAT))
  for policies in plans if (loss_agg, attention) in QUICK else plans[:1]:
    spec = train_step.StepSpec(cfg, GRPOConfig(loss_agg=loss_agg, max_completion_len=N), policies, microbatches=2)
    run = jax.jit(lambda p, b: train_step.grads_and_stats(p, b, spec))
    (g_ref, s_ref), (g, s) = run(params, batch), run(params, shared)
    mask = batch.mask > 0
    assert_close(np.where(mask, s["token_logp"], 0), np.where(mask, s_ref["token_logp"], 0), ULPS)
    assert_close(s["loss"], s_ref["loss"], ULPS, scale=max(abs(float(s_ref["loss"])), 1e-3))
    assert_trees_close(g, g_ref, ULPS, scale="tree")
    assert float(s_ref["loss"]) != 0.0
  # the forward the old and reference log-probs come from
  fwd = jax.jit(lambda p, b: train_step.sequence_logprobs(spec, p, b))
  assert_close(np.where(mask, fwd(params, shared), 0), np.where(mask, fwd(params, batch), 0), ULPS)


def test_the_compiled_gradient_computes_each_prompt_once():
  # 2 prompts x 4 completions, prompt 48, completions 8: unshared the program runs 8 x 56 positions, shared
  # 2 x 48 + 8 x 8 = 160 of 448 (0.36). Fails with sharing switched off (share_prompts returning the batch)
  batch = _batch(order=(0, 1, 0, 0, 1, 1, 0, 1), P=48, N=8)
  spec = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(3, model.FULL_REMAT))
  flops = lambda b: jax.jit(lambda p, b: train_step.grads_and_stats(p, b, spec)).lower(
      jax.eval_shape(_params), b).compile().cost_analysis()["flops"]
  shared = prompt_share.share_prompts(batch)
  computed, unshared = prompt_share.token_counts(shared)
  assert computed / unshared < 0.4
  assert flops(shared) < 0.5 * flops(batch)


def test_memory_units_count_the_prompt_once():
  # what the planner prices (units at the hooks' activation shape) follows what the compiled program keeps: the
  # bytes no-remat keeps beyond full checkpointing, shared against unshared
  from hilore_jax.memory import profile

  batch = _batch(order=(0,) * 8 + (1,) * 8, P=24, N=8)
  shared = prompt_share.share_prompts(batch)
  shapes = {m: prompt_share.activation_shape(b, 1, 1) for m, b in (("u", batch), ("s", shared))}
  assert shapes["u"] == (16, 32) and shapes["s"] == (16, -(-(2 * 24 + 16 * 8) // 16))
  units = {m: sum(u.bytes_h for u in profile.enumerate_units(CFG, *shapes[m]) if u.kind != model.ATTN_PROBS)
           for m in shapes}

  def kept(b):
    temp = lambda pol: jax.jit(lambda p, b: train_step.grads_and_stats(p, b, train_step.StepSpec(
        CFG.replace(attention="blockwise"), GRPOConfig(), model.uniform(3, pol)))[0]).lower(
        jax.eval_shape(_params), b).compile().memory_analysis().temp_size_in_bytes
    return temp(model.NO_REMAT) - temp(model.FULL_REMAT)

  # measured 0.344 and 0.411: the units leave out the prompt's k, v that each row's attention keeps gathered (K x H
  # of a position's ~10 x D units here, ~4% at SmolLM2's shape). Counting every row's prompt (the unshared shape)
  # would predict 1.0
  predicted, compiled = units["s"] / units["u"], kept(shared) / kept(batch)
  assert compiled < 0.5 and abs(predicted - compiled) < 0.2 * compiled, (predicted, compiled)


@pytest.mark.slow  # two trainers; the quick tier shares in the gradient program itself (above)
def test_the_trainer_shares_by_default_and_one_switch_turns_it_off(tmp_path):
  from trainer_util import tiny_config

  from hilore_jax.rl.rollout import Rollout
  from hilore_jax.loop.trainer import Trainer

  rng = np.random.default_rng(1)
  B, G, P, N = 12, 4, 6, 3
  pmask = np.ones((B, P), np.int32)
  pmask[:G, :2] = 0  # a left-padded prompt
  roll = Rollout(np.repeat(rng.integers(3, 80, (B // G, P)), G, 0).astype(np.int32) * pmask, pmask,
                 rng.integers(3, 80, (B, N)).astype(np.int32), np.ones((B, N), np.int32), np.zeros((B, N)),
                 [""] * B, rng.integers(0, 2, B).astype(np.float32))
  rows = {}
  for name, extra in (("on", ()), ("off", ("train.share_prompt=false",))):
    t = Trainer(tiny_config(tmp_path / name, "train.warmstart_steps=0", "grpo.filter_zero_std=false", *extra))
    rows[name] = t.update(roll, 0)
  on, off = rows["on"], rows["off"]
  assert on["tokens/unshared"] == off["tokens/unshared"] == off["tokens/computed"] == B * (P + N)
  assert on["tokens/computed"] == 4 * P + B * N  # 3 prompts in a table of 4, every row's completion
  for k in ("loss", "grad_norm", "entropy"):
    assert_close(on[k], off[k], ULPS, scale=abs(off[k]), err_msg=k)


def test_calibration_rows_of_a_shared_batch_unshare_it():
  # the table indexes every row of a slice: a row subset (calibration's calib_rows) computes its own prompts
  from hilore_jax.memory import calibration

  shared = prompt_share.share_prompts(_batch(), microbatches=2)
  part = calibration.calibration_rows(shared, 5)
  assert not prompt_share.shared(part) and part.rows == 5
  np.testing.assert_array_equal(part.prompt_ids, shared.prompt_ids[:5])
  assert calibration.calibration_rows(shared, 0) is shared


def test_kl_control_reads_the_table_and_predicts_the_same_kl():
  from hilore_jax.rl import kl_control

  params = _params()
  updates = jax.tree.map(lambda p: 1e-2 * jax.random.normal(jax.random.PRNGKey(3), p.shape, p.dtype), params)
  batch = _batch()
  shared = prompt_share.share_prompts(batch, microbatches=2)
  spec = train_step.StepSpec(CFG, GRPOConfig(), model.uniform(3, model.NO_REMAT), microbatches=2)
  for kl_fn in (kl_control.predicted_kl, kl_control.realized_kl):
    kl = jax.jit(lambda p, u, b: train_step.minibatch_kl(kl_fn, spec, p, u, b, 8))
    want = float(kl(params, updates, batch.sequences()))
    assert want > 0
    assert_close(float(kl(params, updates, shared.sequences())), want, ULPS, scale=want)
