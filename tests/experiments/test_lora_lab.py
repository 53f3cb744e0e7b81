"""The LoRA lab's entry points on a tiny model: the memory table (compile-only) and the sampler's two ways."""

import json

import pytest
from trainer_util import TINY

from experiments.lora import memory as lora_memory, sampler as lora_sampler


def test_lora_memory_counts_the_adapters_state_and_no_reference_copy(tmp_path, capsys):
  lora_memory.main(["--out", str(tmp_path), "--shapes", "", "--beta", "0.04", *TINY, "lora.rank=2", "lora.alpha=4"])
  (row,) = json.load(open(tmp_path / "lora_memory.json"))
  full, lora = row["full"], row["lora"]
  assert full["reference_bytes"] == full["params_bytes"] and lora["reference_bytes"] == 0  # the base is it
  assert lora["params_bytes"] > full["params_bytes"]  # the base plus the adapters
  assert lora["optimizer_bytes"] == 2 * 4 * lora["trained_params"] + 8  # AdamW's moments of the adapters, 2 counts
  assert full["optimizer_bytes"] == 2 * full["params_bytes"] + 8
  # no weight gradient of the frozen projections, embeddings or norms: fewer matmul FLOPs
  assert lora["grad_matmul_flops"] < full["grad_matmul_flops"]
  assert "LoRA r2" in capsys.readouterr().out


@pytest.mark.slow
def test_lora_sampler_times_both_ways_and_the_merge_keeps_the_log_probs(tmp_path):
  lora_sampler.main(["--out", str(tmp_path), "--rollouts", "2", *TINY, "lora.rank=3", "train.warmstart_steps=0"])
  out = json.load(open(tmp_path / "lora_sampler.json"))
  assert len(out["seconds"]["merged"]) == len(out["seconds"]["unmerged"]) == 2
  assert out["max_abs_logp_gap"] <= 1e-5
