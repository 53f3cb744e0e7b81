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
