"""The sampler's FLOP figures with the prompt prefilled once per group (experiments/sampler/prefill_flops.py)."""

import pathlib

from experiments.sampler import prefill_flops
import repo

TINY = str(pathlib.Path(repo.ROOT) / "configs" / "tiny.yaml")


def test_bench_prefill_counts_the_prefill_once_per_group(capsys):
  from experiments.sampler import prefill as bench_prefill

  bench_prefill.main(["--config", TINY, "rollout.num_prompts=3", "rollout.num_generations=5",
                      "rollout.max_prompt_len=7", "rollout.max_new_tokens=4", "train.minibatch_size=15"])
  assert "3 prompts x G=5, prompt 7, 4 new tokens" in capsys.readouterr().out


def test_prefill_flops_are_the_only_difference(tiny_cfg):
  r = prefill_flops.sampler_flops(tiny_cfg, num_prompts=3, num_generations=5, prompt_len=7, new_tokens=4)
  # matmul counts are linear in the rows: the prefill on 15 rows is 5 times the one on 3, and it is all that differs
  assert r["matmul/prefill_repeated"] == 5 * r["matmul/prefill_shared"] > 0
  assert (r["matmul/start_repeated"] - r["matmul/start_shared"]
          == r["matmul/prefill_repeated"] - r["matmul/prefill_shared"])
  assert r["matmul/call_repeated"] == r["matmul/start_repeated"] + 3 * r["matmul/decode_step"] > 0
  assert r["xla/start_shared"] < r["xla/start_repeated"]
  assert "| jaxpr matmuls | once per group |" in prefill_flops.table(r)
