"""HiLoRe trains from the first step: full checkpointing until set-up has measured, set-up on that step's own
minibatches, and a cached set-up that a second run of the same recipe starts on."""

import json
import logging
import os

import pytest
from trainer_util import tiny_config

from hilore_jax.loop import metrics
from hilore_jax.memory import store as stores
from hilore_jax.loop.trainer import Trainer
from hilore_jax.memory.cache_key import run_store as memory_store

# every plan priced with fixed op times: which plan a step runs never depends on this machine's speed
pytestmark = pytest.mark.usefixtures("fixed_op_times")
# exposure off (one bucket): every step's plan is the same, so two runs' plans compare row by row
RUN = ["memory.policy=hilore", "memory.group_size=8", "memory.buckets=1", "memory.budget_probes=2",
       "memory.budget_ratio=1.3", "train.steps=3", "eval.at_start=false", "eval.at_end=false",
       "grpo.filter_zero_std=false", "memory.cache=true", "memory.verify_steps=0",
       # calibration on the first rollout's one minibatch: these tests are of the warm-up and the cache, not of the
       # calibration gathered over rollouts (tests/test_drift.py)
       "memory.calib_batches=1", "memory.calib_rollouts=1"]


def _rows(out):
  return metrics.read_metrics(out / "metrics.jsonl")


def test_store_is_atomic_and_an_unreadable_file_is_ignored(tmp_path, caplog):
  s = stores.JsonStore(str(tmp_path / "memory"), "k1")
  assert s.load() is None
  s.save({"gc_bytes": 7, "nested": [1, 2]})
  assert s.load() == {"gc_bytes": 7, "nested": [1, 2]} and os.listdir(tmp_path / "memory") == ["k1.json"]
  with open(s.path, "w") as f:
    f.write('{"gc_bytes": 7, "nest')  # a torn file (the write is atomic, but a disk can still damage it)
  with caplog.at_level(logging.WARNING):
    assert s.load() is None
  assert "k1.json is unreadable" in caplog.text and "measuring again" in caplog.text


def test_key_follows_what_set_up_measures_and_nothing_else(tmp_path, monkeypatch):
  monkeypatch.setenv("HILORE_CACHE", str(tmp_path / "cache"))
  key = lambda *o: memory_store(tiny_config(tmp_path / "a", *RUN, *o)).key
  base = key()
  assert key("logging.plot=true", "eval.num_examples=5", "train.steps=9", "checkpoint.every=1") == base
  assert memory_store(tiny_config(tmp_path / "elsewhere", *RUN)).key == base  # out_dir is not part of it
  for other in ("memory.budget_ratio=1.2", "rollout.max_new_tokens=4", "seed=1", "memory.group_size=16"):
    assert key(other) != base, other
  assert memory_store(tiny_config(tmp_path, *RUN, "memory.cache=false")) is None
  assert key("memory.lowp_kinds=[attn_norm]") != base
  # the code part hashes the whole package (memory/ and model/ measure and compile what is cached), not loop/ alone
  import hilore_jax
  hashed = []
  monkeypatch.setattr(stores, "source_digest", lambda d: hashed.append(os.path.abspath(d)) or "code")
  key()
  assert hashed == [os.path.dirname(os.path.abspath(hilore_jax.__file__))]


# checkpoint 1 is written after set-up and before GC's timing step: a run resumed from it must still run step 2 on GC
COLD = [*RUN, "memory.verify_steps=2", "checkpoint.every=1", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
  """One run of COLD that warms up, in its own cache, and its trainer."""
  # the cached plan's test starts a second run on what it cached, the resume test restarts it from checkpoint 1
  from hilore_jax.memory import profile
  from hilore_jax.model import decoder

  base = tmp_path_factory.mktemp("cold")
  with pytest.MonkeyPatch.context() as mp:  # fixed_op_times and monkeypatch are per test: the same, for the module
    mp.setattr(profile, "profile_ops", lambda *a, **k: {"ops": {op: 1e-3 for op in decoder.OPS}, "codec": {},
                                                          "offload": {}})
    mp.setenv("HILORE_CACHE", str(base / "cache"))
    t = Trainer(tiny_config(base / "first", *COLD))
    t.train()
  return t, base


@pytest.mark.slow
def test_first_step_runs_gc_then_the_plan_and_a_second_run_starts_on_the_cached_plan(cold_run, tmp_path, monkeypatch):
  first, base = cold_run
  monkeypatch.setenv("HILORE_CACHE", str(base / "cache"))
  rows = _rows(base / "first")
  # step 1: full checkpointing, nothing measured; set-up (and the plan's fit) after it on its minibatches; step 2
  # times GC without a compile (the guard's reference); the plan from step 3, fitted ahead
  assert rows[0]["alloc/warmup"] == 1 and rows[0]["alloc/frac_R"] == 1 and rows[0]["compile/probes"] == 0
  # what the run did to get there: XLA's compiles and their seconds, the process's resident memory
  assert rows[0]["compile/xla_count"] + rows[0]["compile/cache_hits"] > 0 and rows[0]["compile/xla_s"] > 0
  assert 0 < rows[0]["memory/host_rss_mib"] <= rows[0]["memory/host_peak_mib"]
  assert rows[1]["alloc/warmup"] == 1 and rows[1]["time/memory_setup_s"] > 0 and rows[1]["compile/probes"] > 0
  assert rows[2]["alloc/warmup"] == 0 and rows[2]["alloc/frac_R"] < 1 and rows[2]["time/plan_fit_s"] == 0
  assert "time/memory_setup_s" not in rows[0] and "time/memory_setup_s" not in rows[2]
  st = first.memory.state
  assert first.memory.ready_at == 2 and st.calibrated_at == 1
  assert 1 <= len(st.timings["gc"]) <= 2 and len(st.timings["plan"]) == 1 and st.guard == ""  # 1 of 2 plan steps
  with open(first.memory.store.path) as f:
    cached = json.load(f)
  assert cached == json.loads(json.dumps(st.to_json()))

  # verify_steps (and the checkpoints) are not part of the key (the guard's verdict is a measurement, kept with the
  # rest)
  second = Trainer(tiny_config(tmp_path / "second", *RUN))
  assert second.memory.store.path == first.memory.store.path
  second.train()
  again = _rows(tmp_path / "second")
  # the plan from the first step, no probe compile, and the same plan as the first run once it had one
  assert all(r["alloc/warmup"] == 0 and r["compile/probes"] == 0 for r in again)
  plan = lambda r: tuple(r[f"alloc/frac_{c}"] for c in "HLRO")
  assert {plan(r) for r in again} == {plan(rows[2])}
  assert second.memory.ready_at == 0 and second.memory.state.calibrated_at == 1


# a plan with L units, so the drift sentinels run; 6 steps, the learning rate warming up over them: the gradient's scale
# moves
WITH_L = [*RUN, "train.steps=6", "optimizer.warmup_steps=5", "rollout.num_prompts=6", "rollout.num_generations=6",
          "memory.budget_ratio=1.45", "memory.grad_err_tolerance=0.3", "memory.min_l_gain=0", "memory.calib_rows=4",
          "memory.drift_check_every=2"]


@pytest.fixture(scope="module")
def l_cold_run(tmp_path_factory):
  """One run of WITH_L without the warm-up, in its own cache: its trainer and its calibrations."""
  # the no-warm-up test reads its first step, the cached plan's test starts a second run on what it cached
  from hilore_jax.memory import calibrate, profile
  from hilore_jax.model import decoder

  base = tmp_path_factory.mktemp("l_cold")
  calibrations, measure = [], calibrate.measure
  with pytest.MonkeyPatch.context() as mp:  # fixed_op_times and monkeypatch are per test: the same, for the module
    mp.setattr(profile, "profile_ops", lambda *a, **k: {"ops": {op: 1e-3 for op in decoder.OPS}, "codec": {},
                                                          "offload": {}})
    mp.setattr(calibrate, "measure", lambda *a, **k: calibrations.append(1) or measure(*a, **k))
    mp.setenv("HILORE_CACHE", str(base / "cache"))
    t = Trainer(tiny_config(base / "first", *WITH_L, "memory.warmup=none"))
    t.train()
  return t, base, calibrations


@pytest.mark.slow
def test_a_second_run_of_the_recipe_stays_warm_with_l_in_its_plan(l_cold_run, tmp_path, monkeypatch):
  # the second run starts on the cached plan (the warm-up is not part of the key) and neither calibrates nor probes
  # over its 6 steps
  from hilore_jax.memory import calibrate

  _, base, first_calibrations = l_cold_run
  monkeypatch.setenv("HILORE_CACHE", str(base / "cache"))
  first = _rows(base / "first")
  assert first_calibrations and any(r["alloc/frac_L"] > 0 for r in first)  # calibrated, and its plan holds L
  calibrations = []
  measure = calibrate.measure
  monkeypatch.setattr(calibrate, "measure", lambda *a, **k: calibrations.append(1) or measure(*a, **k))
  second = Trainer(tiny_config(tmp_path / "second", *WITH_L))
  second.train()
  rows = _rows(tmp_path / "second")
  assert len(rows) == 6 and not calibrations and all(r["compile/probes"] == 0 for r in rows)
  assert all(r["alloc/warmup"] == 0 and r["alloc/frac_L"] > 0 for r in rows)  # on its plans from the first step
  assert rows[-1]["memory/calibrations"] == 0 and rows[-1]["memory/recalibrations"] == 0
  assert second.memory.state.calibrations == 0 and any("time/recalibrate_s" in r for r in rows)  # the sentinels ran


@pytest.mark.slow
@pytest.mark.parametrize("plan_speed", [10.0, 0.1])
def test_the_guard_runs_gc_where_the_plans_are_measured_slower(cold_run, tmp_path, monkeypatch, caplog, plan_speed):
  from hilore_jax.memory import MemoryManager

  observe = MemoryManager.observe

  def scaled(self, seconds, clean, grad_norms=None):  # fixed times, the plans' plan_speed x GC's: no clock read
    return observe(self, plan_speed if self.guard.last == "plan" else 1.0, clean, grad_norms)

  monkeypatch.setattr(MemoryManager, "observe", scaled)
  # the cold run's cache holds this recipe's plan (verify_steps and the step count are not part of the key): a run
  # without the cache neither reads it (it warms up) nor writes its verdict to it
  _, base = cold_run
  monkeypatch.setenv("HILORE_CACHE", str(base / "cache"))
  assert os.path.exists(memory_store(tiny_config(tmp_path / "run", *RUN)).path)
  cache = lambda: {f: open(base / "cache" / "memory" / f).read() for f in os.listdir(base / "cache" / "memory")}
  before = cache()
  with caplog.at_level(logging.INFO):
    t = Trainer(tiny_config(tmp_path / "run", *RUN, "memory.cache=false", "memory.verify_steps=1", "train.steps=5"))
    t.train()
  rows = _rows(tmp_path / "run")
  assert [r["alloc/warmup"] for r in rows] == [1, 1, 0, 0, 0] and cache() == before
  slower = plan_speed > 1
  assert t.memory.state.guard == ("gc" if slower else "plan")
  # step 3 ran the plan and was measured; steps 4-5 follow the verdict
  assert rows[2]["alloc/guard_gc"] == 0 and rows[2]["alloc/frac_R"] < 1
  for r in rows[3:]:
    assert r["alloc/guard_gc"] == (1 if slower else 0) and (r["alloc/frac_R"] == 1) == slower
  said = "no faster, so this run (and the next from the cache) runs GC's program"
  assert (said in caplog.text) == slower


@pytest.mark.slow
def test_without_the_cache_or_the_warmup_set_up_runs_as_before(l_cold_run):
  t, base, _ = l_cold_run
  row = _rows(base / "first")[0]
  assert row["alloc/warmup"] == 0 and row["compile/probes"] > 0 and row["memory/calibrations"] == 1
  assert t.memory.ready_at == 0 and t.memory.state.warmup_steps == 0 and t.memory.state.calibrated_at == 0
  assert os.path.exists(t.memory.store.path)  # and cached for the next run (warmup is not part of the key)
  # (that a run without the cache neither reads nor writes it: the guard's test)


@pytest.mark.slow
def test_a_run_resumed_mid_warmup_warms_up_as_the_uninterrupted_one(cold_run, tmp_path):
  import shutil

  from trainer_util import stable

  _, base = cold_run
  full = _rows(base / "first")
  assert [r["alloc/warmup"] for r in full] == [1, 1, 0]
  shutil.copytree(base / "first", tmp_path / "b")
  for step in (2, 3):
    shutil.rmtree(tmp_path / "b" / "checkpoints" / str(step))
  os.remove(tmp_path / "b" / "summary.json")
  # without the cache: the warm-up's state must come from the checkpoint, not from the plan the first run cached
  t = Trainer(tiny_config(tmp_path / "b", *COLD, "memory.cache=false", "train.resume=true"))
  t.train()
  resumed = _rows(tmp_path / "b")
  assert [r["step"] for r in resumed] == [1, 2, 3] and stable(resumed) == stable(full)
  # the same steps on GC (whether step 2 timed GC cleanly depends on what the resumed process had to compile)
  assert t.memory.state.warmup_steps == 2


@pytest.mark.slow
def test_a_bucket_met_mid_step_is_fitted_after_the_step_not_on_its_clock(tmp_path):
  # exposure on: buckets are vectors of unit levels; from step 4 on the scores are raised 4x a step (each unit 4
  # levels up), so every later step meets a bucket no fitted one covers, whatever the rollouts were
  t = Trainer(tiny_config(tmp_path, *RUN, "memory.cache=false", "memory.buckets=3", "train.steps=5",
                          "memory.budget_ratio=1.5", "memory.gate.mode=always", "memory.min_l_gain=0"))
  seen, finish, scores, step_now = [], t.memory.finish_step, t.memory.unit_scores, [0]
  run_step = t.run_step

  def counted(step):
    step_now[0] = step
    return run_step(step)

  def spy(*a, **k):
    seen.append(sorted(t.memory.pending_fits))
    return finish(*a, **k)

  t.run_step, t.memory.finish_step = counted, spy
  t.memory.unit_scores = lambda *a, **k: scores(*a, **k) * 4.0 ** max(step_now[0] - 2, 0)
  t.train()
  rows = _rows(tmp_path)
  assert all(r["time/plan_fit_s"] == 0 for r in rows)  # no fit on a step's clock
  assert rows[0]["alloc/deferred"] == 0 and rows[-1]["alloc/deferred"] == 1  # the raised scores meet a new bucket
  for i, r in enumerate(rows):
    if r["alloc/deferred"]:  # its (one) minibatch ran GC's program; the bucket was fitted after, timed in the next row
      assert r["alloc/frac_R"] == 1 and (i + 1 == len(rows) or rows[i + 1]["time/memory_setup_s"] > 0)
  # every deferred bucket was pending at its step's end and fitted then
  assert seen[-1] and all(b in t.memory.state.verified for bs in seen for b in bs)
