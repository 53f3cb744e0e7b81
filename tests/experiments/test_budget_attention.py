"""The packed attention bench: its arms agree with xla, its packed arm runs the band, and it prints its table
(tiny shapes)."""

import json

from experiments.budget import attention as bench
from hilore_jax.model import key_blocks


def test_the_attention_bench_runs_its_arms(tmp_path, capsys):
  lens = bench.buffer_rows(70, 16)
  assert sum(lens) <= 70 and max(lens) <= 16 and lens == sorted(lens, reverse=True)
  out = bench.run(70, 16, 6, 2, 4, reps=1, skip=())
  assert out["positions"] == {"band": 70, "dense": 70, "xla_buffer": 70, "padded_xla": 16 * len(lens)}
  assert max(out["max_grad_err_vs_xla"].values()) < 1e-5
  assert key_blocks.schedule(70, 2 * 6 + 70, 4, 4, 16).band  # what the band arm's kernel visits
  assert set(out["median_s"]) == set(out["temp_bytes"]) == {"band", "dense", "xla_buffer", "padded_xla"}
  bench.main(["--reps", "1", "--buffer", "70", "--cap", "16", "--prompt", "6", "--block", "4", "--out",
              str(tmp_path / "a.json")])
  assert "| band | 70 |" in capsys.readouterr().out
  assert set(json.load(open(tmp_path / "a.json"))["median_s"]) == {"band", "dense", "padded_xla"}  # xla: compiled
