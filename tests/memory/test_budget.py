import pytest

from hilore_jax import errors
from hilore_jax.memory import budget


def test_budget_is_a_multiple_of_gc_and_never_below_it():
  assert budget.budget_bytes(1000, 1.05) == 1050
  assert budget.budget_bytes(1000, 1.05, absolute=1200) == 1200
  with pytest.raises(errors.InfeasibleBudget, match=r"900 bytes is below full checkpointing's 1000 bytes"):
    budget.budget_bytes(1000, 1.0, absolute=900)


def _fit(factor, gc=20_000, budget_bytes=21_000, probes=6, offset=0):
  """A planner that spends its allowance (up to a cap) and a compiler whose peak is GC + offset + factor x that."""
  cap = 5_000
  compiled = []

  def peak(plan):
    compiled.append(plan)
    return int(gc + offset + factor * plan)

  fit = budget.fit_allowance(budget_bytes, gc, plan_for=lambda a: min(a, cap), peak_of=peak, max_probes=probes,
                             time_of=lambda plan: -plan, bytes_of=lambda plan: plan)
  return fit, compiled


@pytest.mark.parametrize("factor", [0.4, 2.5])
def test_plan_is_fitted_to_the_compiled_peak(factor):
  fit, compiled = _fit(factor)
  assert fit.plan is not None and 20_000 + factor * fit.plan <= 21_000  # within budget on the "compiled" step
  assert len(fit.probes) == len(compiled) >= 2
  assert all(p.fits == (p.compiled_bytes <= 21_000) for p in fit.probes)
  if factor < 1:  # the compiled peak had slack: the allowance grew past the cost model's 1000 bytes
    assert fit.plan > 1_000
  else:  # the compiled peak was over: the allowance shrank below it
    assert fit.allowance < 1_000 and fit.plan > 0


def test_nothing_fits_falls_back():
  fit, _ = _fit(factor=1.0, offset=1_500)  # even an empty plan compiles over the budget
  assert fit.plan is None and fit.allowance == 0


def test_fit_plan_keeps_the_risk_free_fit_where_the_method_fits_slower():
  # the method's plans spend the allowance at 3x the compiled bytes (L codes XLA keeps more of than predicted), the
  # subset's at 1x; time falls with what a plan keeps, and the method is faster at equal allowance
  gc, budget_bytes = 20_000, 21_000
  method = lambda a: ("L", a)
  subset = lambda a: ("H", a)
  peak = lambda plan: gc + (3 if plan[0] == "L" else 1) * plan[1]
  time_of = lambda plan: 1.0 / (1 + (2 if plan[0] == "L" else 1) * plan[1])
  kw = dict(peak_of=peak, max_probes=4, time_of=time_of, bytes_of=lambda plan: plan[1])
  alone = budget.fit_plan(budget_bytes, gc, method, **kw)
  floor = budget.fit_plan(budget_bytes, gc, subset, **kw)
  assert time_of(alone.plan) > time_of(floor.plan) and not alone.floor  # what the fit did before
  both = budget.fit_plan(budget_bytes, gc, method, **kw, floor=lambda: floor)
  assert both.floor and both.plan == floor.plan and peak(both.plan) <= budget_bytes
  # where the method's own fit is faster it stays
  cheap = budget.fit_plan(budget_bytes, gc, method, **{**kw, "peak_of": lambda plan: gc + plan[1]},
                          floor=lambda: floor)
  assert not cheap.floor and time_of(cheap.plan) < time_of(floor.plan)


def _risk_free_case(method):
  """A manager with fixed unit costs and a compiler that charges every L code 6x its predicted bytes."""
  from hilore_jax import model
  from hilore_jax.memory import MemoryManager, StepHooks, calibration, profile
  from hilore_jax.memory.config import MemoryConfig
  from hilore_jax.memory.state import Calibration, ManagerState
  from hilore_jax.model import codec

  cfg = model.ModelConfig(vocab_size=31, hidden_size=24, intermediate_size=40, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2)
  rows, seq, group = 2, 16, 8
  ops = {"attn_norm_op": 1.0, "q_proj": 5.0, "k_proj": 3.0, "v_proj": 3.0, "scores": 4.0, "pv": 4.0, "o_proj": 5.0,
         "mlp_norm_op": 1.0, "gate_proj": 8.0, "up_proj": 8.0, "act": 1.0}
  prof = {"ops": ops, "codec": {k: {f: 0.05 for f in codec.FORMATS} for k in model.LOWP_UNITS}, "offload": {}}
  by = {(u.layer, u.kind): u for u in profile.enumerate_units(cfg, rows, seq, group, prof)}
  gc = 1_000_000

  def compile_peak(policies, batch):
    return gc + sum(by[i, k].bytes_h for i, p in enumerate(policies) for k in p.save) + sum(
        6 * by[i, k].bytes_l for i, p in enumerate(policies) for k in p.lowp)

  n = len(calibration.lowp_units(cfg.num_hidden_layers))
  cal = Calibration([1.0] * n, [1e-6] * n, [1e-6] * n, 1.0, 0.0, 0.0, 0.0, {}, 1)  # L is risk-free here
  budget_bytes = gc + 40_000
  hooks = StepHooks(model_cfg=cfg, compile_peak=compile_peak, batch_shape=lambda b: (rows, seq))
  mm = MemoryManager(MemoryConfig(policy=method, budget_bytes=budget_bytes, group_size=group, buckets=1,
                                  budget_probes=4), hooks)
  mm.load_state(ManagerState(gc, budget_bytes, prof, 0, calibration=cal))
  (alloc,) = mm.allocate([None])
  return alloc, compile_peak(alloc.policies, None), budget_bytes


@pytest.mark.slow
@pytest.mark.parametrize("method", ["hilore", "hilore_static"])
def test_an_l_method_is_never_slower_than_its_risk_free_subset(method):
  hr, hr_peak, budget_bytes = _risk_free_case("optimal_hr")
  alloc, peak, _ = _risk_free_case(method)
  assert hr_peak <= budget_bytes and hr.metrics["alloc/frac_H"] > 0
  assert peak <= budget_bytes  # compiled within budget
  assert alloc.plan.time_s <= hr.plan.time_s * (1 + 1e-9), (alloc.plan.fractions(), hr.plan.fractions())
