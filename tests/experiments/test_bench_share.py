"""python -m experiments.share.main: the update's compiled FLOPs and peak, a group's prompt computed once against once
per row (experiments/share/run.py), at a tiny shape."""

import json

import pytest
from trainer_util import TINY

from experiments.share import main as bench_share


@pytest.mark.slow  # the harness end to end (tests/rl/test_prompt_share.py checks the shared step in the quick tier)
def test_bench_share_writes_the_figures(tmp_path, capsys):
  out = tmp_path / "share.json"
  model = [o for o in TINY if o.startswith("model.")]
  bench_share.main(["--prompts", "2", "--generations", "4", "--prompt-len", "24", "--completion-len", "4",
                    "--out", str(out), *model])
  row = json.loads(out.read_text())
  assert row["tokens/shared"] == 2 * 24 + 8 * 4 and row["tokens/unshared"] == 8 * 28
  for policy in ("none", "gc"):
    ratio = row[f"{policy}/ratio"]
    assert ratio["matmul_flops"] < 0.75 and ratio["xla_flops"] < 1.0, (policy, ratio)
  assert row["none/ratio"]["peak_bytes"] < 1.0
  assert "shared / unshared" in capsys.readouterr().out
