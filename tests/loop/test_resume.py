"""A run resumed from its checkpoint reproduces the uninterrupted run's metrics exactly, with every piece of state
that crosses a checkpoint in play at once: the KL reference, old log-probs over several passes, the replay buffer
(non-empty at the checkpoint), LoGRA's moments and projections (refitted after it) with predicted-KL control, and
HiLoRe's manager state (profile, calibration, buckets). One run, interrupted and continued, instead of one per
feature."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from trainer_util import stable, tiny_config

from hilore_jax import model
from hilore_jax.loop import metrics
from hilore_jax.optim import logra
from hilore_jax.rl.replay import STAT_KEYS
from hilore_jax.loop.trainer import Trainer

# 5 prompts x 4 = 20 fresh rows + replay's share, 2 passes over minibatches of 10: several updates a step; LoGRA
# refits every 3 updates, so the resumed half refits from restored moments and P
COMMON = ["train.steps=4", "checkpoint.every=2", "grpo.num_iterations=2", "train.minibatch_size=10",
          "rollout.num_prompts=5", "grpo.beta=0.05", "grpo.filter_zero_std=false",
          "replay.enabled=true", "replay.share=0.5", "replay.tau_max=2",
          "optimizer.kind=logra", "optimizer.logra.rank=3", "optimizer.logra.refresh_every=3",
          "optimizer.kl_control.target=0.001", "optimizer.kl_control.chunk=2",
          "memory.policy=hilore", "memory.group_size=8", "memory.buckets=3", "memory.budget_probes=2",
          "memory.budget_ratio=1.02", "memory.warmup=none"]


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_uninterrupted_metrics(tmp_path):
  Trainer(tiny_config(tmp_path / "a", *COMMON)).train()
  full = metrics.read_metrics(tmp_path / "a" / "metrics.jsonl")
  assert len(full) == 4 and all(r["updates"] > 0 for r in full)  # the comparison covers real updates
  # every feature acted in the compared steps
  assert all(set(STAT_KEYS) <= set(r) for r in full) and all(r["replay/age_max"] <= 2 for r in full)
  assert full[1]["replay/size"] > 0 and sum(r["replay/frac"] for r in full[2:]) > 0  # stored at the checkpoint
  assert min(s for r in full for s in r["kl_control/scale_per_update"]) < 1.0  # the KL cap was active
  for r in full:
    assert r["alloc/frac_H"] + r["alloc/frac_L"] + r["alloc/frac_R"] == pytest.approx(1.0)
    assert r["memory/compiled_bytes"] <= r["memory/budget_bytes"] and r["alloc/greedy_gap"] >= -1e-9
  assert full[-1]["compile/count"] <= len({r["alloc/bucket"] for r in full}) + 1  # + KL control's update program

  # run a as if killed after step 4's metrics and before its checkpoint: its directory without the step-4
  # checkpoint or summary.json, steps 3-4 still in metrics.jsonl (the resume drops them and runs them again)
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
  os.remove(tmp_path / "b" / "summary.json")
  t = Trainer(tiny_config(tmp_path / "b", *COMMON, "train.resume=true"))
  assert t.restore_latest()
  restored = logra.find_state(t.state["opt_state"])
  done = sum(r["updates"] for r in full[:2])
  assert int(restored.count) == done and float(np.abs(jax.device_get(
      model.layer_params(restored.proj, 1)["mlp"]["wgate_DF"])).max()) > 0
  assert t.replay.size > 0 and t.ref_params is not None and t.memory.state is not None  # the manager's, restored
  t.train()
  resumed = metrics.read_metrics(tmp_path / "b" / "metrics.jsonl")
  assert [r["step"] for r in resumed] == [1, 2, 3, 4] and stable(resumed) == stable(full)
  sa, sb = (json.load(open(tmp_path / d / "summary.json")) for d in ("a", "b"))
  assert sa["eval_before"] == sb["eval_before"] and sa["eval_after"] == sb["eval_after"]
