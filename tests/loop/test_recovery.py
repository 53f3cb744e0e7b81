"""Crash-safe resume: runs SIGKILLed at named points (inside a checkpoint save, halfway through a metrics row) resume
to the uninterrupted run's metrics; a damaged checkpoint falls back to the newest good one, or the run refuses; torn
metrics rows."""

import logging
import os
import re
import signal
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_util import TINY, stable, tiny_config

from hilore_jax import runtime
from hilore_jax.loop import checkpointing, engine, metrics
from hilore_jax.errors import CheckpointError, DataError
from hilore_jax.loop.trainer import Trainer
from train import grpo as grpo_main
import repo

ROOT = repo.ROOT
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_worker.py")  # beside this test
TMP = ".orbax-checkpoint-tmp"
RUN = ["eval.at_start=false", "eval.at_end=false", "checkpoint.every=1", "checkpoint.keep=2"]


def _entries(ckpt_dir) -> tuple[list[int], list[str]]:
  """(finished steps, leftover temporary directories) of a checkpoints folder."""
  names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
  return sorted(int(n) for n in names if n.isdigit()), sorted(n for n in names if TMP in n)


def _start(args, log_path, **env):
  log = open(log_path, "w")
  proc = subprocess.Popen([sys.executable, WORKER, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                          env={**os.environ, **env})
  proc.log_path = log_path
  return proc


def _tail(proc) -> str:
  with open(proc.log_path) as f:
    return f.read()[-3000:]


def _killed(proc, point: str):
  """Wait for a run started with HILORE_TEST_KILL=point to kill itself there."""
  assert proc.wait(timeout=300) == -signal.SIGKILL, f"the run did not die at {point}:\n{_tail(proc)}"


@pytest.mark.slow
def test_killed_runs_resume_to_the_uninterrupted_metrics(tmp_path, caplog):
  steps, k = 4, 2
  # no warm-start (an SFT program to trace in the reference and the first killed process), every group's rows kept:
  # the steps still update, and what the kills and resumes must preserve is the same
  args = [*RUN, f"train.steps={steps}", "train.warmstart_steps=0", "grpo.filter_zero_std=false"]
  Trainer(tiny_config(tmp_path / "ref", *args)).train()
  want = stable(metrics.read_metrics(tmp_path / "ref" / "metrics.jsonl"))
  assert len(want) == steps and sum(r["updates"] for r in want) > 0  # the comparison covers real updates

  out, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
  cli = [*TINY, *args, "train.resume=true", f"out_dir={out}"]
  # 1. killed inside the save of step k: its data written to the temporary directory, the rename not yet done
  _killed(_start(cli, tmp_path / "1.log", HILORE_TEST_KILL=f"rename:{k}"), f"the save of step {k}")
  done, leftovers = _entries(ckpt)
  assert done[-1] == k - 1 and leftovers == [f"{k}{TMP}"]
  assert metrics.read_metrics(out / "metrics.jsonl")[-1]["step"] == k  # a row past the checkpoint, to drop

  # 2. killed halfway through step k's metrics row, after it restored step k - 1 and ran step k again: the killed
  # save's leftovers are gone before step k saves again (removed when the run opened its checkpoints), and the
  # rows are 1 .. k - 1 and a torn one
  _killed(_start(cli, tmp_path / "2.log", HILORE_TEST_KILL=f"row:{k}"), f"the metrics row of step {k}")
  done, leftovers = _entries(ckpt)
  assert leftovers == [] and done[-1] == k - 1
  with caplog.at_level(logging.WARNING):
    assert [r["step"] for r in metrics.read_metrics(out / "metrics.jsonl")] == list(range(1, k))
  assert "dropped a torn last row" in caplog.text

  # 3. to the end: nothing killed, so in this process (the same config as the CLI's arguments)
  Trainer(tiny_config(out, *args, "train.resume=true")).train()
  rows = metrics.read_metrics(out / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  assert stable(rows) == want
  assert _entries(ckpt) == ([steps - 1, steps], [])


def _truncate(step_dir):
  """Cut every array data file of a checkpoint in half (a disk that filled up, a partial copy)."""
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    if os.path.basename(root) == "d":
      for f in files:
        os.truncate(os.path.join(root, f), os.path.getsize(os.path.join(root, f)) // 2)


def _scribble(step_dir):
  """Overwrite 16 bytes in the middle of the largest file: same size, so only the data is wrong (bit rot)."""
  paths = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs]
  path = max(paths, key=os.path.getsize)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    f.write(b"\x5a" * 16)


def test_checksums_catch_what_orbax_restores_silently(tmp_path):
  tree = {"w_AB": jnp.asarray(np.random.RandomState(0).randn(61, 67), jnp.float32), "step": jnp.int32(3)}
  ckpt = checkpointing.Checkpointer(str(tmp_path), keep=2)
  ckpt.save(3, tree, {"step": 3})
  _scribble(tmp_path / "3")
  abstract = engine.abstract(tree, {k: v.sharding for k, v in tree.items()})
  import orbax.checkpoint as ocp
  raw = ckpt.manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
  assert not np.array_equal(raw["w_AB"], tree["w_AB"])  # orbax alone hands back damaged weights
  with pytest.raises(CheckpointError, match=r"step 3: \['w_AB'\] does not match the checksum saved with it"):
    ckpt.restore(3, abstract)
  ckpt.close()


@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back_to_the_newest_good_one(tmp_path, caplog, monkeypatch):
  args = ["train.steps=3", "train.warmstart_steps=0", "grpo.filter_zero_std=false", *RUN, "checkpoint.keep=3"]
  Trainer(tiny_config(tmp_path, *args)).train()
  want = stable(metrics.read_metrics(tmp_path / "metrics.jsonl"))
  # both kinds of damage in one resume: bit rot in the latest, a cut-off write in the one before; it falls back past
  # both, each reported with its own reason, and steps 2-3 run again
  _scribble(tmp_path / "checkpoints" / "3")
  _truncate(tmp_path / "checkpoints" / "2")
  with caplog.at_level(logging.WARNING):
    Trainer(tiny_config(tmp_path, *args, "train.resume=true")).train()
  assert re.search(r"checkpoint 3, 2 in \S+ is unusable \(step 3\b.*; step 2\b.*\); resuming from step 1",
                   caplog.text), caplog.text
  assert stable(metrics.read_metrics(tmp_path / "metrics.jsonl")) == want  # steps 2-3 ran again, identically
  assert _entries(tmp_path / "checkpoints") == ([1, 2, 3], [])
  assert len(os.listdir(tmp_path / "checkpoints.broken")) == 2  # kept for a look, out of orbax's way

  # nothing intact left: a one-line refusal, never a silent fresh start
  for step in (1, 2, 3):
    _truncate(tmp_path / "checkpoints" / str(step))
  monkeypatch.setattr(runtime, "enable_compilation_cache", lambda *a, **k: None)
  with pytest.raises(SystemExit) as exc:
    grpo_main.main([*TINY, *args, "train.resume=true", f"out_dir={tmp_path}"])
  message = exc.value.code
  assert "\n" not in message and re.match(r"checkpoint error: no usable checkpoint in \S+/checkpoints: step 3 .*"
                                          r"step 1 .*move the directory away to start over", message), message


def test_torn_metrics_row_is_dropped_and_resume_keeps_whole_rows(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  writer = metrics.MetricsWriter(str(tmp_path))
  for step in (1, 2, 3):
    writer.write({"step": step, "loss": 0.5 * step})
  with open(path, "a") as f:
    f.write('{"step": 4, "lo')  # killed mid-row
  with caplog.at_level(logging.WARNING):
    assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2, 3]
  assert "metrics.jsonl:4: dropped a torn last row" in caplog.text
  metrics.MetricsWriter(str(tmp_path), resume_step=2).write({"step": 3, "loss": 9.0})
  assert metrics.read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 1.0}, {"step": 3, "loss": 9.0}]
  with open(path, "a") as f:
    f.write('garbage\n{"step": 5}\n')  # damage inside the file is not a torn write: say where it is
  with pytest.raises(DataError, match=r"metrics.jsonl:4: not a JSON row"):
    metrics.read_metrics(path)


def test_a_failed_restores_leftover_read_reports_stay_quiet(monkeypatch, capsys):
  """What orbax's other reads leave after one read failed: coroutines closed after their event loop, each printed by
  Python as 'Exception ignored in: <coroutine ...>' with a traceback. Within the failed restore they are dropped; any
  other unraisable report still prints, and once the restore is over the previous hook is back."""
  import gc

  monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)

  class Pending:
    def __await__(self):
      yield  # a read that never completes

  async def read_chunk():
    try:
      await Pending()
    finally:
      raise RuntimeError("cannot schedule new futures after shutdown")  # the read meets its closed executor

  class Bug:
    def __del__(self):
      raise ValueError("a real bug elsewhere")

  def leave_reports(n):
    for _ in range(n):
      coro = read_chunk()
      coro.send(None)  # suspended mid-read, as the failed restore leaves them
      del coro
    Bug()
    gc.collect()

  leave_reports(3)
  assert capsys.readouterr().err.count("Exception ignored") == 4  # Python's own hook prints every one
  with pytest.raises(OSError), checkpointing._quiet_failed_reads():
    leave_reports(3)
    for _ in range(2):  # reads held in a cycle: only a collection finalises them, which the failed restore runs
      box = [read_chunk()]
      box[0].send(None)
      box.append(box)
    del box
    raise OSError("a damaged checkpoint")
  gc.collect()
  err = capsys.readouterr().err
  assert err.count("Exception ignored") == 1 and "a real bug elsewhere" in err and "read_chunk" not in err
  assert sys.unraisablehook is sys.__unraisablehook__  # scoped to the restore: nothing left for the rest of the run
  leave_reports(1)
  assert capsys.readouterr().err.count("Exception ignored") == 2


def test_a_checkpoint_with_per_layer_params_restores_into_the_train_layout(tmp_path):
  """Checkpoints written before the train layout (every layer leaf stacked) hold the layers as a list: they
  restore, stacked; one written now restores as it is."""
  import optax

  from hilore_jax import model

  cfg = model.ModelConfig(vocab_size=29, hidden_size=12, intermediate_size=19, num_hidden_layers=3,
                          num_attention_heads=2, num_key_value_heads=1)
  params = model.init_params(cfg, jax.random.PRNGKey(0), 0.3)
  opt = optax.adam(0.1)
  # non-zero moments; one compiled update, not Adam's ops one by one on every leaf
  opt_state = jax.jit(opt.update)(params, opt.init(params), params)[1]
  old = checkpointing.run_tree({"params": params, "opt_state": opt_state, "step": jnp.int32(2)}, params)
  new = checkpointing.run_tree({"params": model.stacked(params), "opt_state": opt.init(model.stacked(params)),
                                "step": jnp.int32(0)}, model.stacked(params))
  shardings = jax.tree.map(lambda x: x.sharding, new)
  abstract = engine.abstract(new, shardings)
  ckpt = checkpointing.Checkpointer(str(tmp_path), keep=3)
  ckpt.save(2, old, {"step": 2})  # no layout in its meta: per layer
  step, tree, _ = checkpointing.restore_train_layout(ckpt, abstract, shardings)
  moments = optax.tree_utils.tree_set(opt_state, mu=model.stacked(opt_state[0].mu), nu=model.stacked(opt_state[0].nu))
  want = checkpointing.run_tree({"params": model.stacked(params), "opt_state": moments, "step": jnp.int32(2)},
                                model.stacked(params))
  assert step == 2 and jax.tree.structure(tree) == jax.tree.structure(new)
  chex.assert_trees_all_equal(tree, want)
  ckpt.save(3, tree, {"step": 3, checkpointing.LAYERS_KEY: checkpointing.STACKED})
  step, again, _ = checkpointing.restore_train_layout(ckpt, abstract, shardings)
  assert step == 3
  chex.assert_trees_all_equal(again, want)
  ckpt.close()
