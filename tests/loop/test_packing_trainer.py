"""Packing in the trainer (train.packing): a run with rows packed end to end updates as one without, on fewer
positions, with one compiled program per buffer length; its metrics say how full the buffers were; HiLoRe plans
per buffer length; bad settings are one-line config errors; on an fsdp mesh each device packs its own buffer (and
the token budget's microbatches split over it, beside packing's for one unpacked run)."""

import jax
import numpy as np
import packed_util
import pytest
from trainer_util import stable, tiny_config

from hilore_jax.errors import ConfigError
from hilore_jax.loop import metrics
from hilore_jax.loop.trainer import Trainer
from hilore_jax.rl import packing
from hilore_jax.rl.rollout import Rollout

PACKED = ("train.packing=true", "train.max_tokens_per_microbatch=24", "train.max_tokens_per_logprob_pass=16")
# the token budget without packing: 3 rows at the cap (6 + 7 tokens) per microbatch, log-prob passes of 2
BUDGET = ("train.max_tokens_per_microbatch=40", "train.max_tokens_per_logprob_pass=26")


def test_bad_packing_settings_are_config_errors(tmp_path):
  with pytest.raises(ConfigError, match="train.packing=true packs rows into buffers of train.max_tokens_per_micro"):
    tiny_config(tmp_path, "train.packing=true")
  # a shared prompt's buffer holds completions only: 7 tokens at the cap, the prompt's 6 in the table
  with pytest.raises(ConfigError, match=r"train.max_tokens_per_microbatch \(6\) is smaller than one packed completion "
                                        r"at the cap: rollout.max_new_tokens = 7 tokens"):
    tiny_config(tmp_path, "rollout.max_new_tokens=7", "train.packing=true", "train.max_tokens_per_microbatch=6")
  tiny_config(tmp_path, "rollout.max_new_tokens=7", "train.packing=true", "train.max_tokens_per_microbatch=7")
  with pytest.raises(ConfigError, match=r"train.max_tokens_per_microbatch \(12\) is smaller than one row at the cap"):
    tiny_config(tmp_path, "rollout.max_new_tokens=7", "train.packing=true", "train.max_tokens_per_microbatch=12",
                "train.share_prompt=false")
  with pytest.raises(ConfigError, match="train.shuffle must be one of"):
    tiny_config(tmp_path, "train.shuffle=groups")


def test_memory_units_count_a_buffers_positions_and_its_table_once():
  # what HiLoRe prices a packed microbatch at: its buffer rows, each as long as its positions plus (replicated) the
  # table's prompts shared over them
  import builders

  from hilore_jax.loop import step_hooks
  from hilore_jax.rl import prompt_share, train_step
  from hilore_jax.rl.config import GRPOConfig
  from hilore_jax.rl.update_batch import UpdateBatch

  P, N = 5, 6
  mask = (np.arange(N)[None] < np.array([6, 2, 4, 5, 1, 3])[:, None]).astype(np.int32)
  batch = UpdateBatch(np.arange(1, 7)[:, None].repeat(P, 1).astype(np.int32) // 4 + 1, np.ones((6, P), np.int32),
                      mask * 3, mask, np.ones(6, np.float32))
  cfg = builders.tiny_model(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
  hooks = step_hooks.memory_hooks(None, train_step.StepSpec(cfg, GRPOConfig(), ()))
  for keys in (None, prompt_share.prompt_keys(batch)):
    (buf,) = packing.plan(batch.mask, batch.prompt_mask, (64,), 1, keys, 2)
    packed = packing.gather(batch, buf.arrays())
    U = 0 if keys is None else len(buf.table)
    assert hooks.batch_shape(packed) == (1, 64 + U * P)


def test_a_step_reduces_allocations_of_managers_in_different_phases():
  # a buffer length met first this step warms up (no plan metrics yet) while another plans: each key over the rows
  # that report it (a KeyError ended the tiny default's packed run at step 4 before)
  planning = {"alloc/frac_H": 0.5, "alloc/greedy_gap": 0.1, "memory/compiled_bytes": 7, "time/plan_fit_s": 1.0}
  warming = {"alloc/frac_H": 0.0, "memory/compiled_bytes": 9, "time/plan_fit_s": 2.0}
  assert metrics.reduce_allocations([planning, warming]) == {"alloc/frac_H": 0.25, "alloc/greedy_gap": 0.1,
                                                             "memory/compiled_bytes": 9, "time/plan_fit_s": 3.0}


def _rollout(lengths) -> Rollout:
  """The tiny config's 3 prompts x 4 completions (of up to 3 tokens), each group's rewards not all equal."""
  B, P, N = 12, 6, 3
  mask = (np.arange(N)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  prompts = (np.repeat(np.arange(3), 4)[:, None] * 7 + np.arange(P)[None]) % 70 + 3
  rewards = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 1], np.float32)
  return Rollout(prompts.astype(np.int32), np.ones((B, P), np.int32), np.full((B, N), 5, np.int32) * mask, mask,
                 np.zeros((B, N), np.float32), [""] * B, rewards)


@pytest.mark.slow  # a trainer; the quick tier checks the fallback's rule in tests/rl/test_packing.py
def test_rows_that_packing_would_not_shorten_run_padded(tmp_path):
  # 12 rows at the 3-token cap: two buffers of 18 and their tables (2 x (18 + 4 x 6)) compute what two padded
  # microbatches of 6 rows x 3 and theirs do: nothing to save, so the update runs the padded bucket's program and no
  # buffer compiles; ragged rows then pack (17 tokens in one buffer of 18 against 2 x 6 rows x 3 padded)
  t = Trainer(tiny_config(tmp_path, "train.packing=true", "train.max_tokens_per_microbatch=18", "memory.policy=gc",
                          "eval.at_start=false", "eval.at_end=false"))
  row = t.update(_rollout([3] * 12), 0)
  assert t.packer.shapes == {("grad", 6, 3)} and row["budget/packed_frac"] == 0.0
  assert row["tokens/computed"] == 2 * (6 * 3 + 4 * 6) and row["budget/microbatches"] == 2
  row = t.update(_rollout([3, 1, 1, 1, 2, 1, 1, 1, 3, 1, 1, 1]), 1)
  assert t.packer.shapes == {("grad", 6, 3), ("grad", 1, 18)} and row["budget/packed_frac"] == 1.0
  assert row["tokens/computed"] == 18 + 4 * 6 and row["budget/compiled_shapes"] == 2


def test_rows_at_the_cap_in_one_microbatch_run_the_step_without_a_budget(tmp_path):
  # a budget of 36 holds the 12 rows at the cap in one buffer or one padded microbatch of 12 x 3: the minibatch
  # itself, so the step without a budget runs it (no gather, no accumulator) and neither program compiles
  t = Trainer(tiny_config(tmp_path, "train.packing=true", "train.max_tokens_per_microbatch=36", "memory.policy=gc",
                          "eval.at_start=false", "eval.at_end=false"))
  before = t.stepper.compile_count
  row = t.update(_rollout([3] * 12), 0)
  assert t.packer.shapes == set() and t.stepper.compile_count == before + 1, t.stepper.compile_log
  assert row["budget/packed_frac"] == 0.0 and row["tokens/computed"] == 12 * 3 + 4 * 6


@pytest.mark.slow
def test_a_packed_run_updates_as_an_unpacked_one_on_fewer_positions(tmp_path, tmp_path_factory):
  off, rows_off = packed_util.unpacked(tmp_path_factory)
  on, rows_on = packed_util.run(tmp_path / "on", *PACKED)
  assert off.packer is None
  volatile = ("budget/", "tokens/computed", "tokens/real", "tokens/fill", "memory/")
  for a, b in zip(stable(rows_off), stable(rows_on)):
    assert {k for k in a if not k.startswith(volatile)} == {k for k in b if not k.startswith(volatile)}
    for k, v in a.items():
      if isinstance(v, float) and not k.startswith(volatile):
        np.testing.assert_allclose(b[k], v, rtol=2e-4, atol=1e-6, err_msg=k)
    # fewer positions, fuller: the same tokens with less padding
    assert b["tokens/computed"] < a["tokens/computed"] and b["tokens/fill"] > a["tokens/fill"]
    assert b["tokens/real"] <= b["tokens/computed"] and b["tokens/unshared"] == a["tokens/unshared"]
  for x, y in zip(jax.tree.leaves(on.state["params"]), jax.tree.leaves(off.state["params"])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
  # one program per buffer length and pass, whatever the mix of lengths
  lengths = {"grad": set(packing.sizes(24, 3)), "logp": set(packing.sizes(16, 3))}
  assert all(L in lengths[kind] and S == 1 for kind, S, L in on.packer.shapes), on.packer.shapes
  assert rows_on[-1]["budget/compiled_shapes"] == len(on.packer.shapes) <= 6


@pytest.mark.slow
def test_a_packed_lora_run_updates_as_an_unpacked_one(tmp_path):
  # LoRA's adapters over a frozen base (its reference is the base itself): the packed buffers' gradients reach the
  # adapters as the padded rows' do, and the base stays as it was
  from hilore_jax.model import lora

  lora_run = ("lora.rank=3", "lora.alpha=6")
  off, rows_off = packed_util.run(tmp_path / "off", *lora_run)
  on, rows_on = packed_util.run(tmp_path / "on", *lora_run, *PACKED, "train.packing_granule=8")
  assert off.packer is None and rows_on[-1]["budget/packed_frac"] > 0
  for a, b in zip(stable(rows_off), stable(rows_on)):
    for k in ("loss", "grad_norm", "entropy", "kl", "clipfrac"):
      np.testing.assert_allclose(b[k], a[k], rtol=2e-4, atol=1e-6, err_msg=k)
    assert b["tokens/computed"] < a["tokens/computed"]
  adapters = lambda t: jax.tree.leaves(lora.trainable(t.state["params"]))
  for x, y in zip(adapters(on), adapters(off)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
  assert all(L % 8 == 0 or L == 24 for kind, _, L in on.packer.shapes if kind == "grad"), on.packer.shapes


@pytest.mark.slow
def test_hilore_plans_each_buffer_length_with_its_own_manager(tmp_path):
  t = Trainer(tiny_config(tmp_path, "memory.policy=hilore", "memory.group_size=8", "memory.buckets=1",
                          "memory.budget_probes=1", "memory.warmup=none", "train.steps=1", "eval.at_start=false",
                          "eval.at_end=false", "grpo.filter_zero_std=false", "rollout.max_new_tokens=7",
                          "train.packing=true", "train.max_tokens_per_microbatch=24"))
  t.train()
  rows = metrics.read_metrics(tmp_path / "metrics.jsonl")
  used = {f"packed 1x{L}" for kind, _, L in t.packer.shapes if kind == "grad"}
  # one step packs buffers of two lengths: two managers, each set up on its own (one bucket, one probe: what each
  # plans is not this test's)
  assert len(used) > 1 and set(t.memory.managers) == used
  assert all("alloc/frac_H" in r and 0 < r["tokens/fill"] <= 1 for r in rows)


@pytest.fixture(scope="module")
def on_fsdp(tmp_path_factory):
  """Packing and the token budget's microbatches on a 1 x 2 fsdp mesh: one subprocess, one unpacked run for both."""
  return packed_util.updates_on_fsdp(tmp_path_factory.mktemp("fsdp"), {"packed": PACKED, "budget": BUDGET})


@pytest.mark.slow
def test_packed_buffers_split_over_an_fsdp_mesh_update_as_unpacked(on_fsdp):
  packed = on_fsdp["packed"]
  assert packed["params_match"] and {S for _, S, _ in packed["shapes"]} == {2}, packed  # a row per device


@pytest.mark.slow
def test_budgeted_microbatches_split_over_an_fsdp_mesh_update_as_unpacked(on_fsdp):
  # the token budget's (rl/token_budget.py, tests/loop/test_token_budget.py): here, beside packing's, for one
  # unpacked run on the mesh
  budget = on_fsdp["budget"]
  assert budget["params_match"], budget
  assert all(r % 2 == 0 for _, r, _ in budget["shapes"]), budget  # rows split over both devices
  assert min(cap for _, _, cap in budget["shapes"]) < 7, budget
