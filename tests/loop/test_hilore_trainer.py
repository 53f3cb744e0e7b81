import pytest
from trainer_util import tiny_config

from hilore_jax import errors
from hilore_jax.loop import metrics
from hilore_jax.loop.trainer import Trainer

HILORE = ["memory.policy=hilore", "memory.group_size=8", "memory.buckets=3", "memory.budget_probes=2",
          "train.steps=3", "checkpoint.every=2", "eval.at_start=false", "eval.at_end=false",
          "grpo.filter_zero_std=false", "memory.warmup=none"]


@pytest.mark.slow
def test_budget_below_full_checkpointing_is_a_clear_error(tmp_path):
  t = Trainer(tiny_config(tmp_path, *HILORE, "memory.budget_bytes=1000", "train.warmstart_steps=0"))
  with pytest.raises(errors.InfeasibleBudget, match=r"below full checkpointing's \d+ bytes, the minimum"):
    t.train()


@pytest.mark.slow
def test_baseline_policy_trains_under_the_same_budget_rule(tmp_path):
  Trainer(tiny_config(tmp_path, "memory.policy=uniform_int8_gc", "memory.group_size=8", "memory.budget_ratio=1.5",
                      "memory.budget_probes=2", "train.steps=1", "eval.at_start=false", "eval.at_end=false",
                      "grpo.filter_zero_std=false", "train.warmstart_steps=0", "memory.warmup=none")).train()
  (row,) = metrics.read_metrics(tmp_path / "metrics.jsonl")
  assert row["alloc/frac_L"] > 0 and row["alloc/frac_H"] == 0  # compresses, never keeps float copies
  assert row["memory/compiled_bytes"] <= row["memory/budget_bytes"]


@pytest.mark.slow
def test_offload_on_cpu_is_a_clear_cli_error(tmp_path):
  from trainer_util import TINY

  from train import grpo as cli

  with pytest.raises(SystemExit, match="memory error: memory.offload=true is unsupported on the cpu backend"):
    cli.main([*TINY, f"out_dir={tmp_path}", "memory.policy=hilore", "memory.offload=true", "train.warmstart_steps=0",
              "eval.at_start=false", "grpo.filter_zero_std=false", "train.steps=1"])


@pytest.fixture(scope="module")
def two_pass_run(tmp_path_factory):
  """One 3-step run of two passes, L in its plan, the sentinels every step; what each pass's allocation was given."""
  from hilore_jax.memory import MemoryManager, profile
  from hilore_jax.model import decoder

  out = tmp_path_factory.mktemp("two_pass")
  seen, allocate = [], MemoryManager.allocate

  def spy(self, minibatches, logp=None):
    seen.append(list(logp or [None] * len(minibatches)))
    return allocate(self, minibatches, logp)

  with pytest.MonkeyPatch.context() as mp:  # monkeypatch and fixed_op_times are per test: the same, for the module
    mp.setattr(MemoryManager, "allocate", spy)
    mp.setattr(profile, "profile_ops", lambda *a, **k: {"ops": {op: 1e-3 for op in decoder.OPS}, "codec": {},
                                                          "offload": {}})
    t = Trainer(tiny_config(out, *HILORE, "train.steps=3", "grpo.num_iterations=2", "grpo.beta=0.05",
                            "memory.drift_check_every=1", "memory.budget_ratio=1.3", "memory.min_l_gain=0"))
    t.train()
  return t, out, seen


@pytest.mark.slow
def test_later_passes_are_reallocated_from_the_previous_pass(two_pass_run):
  t, _, seen = two_pass_run
  # each step's first pass allocates from what the batch carries; the second from the first pass's own log-probs
  # (the step's output, no extra forward), so its ratios and clipping are visible to the exposure
  assert len(seen) == 2 * 3 and all(lp is None for first in seen[0::2] for lp in first)
  assert all(lp is not None for second in seen[1::2] for lp in second)
  assert all(lp.shape == t.last_rollout.mask[:lp.shape[0]].shape for lp in seen[-1])


@pytest.mark.slow
def test_rows_log_the_gate_and_the_drift_sentinels_from_the_step_metrics(two_pass_run):
  # two passes (every row's allocations reduced together, so each carries the same keys); the updates' ||g|| reach
  # the manager (MemoryManager.observe) and the sentinels read them after the step, against the run's own earlier
  # values: the first step's start the references, the second's are compared (in the third step's row)
  t, out, _ = two_pass_run
  first, second, third = metrics.read_metrics(out / "metrics.jsonl")
  cal = t.memory.state.calibration
  assert all(r["alloc/frac_L"] > 0 for r in (first, second, third))  # the plan holds L: the sentinels run
  as_row = lambda x: "nan" if x != x else x  # the row writes a non-finite float as its name
  assert first["memory/gate/on"] == float(cal.gate["on"]) and first["memory/gate/spread"] == as_row(cal.gate["spread"])
  assert first["memory/recalibrated"] == 0.0 and first["memory/drift/grad_ratio"] == "nan"  # nothing observed yet
  assert second["memory/drift/grad_ratio"] == "nan" and second["memory/drift/exact_ratio"] > 0  # references started
  assert "time/recalibrate_s" in second and "time/recalibrate_s" not in first
  assert third["memory/drift/grad_ratio"] > 0 and third["memory/drift/recon_ratio"] > 0
  assert third["memory/recalibrated"] == float(t.memory.state.calibrated_at == 2)
  assert third["memory/recalibrations"] == t.memory.state.recalibrations and third["memory/calibrations"] >= 1
  assert cal.grad_norms and cal.gate["unclipped_share"] == sum(g < 1.0 for g in cal.grad_norms) / len(cal.grad_norms)
