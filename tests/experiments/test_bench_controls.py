"""The bench's controls and projections: the noise floor, adaptive rounds, the roofline model, the separately compiled
GC control and the compile-only projection."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from hilore_jax import model, sharding
from hilore_jax.loop import engine
from experiments.common import config as bench_config
from hilore_jax import stats
from experiments.common import timing
from hilore_jax.capacity import projection, roofline, synthetic
from hilore_jax.errors import ConfigError

TINY = ["model.vocab_size=37", "model.hidden_size=24", "model.intermediate_size=40", "model.num_hidden_layers=3",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "memory.group_size=8", "grpo.beta=0.02",
        "train.logprob_chunk=4", "bench.batch_size=4", "bench.group_size=2", "bench.seq_len=15", "bench.prompt_len=5"]


def test_roofline_by_hand():
  dev = roofline.Device("test", peak_flops=1e12, hbm_bytes_per_s=1e11, source="by hand")
  # gradient: 2e9 FLOPs -> 2 ms compute, 1e8 B -> 1 ms memory: 2 ms, compute-bound; update: 5e7 B -> 0.5 ms;
  # one L unit of 1e7 B with 2.5e6 B of codes: 2 x 1.25e7 B -> 0.25 ms
  codec_b = roofline.codec_bytes([(10_000_000, 2_500_000)])
  assert codec_b == 25_000_000
  p = roofline.project(roofline.Counts(2e9, 1e8, 5e7, codec_b), dev)
  assert p["grad_s"] == pytest.approx(2e-3) and p["update_s"] == pytest.approx(5e-4)
  assert p["codec_s"] == pytest.approx(2.5e-4) and p["step_s"] == pytest.approx(2.75e-3) and p["bound"] == "compute"
  assert roofline.project(roofline.Counts(1e8, 1e8, 0, 0), dev)["bound"] == "memory"
  assert roofline.H200.peak_flops == 989e12 and roofline.H200.hbm_bytes_per_s == 4.8e12
  rows = [{"method": "gc", "budget_ratio": None, "projected_step_s": 3.0},
          {"method": "optimal_hr", "budget_ratio": 1.1, "projected_step_s": 2.5},
          {"method": "hilore", "budget_ratio": 1.1, "projected_step_s": 2.0}]
  roofline.add_gains(rows)
  assert rows[2]["projected_gain_vs_gc_pct"] == pytest.approx(50.0)
  assert rows[2]["projected_gain_vs_optimal_hr_pct"] == pytest.approx(25.0)
  assert rows[0]["projected_gain_vs_optimal_hr_pct"] is None


def test_noise_floor_is_the_controls_far_edge_and_only_wins_beyond_it_count():
  floor = stats.noise_floor([-3.0, -2.0, -4.0, -3.0])
  assert floor["gain"] == pytest.approx(-3.0) and floor["abs"] == pytest.approx(3.0)
  assert floor["ci_low"] <= -3.0 <= floor["ci_high"] < 0
  assert floor["bound"] == pytest.approx(-floor["ci_low"])  # a copy may as well measure the mirrored +3
  assert stats.beats_floor(floor["bound"] + 0.1, floor) and not stats.beats_floor(1.0, floor)
  assert not stats.beats_floor(5.0, None) and not stats.beats_floor(None, floor)


def test_rows_sharing_one_program_raise_the_floor_to_their_widest_pair():
  # two groups: a pair 2 points apart in every round, and a pair (plus a third row) within 0.5
  groups = {1: [("a", [10.0, 12.0, 11.0]), ("b", [8.0, 10.0, 9.0])],
            2: [("c", [1.0, 1.0, 1.0]), ("d", [1.5, 1.5, 1.5]), ("e", [1.0, 1.0, 1.0])]}
  same = stats.same_program_floor(groups)
  assert same["pairs"] == 1 + 3 and same["worst_pair"] == ["a", "b"]
  assert same["diff"] == pytest.approx(2.0) and same["bound"] == pytest.approx(2.0)  # constant difference: CI = 2
  floor = stats.noise_floor([-1.0, 0.0, 1.0])
  raised = stats.with_same_program(floor, same)
  assert raised["control_bound"] == floor["bound"] <= 1.0 and raised["bound"] == pytest.approx(2.0)
  assert not stats.beats_floor(1.5, raised) and stats.beats_floor(1.5, floor)
  # no pair: the control's floor stands
  alone = stats.same_program_floor({1: [("a", [1.0, 2.0])], 2: [("b", [3.0, 4.0])]})
  assert alone["pairs"] == 0 and stats.with_same_program(floor, alone)["bound"] == floor["bound"]


class _Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def _steps(clock, durations):
  """Fake steps: each advances the clock by its next duration (a list per step, cycled) and counts its calls."""
  calls = [0] * len(durations)

  def make(i):
    def step(state):
      clock.t += durations[i][calls[i] % len(durations[i])]
      calls[i] += 1
      return state + 1
    return step
  return [make(i) for i in range(len(durations))], calls


@pytest.mark.slow
def test_rounds_continue_until_every_gain_ci_is_tight_or_the_time_cap(monkeypatch):
  import gc

  clock = _Clock()
  # base 1.0 s; a row 10% faster exactly: its paired gain has no spread, so min_rounds decide
  steps, calls = _steps(clock, [[1.0], [1.0 / 1.1]])
  r = timing.Rounds(min_rounds=3, halfwidth_pct=2.0, time_cap_s=1e9, warmup_rounds=2)
  times, state, info = timing.interleave(steps, 0, r, base=0, clock=clock, progress=lambda s: None)
  assert info["rounds"] == 3 and info["stopped_by"] == "min_rounds" and calls == [5, 5] and state == 10
  assert info["max_halfwidth_pct"] == pytest.approx(0.0, abs=1e-9)
  assert info["measures"]["warmup_rounds"] == 2 and not info["measures"]["pause_python_gc"]
  # a row alternating 0.8 / 1.25 s: +25% / -20%, its CI never narrows to 2 points; the cap ends it. Python's
  # collector paused: a collection before each round (counted, not run: a full collection of a test worker's heap
  # costs most of a second) and the collector back on after it
  collected = []
  monkeypatch.setattr(timing.gc, "collect", lambda *a: collected.append(gc.isenabled()))
  clock = _Clock()
  steps, _ = _steps(clock, [[1.0], [0.8, 1.25]])
  r = timing.Rounds(min_rounds=3, halfwidth_pct=2.0, time_cap_s=40.0, warmup_rounds=0, pause_python_gc=True)
  times, _, info = timing.interleave(steps, 0, r, base=0, clock=clock, progress=lambda s: None)
  assert info["stopped_by"] == "time_cap" and info["max_halfwidth_pct"] > 2.0
  assert 40.0 <= info["elapsed_s"] < 40.0 + 2.25 + 1e-9 and len(times[0]) == len(times[1]) == info["rounds"] > 3
  assert collected == [True] * info["rounds"] and gc.isenabled() and info["measures"]["pause_python_gc"]
  # noise that shrinks with more rounds: stops on the CI before the cap, past min_rounds
  clock = _Clock()
  rng = np.random.default_rng(0)
  steps, _ = _steps(clock, [[1.0], list(1.0 + 0.1 * rng.standard_normal(400))])
  r = timing.Rounds(min_rounds=3, halfwidth_pct=2.0, time_cap_s=1e9, warmup_rounds=0)
  _, _, info = timing.interleave(steps, 0, r, base=0, clock=clock, progress=lambda s: None)
  assert info["stopped_by"] == "ci" and info["rounds"] > 3 and info["max_halfwidth_pct"] <= 2.0
  # no base: min_rounds only
  _, _, info = timing.interleave(steps, 0, r, base=None, clock=clock, progress=lambda s: None)
  assert info["rounds"] == 3 and info["max_halfwidth_pct"] is None


@pytest.mark.parametrize("key,value,match", [
    ("ci_halfwidth_pct", 0.0, "bench.ci_halfwidth_pct must be > 0"),
    ("time_cap_s", -1.0, "bench.time_cap_s must be > 0"),
    ("warmup_rounds", -1, "bench.warmup_rounds must be >= 0")])
def test_bench_config_rejects_bad_timing_settings(key, value, match):
  with pytest.raises(ConfigError, match=match):
    bench_config.BenchConfig(**{key: value})


def test_diagnostics_are_off_by_default():
  bc = bench_config.BenchConfig()
  assert not bc.unit_risk_table and bc.risk_sets == 0 and bc.risk_batches <= 1 and not bc.roofline


def _tiny(overrides=()):
  cfg, bc = bench_config.load(None, TINY + list(overrides), "bench")
  mcfg = engine.model_config(cfg)
  completion = bc.seq_len - bc.prompt_len
  spec = synthetic.step_spec(mcfg, cfg.grpo, cfg.train.logprob_chunk, completion)
  return cfg, bc, mcfg, spec, completion


def _program(compiled) -> str:
  """The optimised HLO without its source metadata (file names, stack frames: each trace records its own)."""
  lines = compiled.as_text().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
  return re.sub(r", (metadata|stack_frame_id)=(\{[^}]*\}|\d+)", "", "\n".join(lines[start:]))


@pytest.mark.slow
def test_the_control_is_a_separate_compilation_of_the_same_program():
  from experiments.bench import run

  cfg, bc, mcfg, spec, completion = _tiny()
  eng, state = engine.build(cfg, mcfg, 10)
  batch = jax.device_put(synthetic.shape_batch(mcfg, bc.batch_size, bc.prompt_len, completion, True),
                         sharding.batch_sharding(eng.mesh))
  gc_spec = dataclasses.replace(spec, policies=model.uniform(mcfg.num_hidden_layers, model.FULL_REMAT))
  gc = eng.stepper.get(gc_spec, batch)
  control = run.control_step(eng, state, cfg, gc_spec, batch)
  assert control is not eng.stepper.get(gc_spec, batch)  # the first stepper still returns its own
  assert control.grad is not gc.grad and control.update is not gc.update
  assert _program(control.grad) == _program(gc.grad) and _program(control.update) == _program(gc.update)
  assert control.peak_bytes == gc.peak_bytes


@pytest.mark.slow
def test_unrolled_counts_every_layer_and_changes_no_computation():
  cfg, bc, mcfg, spec, completion = _tiny()
  L = mcfg.num_hidden_layers
  gc = model.uniform(L, model.FULL_REMAT)
  flat = projection.unrolled(dataclasses.replace(spec, policies=gc))
  assert flat.policies == gc and not flat.model_cfg.scan_layers and spec.model_cfg.scan_layers
  eng, state = engine.build(cfg, mcfg, 10, abstract=True)
  batch = jax.device_put(synthetic.shape_batch(mcfg, bc.batch_size, bc.prompt_len, completion, True),
                         sharding.batch_sharding(eng.mesh))
  c, check = projection.counts(eng.stepper, dataclasses.replace(spec, policies=gc), batch, state["params"])
  # every layer's and every chunk's work counted: XLA's FLOPs cover the jaxpr's matmuls (under the scan they did not)
  assert check["xla_over_matmul_flops"] >= 1.0 and c.codec_bytes == 0 and c.grad_bytes > 0 and c.update_bytes > 0
  scanned = eng.stepper.get(dataclasses.replace(spec, policies=gc), batch, count=False)
  assert scanned.program_costs("flops")[0] < c.matmul_flops


@pytest.mark.slow
def test_projection_is_compile_only_for_any_shape(tmp_path, capsys):
  import json

  from experiments.bench import roofline as roofline_cli

  roofline_cli.main(["--out", str(tmp_path), *TINY, "memory.budget_probes=2", "bench.budget_ratios=[1.3]",
                     "bench.methods=[none,gc,optimal_hr,uniform_int8_gc,hilore]"])
  assert "skipping calibrated methods ['hilore']" in capsys.readouterr().out
  with open(tmp_path / "roofline.json") as f:
    saved = json.load(f)
  assert "projection" in saved["projection"]["label"] and saved["batch"] == [4, 15]
  by = {r["method"]: r for r in saved["rows"]}
  assert set(by) == {"none", "gc", "optimal_hr", "uniform_int8_gc"}
  assert all(r["projected_step_s"] > 0 and r["projected_bound"] in ("compute", "memory") for r in by.values())
  assert by["gc"]["projected_gain_vs_gc_pct"] == pytest.approx(0.0)
  assert by["optimal_hr"]["projected_gain_vs_optimal_hr_pct"] == pytest.approx(0.0)
  assert by["gc"]["projected_matmul_flops"] > by["none"]["projected_matmul_flops"]  # recompute counted
  # codec traffic only where the plan keeps L codes: uniform_int8_gc's layers that fit, none for optimal_hr
  assert by["uniform_int8_gc"]["projected_codec_s"] > 0 and by["optimal_hr"]["projected_codec_s"] == 0
  assert (tmp_path / "roofline.md").read_text().startswith("## Projection for one H200")
