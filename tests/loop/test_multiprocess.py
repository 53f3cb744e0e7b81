"""Two processes under jax.distributed (CPU collectives over gloo) train exactly as one process on the same mesh,
and their checkpoints resume in one process. Every run is the documented command, `python -m train.grpo`."""

import os
import socket
import subprocess
import sys

import pytest
from trainer_util import TINY, stable

from hilore_jax.loop import metrics
import repo

ROOT = repo.ROOT
RUN = [*TINY, "eval.at_start=false", "eval.at_end=false", "grpo.filter_zero_std=false",
       "checkpoint.every=2"]


def _launch(tmp_path, out_dir, devices: int, *overrides) -> subprocess.Popen:
  # JAX_NUM_CPU_DEVICES and JAX_CPU_COLLECTIVES_IMPLEMENTATION are jax's own config flags, read from the environment
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices),
         "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo", "JAX_CPU_ENABLE_ASYNC_DISPATCH": "false",
         "JAX_PLATFORMS": "cpu"}
  return subprocess.Popen([sys.executable, "-m", "train.grpo", *RUN, f"out_dir={out_dir}", *overrides], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(*procs):
  for p in procs:
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]


def _one_and_two(tmp_path, one_steps: int, two_steps: int, *overrides) -> tuple[list, list]:
  """The metrics of one process on both devices of the data=2 mesh and of two processes on one device each."""
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  dist = ["mesh.distributed=true", f"mesh.coordinator_address=127.0.0.1:{port}", "mesh.num_processes=2"]
  one = _launch(tmp_path, tmp_path / "one", 2, f"train.steps={one_steps}", *overrides)
  two = [_launch(tmp_path, tmp_path / "two", 1, f"train.steps={two_steps}", *overrides, *dist,
                 f"mesh.process_id={i}") for i in (0, 1)]
  _wait(one, *two)
  ref = stable(metrics.read_metrics(tmp_path / "one" / "metrics.jsonl"))
  got = stable(metrics.read_metrics(tmp_path / "two" / "metrics.jsonl"))
  assert [r["step"] for r in got] == list(range(1, two_steps + 1))  # written once, by the first process
  assert ref[0]["reward/std"] > 0 and ref[0]["grad_norm"] > 0  # the comparison is not of zeros
  for a, b in zip(got, ref):
    assert a.keys() == b.keys()
    for k in a:
      assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
  return ref, got


# 3 minibatches of 4 rows, two passes over each rollout: all but the first minibatch of the first pass are off-policy
# and need a forward for old log-probs (the first is the plain run's on-policy update); a reference; replayed rows
# from step 2 on. Every piece of the plain run's state and step is among them, and crosses the checkpoint
RICH = ("train.minibatch_size=4", "grpo.num_iterations=2", "grpo.beta=0.05", "replay.enabled=true", "replay.share=0.5")


@pytest.mark.slow
def test_two_processes_match_one_with_off_policy_minibatches_replay_and_a_reference_and_resume_in_one(tmp_path):
  # (a plain run's test, and 3 two-process steps of this one, were dropped: 3 processes fewer)
  ref, got = _one_and_two(tmp_path, 3, 2, *RICH)
  assert any(r["kl"] > 0 for r in got), "no reference pass ran"
  assert any(r["replay/frac"] > 0 for r in got), "no row was replayed: the comparison misses replay"
  # the two processes' checkpoint (step 2) resumes in one process and continues as the one-process run did
  _wait(_launch(tmp_path, tmp_path / "two", 2, "train.steps=3", "train.resume=true", *RICH))
  got = stable(metrics.read_metrics(tmp_path / "two" / "metrics.jsonl"))
  assert [r["step"] for r in got] == [1, 2, 3]
  for k in got[2]:
    assert got[2][k] == pytest.approx(ref[2][k], rel=1e-5, abs=1e-7), k
