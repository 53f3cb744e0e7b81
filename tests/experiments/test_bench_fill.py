"""The fill bench: settings compared on the same rollouts by the positions their updates compute (no timing)."""

import json

import pytest

from trainer_util import TINY

from experiments.budget import fill as bench_fill
from hilore_jax.rl import packing

# warm-started: completions stop before the cap, so rows differ in length
BASE = [o for o in TINY if not o.startswith("eval.")] + ["grpo.filter_zero_std=false", "rollout.max_new_tokens=7"]


@pytest.mark.slow
def test_packed_rows_fill_more_of_what_they_compute(tmp_path, capsys):
  # packed always (train.packing_min_saving=0): what packing itself fills, where it saves less than 10% too
  out = bench_fill.fill(None, [*BASE, f"out_dir={tmp_path}"], [
      ("padded", ()), ("packed", ("train.packing=true", "train.max_tokens_per_microbatch=84",
                                  "train.packing_min_saving=0"))], rollouts=2)
  padded, packed = out["arms"]["padded"], out["arms"]["packed"]
  assert packed["packed_frac"] == 1.0 and padded["packed_frac"] == 0.0
  assert padded["unshared"] == packed["unshared"] == 2 * 12 * (6 + 7)  # 2 rollouts of 12 rows, one pass
  assert packed["computed"] < padded["computed"] and 0 < padded["fill"] < packed["fill"] <= 1
  assert padded["shapes"] == [] and {L for _, L in packed["shapes"]} <= set(packing.sizes(84, 3))
  bench_fill.main(["--rollouts", "1", "--out", str(tmp_path / "fill.json"), "--arm", "padded:", "--arm",
                   "packed:train.packing=true,train.max_tokens_per_microbatch=84", *BASE, f"out_dir={tmp_path}"])
  assert "| packed |" in capsys.readouterr().out
  assert set(json.load(open(tmp_path / "fill.json"))["arms"]) == {"padded", "packed"}
