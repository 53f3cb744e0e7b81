"""The paired A/B bench: both arms timed on the same rollouts from the same state, its ratio and file."""

import json

import pytest
from trainer_util import TINY

from experiments.paired import run as paired

BASE = [o for o in TINY if not o.startswith(("eval.", "train.warmstart"))] + ["memory.policy=gc",
                                                                              "grpo.filter_zero_std=false"]


@pytest.mark.slow  # a whole harness run: two trainers over two rollouts
def test_paired_bench_times_both_arms_on_the_same_rollouts(tmp_path):
  out = paired.run(None, BASE, paired.Arm("xla", ()), paired.Arm("blockwise", ("model.attention=blockwise",)),
                   rollouts=2, reps=2, out_dir=str(tmp_path), sampler=True)
  assert len(out["update_s"]["xla"]) == len(out["update_s"]["blockwise"]) == 4
  assert out["timed_compiles"] == {"xla": 0, "blockwise": 0}  # every rollout's programs compiled before timing
  assert out["update_ratio"]["n"] == 4 and out["update_ratio"]["ci_low"] <= out["update_ratio"]["mean"]
  # the same rollouts and minibatches: both arms updated the same rows
  assert out["rows"]["xla"]["rows_updated"] == out["rows"]["blockwise"]["rows_updated"] == 12
  assert len(out["sampler_s"]["shared"]) == len(out["sampler_s"]["repeated"]) == 4
  assert json.load(open(tmp_path / "paired.json"))["b"]["overrides"] == ["model.attention=blockwise"]
  assert "update blockwise / xla" in paired.table(out)
  # the regime: each rollout's completion lengths, the cap its mask's columns
  (c0, c1) = out["completion_len"]
  assert c0["cap"] == c1["cap"] and 0 < c0["p50"] <= c0["p90"] <= c0["max"] <= c0["cap"]
  assert "rollout 1: completion length p50" in paired.table(out)


def test_paired_bench_refuses_an_arm_with_nothing_to_time(tmp_path):
  base = [o for o in BASE if o != "grpo.filter_zero_std=false"]  # an untrained tiny model: every reward 0
  with pytest.raises(ValueError, match="arm a made no update"):
    paired.run(None, base, paired.Arm("a", ()), paired.Arm("b", ()), 1, 1, str(tmp_path))


@pytest.mark.slow  # three trainers: arm A compiled twice, and the packed arm
def test_the_noise_floor_times_arm_a_compiled_again(tmp_path):
  out = paired.run(None, BASE, paired.Arm("padded", ()), paired.Arm("packed", (
      "train.packing=true", "train.max_tokens_per_microbatch=36")), rollouts=1, reps=2, out_dir=str(tmp_path),
      floor=True)
  assert set(out["update_s"]) == {"padded", "packed", "padded_again"} and out["floor_ratio"]["n"] == 2
  assert "noise floor, padded compiled again / padded" in paired.table(out)
  # the arms' counts: the packed one (12 rows of up to 3 tokens in one buffer of 36) computes no more positions
  rows = out["rows"]
  assert rows["packed"]["tokens/computed"] <= rows["padded"]["tokens/computed"]
  assert rows["padded"] == rows["padded_again"] and 0 < rows["padded"]["tokens/fill"] <= rows["packed"]["tokens/fill"]
