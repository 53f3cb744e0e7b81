"""experiments.optim.main (optimizer, gradient and step bytes, AdamW vs LoGRA) and experiments.kl.main (predicted vs
realised KL of a run)."""

import json
import math
import os

import jax
import numpy as np
import pytest

from hilore_jax import model
from experiments.common import config as bench_config
from experiments.kl import run as kl
from experiments.optim import run as optim_memory
from hilore_jax.errors import DataError

HIDDEN = 24
SHAPE = [f"model.hidden_size={HIDDEN}", "model.vocab_size=37", "model.intermediate_size=40",
         "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
         "bench.batch_size=4", "bench.group_size=2", "bench.seq_len=15", "bench.prompt_len=5",
         "optimizer.logra.refresh_every=10"]


@pytest.mark.slow
def test_bench_optim_rows_add_up_and_logra_state_is_small(tmp_path):
  cfg, bc = bench_config.load(None, SHAPE, "bench")
  result = optim_memory.run(cfg, bc, str(tmp_path), ranks=(3,), memories=("gc",), progress=lambda s: None)
  assert sorted(os.listdir(tmp_path)) == ["optim.json", "optim.md"]
  by = {r["optimizer"]: r for r in json.load(open(tmp_path / "optim.json"))["rows"]}
  assert list(by) == ["adamw", "logra r=3", "logra r=3 + kl"]  # hidden/8 = 3 is also the KL arm's rank
  adamw, lo, kl = by["adamw"], by["logra r=3"], by["logra r=3 + kl"]
  # independent count: AdamW keeps two float32 moments of every param with >= 2 dims
  shapes = jax.eval_shape(lambda: model.init_params(cfg.model.shape_config(), jax.random.PRNGKey(0)))
  mats = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes) if len(s.shape) >= 2)
  assert adamw["opt_2d_bytes"] == 2 * 4 * mats
  assert 0 <= adamw["grad_bytes"] - adamw["params_bytes"] < 1024  # float32 gradients (+ the step's scalar metrics)
  for r in by.values():
    assert r["total_bytes"] == r["params_bytes"] + r["opt_state_bytes"] + r["peak_bytes"]
    assert r["peak_bytes"] == max(r["grad_temp_bytes"], r["update_temp_bytes"]) + r["grad_bytes"]
  assert lo["opt_state_bytes"] < adamw["opt_state_bytes"] and lo["sketched_vs_adamw_pct"] < 50
  assert lo["grad_bytes"] == adamw["grad_bytes"]  # gradients stay dense between the two programs
  assert lo["ship_sketch_bytes"] < lo["ship_dense_bytes"] == adamw["params_bytes"]
  assert kl["update_temp_bytes"] > lo["update_temp_bytes"]  # the KL's forward and JVP are counted
  assert "| logra r=3 | gc |" in optim_memory.report(result)


def _rows(pred, scale, real):
  return [{"step": 1, "kl_control/predicted_per_update": pred[:2], "kl_control/scale_per_update": scale[:2],
           "kl_control/realized_per_update": real[:2]},
          {"step": 2, "kl_control/predicted_per_update": pred[2:], "kl_control/scale_per_update": scale[2:],
           "kl_control/realized_per_update": real[2:]}]


def test_kl_report_compares_the_applied_updates_prediction(tmp_path):
  pred, scale = [2.0**-10, 2.0**-8, 2.0**-9, 2.0**-6], [1.0, 0.5, 1.0, 0.25]  # powers of two: exact ties
  applied = np.array([2.0**-10, 2.0**-10, 2.0**-9, 2.0**-10])  # s^2 * predicted
  real = list(applied * [1.0, 1.1, 0.9, 1.2])  # ranks 1, 2, 4, 3
  got_pred, got_real = kl.pairs(_rows(pred, scale, real))
  np.testing.assert_allclose(got_pred, applied)
  np.testing.assert_allclose(got_real, real)
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in _rows(pred, scale, real))
  result = kl.run(str(tmp_path))
  assert result["updates"] == 4 and os.path.exists(tmp_path / "kl_scatter.png")
  # ranks: applied prediction 2, 2, 4, 2 (ties averaged) vs realised 1, 2, 4, 3: cov 3 / sqrt(3 * 5)
  assert result["spearman"] == pytest.approx(3 / np.sqrt(15), abs=1e-9)
  with pytest.raises(DataError, match="0 updates with kl_control metrics"):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    kl.run(str(tmp_path / "x"))
