import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_util import tiny_config

from hilore_jax.loop import metrics
from hilore_jax.loop.trainer import Trainer, TrainingDiverged
import repo


@pytest.mark.slow
def test_existing_run_is_not_overwritten(tmp_path):
  Trainer(tiny_config(tmp_path, "train.steps=1", "train.warmstart_steps=0", "eval.at_start=false",
                      "eval.at_end=false")).train()
  before = sorted(os.listdir(tmp_path / "checkpoints"))
  with pytest.raises(FileExistsError, match="already holds checkpoints.*train.resume=true"):
    Trainer(tiny_config(tmp_path, "train.steps=1")).train()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == before


@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  t = Trainer(tiny_config(tmp_path, "train.steps=6", "checkpoint.every=2", "grpo.filter_zero_std=false"))
  run_step = t.run_step

  def poisoned(step):
    if step == 3:  # corrupt the weights mid-run: the next update must be caught
      t.state = t.state.replace(params=jax.tree_util.tree_map(lambda x: x * jnp.nan, t.state.params))
    return run_step(step)

  t.run_step = poisoned
  with pytest.raises(TrainingDiverged, match=r"non-finite loss or gradient at step 4.*last good checkpoint is step 2"):
    t.train()
  assert t.checkpointer.latest_step() == 2
  fresh = Trainer(tiny_config(tmp_path, "train.steps=6", "train.resume=true"))
  assert fresh.restore_latest() and fresh.start_step == 2
  jax.tree_util.tree_map(lambda x: np.testing.assert_(np.isfinite(np.asarray(x)).all()), fresh.state["params"])


def test_the_warm_start_traces_its_step_once(tmp_path, monkeypatch):
  from hilore_jax.rl import sft

  traces = []
  logprobs = sft.train_step.completion_logprobs
  monkeypatch.setattr(sft.train_step, "completion_logprobs", lambda *a, **k: traces.append(1) or logprobs(*a, **k))
  # a learning rate of its own: a step no other test compiled (the optimizer is a static argument)
  t = Trainer(tiny_config(tmp_path, "train.warmstart_steps=2", "train.warmstart_lr=0.0137"))
  t.warmstart()
  # the optimizer's step counts start on the params' mesh, as the step returns them: the second step is no new type
  assert len(traces) == 1 and len(t.warmstart_losses) == 2


def test_zero_std_filtering_and_minibatch_padding(tmp_path):
  t = Trainer(tiny_config(tmp_path, "train.minibatch_size=4"))
  from hilore_jax.rl.rollout import Rollout
  B, P, N = 12, 6, 3
  rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1], np.float32)  # group 2 has zero std
  roll = Rollout(np.ones((B, P), np.int32), np.ones((B, P), np.int32), np.ones((B, N), np.int32),
                 np.ones((B, N), np.int32), np.zeros((B, N)), [""] * B, rewards)
  plan = t.plan_update(roll, np.random.default_rng(0))
  mbs, stats = plan.batches, plan.stats
  assert stats["frac_reward_zero_std"] == pytest.approx(1 / 3) and stats["rows_updated"] == 8
  assert len(mbs) == 2 and all(b.tokens.shape == (4, N) for b in mbs)
  t2 = Trainer(tiny_config(tmp_path / "nofilter", "train.minibatch_size=4", "grpo.filter_zero_std=false"))
  plan = t2.plan_update(roll, np.random.default_rng(0))
  mbs, stats = plan.batches, plan.stats
  assert stats["rows_updated"] == 12 and len(mbs) == 3
  t3 = Trainer(tiny_config(tmp_path / "pad", "train.minibatch_size=6"))
  mbs = t3.plan_update(roll, np.random.default_rng(0)).batches  # 8 live rows -> 2 minibatches of 6, 4 padded
  live = sum(float(np.asarray(b.mask).sum()) for b in mbs)
  assert len(mbs) == 2 and live == 8 * N


@pytest.mark.slow
def test_cli_end_to_end_writes_everything(tmp_path, capsys):
  from trainer_util import TINY

  from train import grpo as train_grpo
  root = repo.ROOT
  out = tmp_path / "run"
  args = [a for a in TINY if not a.startswith(("logging.plot", "checkpoint.export_hf"))]
  # the GRPO command in this process (a failed run raises SystemExit with its one-line error): its arguments, config
  # file and outputs are the command's; a subprocess would add only the interpreter's start-up
  train_grpo.main(["--config", os.path.join(root, "configs", "tiny.yaml"), *args, "train.steps=3",
                   "checkpoint.every=2", f"out_dir={out}"])
  printed = json.loads(capsys.readouterr().out)  # the run's summary, on stdout
  rows = metrics.read_metrics(out / "metrics.jsonl")
  required = ["step", "reward/mean", "reward/std", "frac_reward_zero_std", "kl", "clipfrac", "entropy",
              "completion_len/mean", "time/step_s", "time/rollout_s", "time/update_s",
              "throughput/update_tokens_per_s", "memory/peak_bytes", "compile/count"]
  assert len(rows) == 3 and all(k in rows[0] for k in required)
  assert (out / "reward.png").stat().st_size > 1000
  assert sorted(os.listdir(out / "checkpoints")) == ["0", "2", "3"]
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(out / "hf")
  assert tok.decode(tok("12+3=")["input_ids"]) == "12+3="
  from hilore_jax import load_hf
  cfg, params = load_hf(str(out / "hf"))
  assert cfg.hidden_size == 24 and cfg.eos_token_id == tok.eos_token_id
  # evaluation from the run directory and from the HF export agree (same weights, same seeds)
  summary = json.load(open(out / "summary.json"))
  assert printed["eval_after"] == summary["eval_after"]
  # the eval command, in this process too
  from train import eval as train_eval

  evals = []
  for ckpt in (f"--checkpoint={out}", f"checkpoint={out / 'hf'}"):
    capsys.readouterr()
    train_eval.main(["--config", os.path.join(root, "configs", "tiny.yaml"), *args, ckpt])
    evals.append(json.loads(capsys.readouterr().out))
  assert evals[0]["eval/accuracy"] == evals[1]["eval/accuracy"] == summary["eval_after"]["eval/accuracy"]
  assert evals[0]["eval/n"] == 8 and "eval/pass@2" in evals[0]
  lo, hi = summary["accuracy_gain_ci95_pp"]  # paired across the same 8 examples, around the gain
  assert lo <= summary["accuracy_gain_pp"] <= hi and len(summary["eval_after"]["eval/correct"]) == 8


def test_run_plots_draw_completion_lengths_where_the_metrics_carry_them(tmp_path):
  lengths = {"completion_len/p50": 40.0, "completion_len/p90": 90.0, "completion_len/max": 128.0,
             "completion_len/truncated_frac": 0.25}
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for s in (1, 2, 3):
      f.write(json.dumps({"step": s, "reward/mean": 0.1 * s, **lengths}) + "\n")
  out = metrics.plot_run(str(tmp_path), 3, {"eval/accuracy": 0.1}, {"eval/accuracy": 0.3})
  assert out["lengths_png"] == str(tmp_path / "lengths.png") and (tmp_path / "lengths.png").stat().st_size > 0
  bare = tmp_path / "bare"
  bare.mkdir()
  (bare / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.0}) + "\n")
  assert "lengths_png" not in metrics.plot_run(str(bare), 1, {}, None) and not (bare / "lengths.png").exists()
