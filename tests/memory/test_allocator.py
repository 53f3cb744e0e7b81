import dataclasses
import itertools

import numpy as np
import pytest

from hilore_jax.memory import allocator, solvers
from hilore_jax.memory.allocator import H, L, R, UnitCost


def _brute(units, budget, delta):
  best = None
  groups = allocator.per_unit(units)
  for picks in itertools.product(*[range(len(g)) for g in groups]):
    a = allocator._summary(groups, picks)
    if a.bytes <= budget and a.risk <= delta + 1e-12 and (best is None or a.time_s < best.time_s - 1e-12):
      best = a
  return best


def _random_units(rng, n):
  out = []
  for i in range(n):
    bh = int(rng.integers(4, 40)) * 1024
    out.append(UnitCost(f"u{i}", bh, bh // 4 if rng.random() < 0.7 else None, float(rng.uniform(0.1, 3.0)),
                        float(rng.uniform(0.0, 0.2)), float(rng.uniform(0.0, 0.01))))
  return out


def test_exact_solver_is_optimal():
  rng = np.random.default_rng(0)
  for _ in range(20):
    units = _random_units(rng, 5)
    budget = int(rng.integers(0, sum(u.bytes_h for u in units)))
    delta = float(rng.uniform(0, 0.02))
    best = _brute(units, budget, delta).time_s
    assert allocator.exact(allocator.per_unit(units), budget, delta).time_s == pytest.approx(best)
    loose = allocator.exact(allocator.per_unit(units), budget, delta, mip_gap=0.05)  # within its proven gap
    assert loose.bytes <= budget and loose.risk <= delta + 1e-12 and loose.time_s <= best * 1.05 + 1e-12


def test_greedy_equals_exact_on_uniform_instances():
  # equal sizes per kind: taking the best time per byte first is optimal
  rng = np.random.default_rng(1)
  for _ in range(10):
    units = [UnitCost(f"u{i}", 1000, 250, float(rng.uniform(0.1, 2)), 0.01, 0.001) for i in range(6)]
    for budget in (0, 250, 1000, 2500, 4000, 6000):
      for delta in (0.0, 0.002, 1.0):
        groups = allocator.per_unit(units)
        g, e = allocator.greedy(groups, budget, delta), allocator.exact(groups, budget, delta)
        assert g.time_s == pytest.approx(e.time_s), (budget, delta)


def test_greedy_respects_budgets_and_is_monotone():
  rng = np.random.default_rng(2)
  units = _random_units(rng, 12)
  total = sum(u.bytes_h for u in units)
  prev = np.inf
  gaps = []
  for budget in np.linspace(0, total, 15).astype(int):
    a = allocator.greedy(allocator.per_unit(units), int(budget), 0.01)
    assert a.bytes <= budget and a.risk <= 0.01 + 1e-12
    assert a.time_s <= prev + 1e-12  # more memory never makes it slower
    prev = a.time_s
    gaps.append(a.time_s - allocator.exact(allocator.per_unit(units), int(budget), 0.01).time_s)
  assert min(gaps) >= -1e-9  # never better than optimal
  assert allocator.greedy(allocator.per_unit(units), total, 0.0).choice == (H,) * 12


def test_zero_risk_units_go_to_l_first():
  units = [UnitCost("exposed", 1000, 250, 1.0, 0.0, 0.5), UnitCost("quiet", 1000, 250, 1.0, 0.0, 0.0)]
  a = allocator.greedy(allocator.per_unit(units), 250, risk_budget=0.1)
  assert a.choice == (R, L)


def test_infeasible_budget():
  with pytest.raises(ValueError, match="below what full recomputation needs"):
    allocator.greedy(allocator.per_unit([UnitCost("u", 10, 2, 1.0)]), -5, 0.0)
  with pytest.raises(ValueError, match="the minimum is 7 bytes"):
    allocator.exact([[allocator.Option(("H",), 7, 0.0)]], 3, 0.0)


def test_multi_choice_groups_exact_and_greedy():
  rng = np.random.default_rng(5)
  for _ in range(15):
    groups = [[allocator.Option((str(j),), int(rng.integers(0, 50)), float(rng.uniform(0, 1)),
                                float(rng.uniform(0, 0.01))) for j in range(int(rng.integers(1, 5)))]
              for _ in range(4)]
    floor = sum(min(o.bytes for o in g) for g in groups)
    budget, delta = floor + int(rng.integers(0, 100)), float(rng.uniform(0, 0.03))
    best = min((allocator._summary(groups, p) for p in itertools.product(*[range(len(g)) for g in groups])
                if allocator._summary(groups, p).bytes <= budget and allocator._summary(groups, p).risk <= delta),
               key=lambda a: a.time_s, default=None)
    if best is None:  # no choice meets the risk budget (layers always have a zero-risk all-R option)
      continue
    g, e = allocator.greedy(groups, budget, delta), allocator.exact(groups, budget, delta)
    assert e.time_s == pytest.approx(best.time_s)
    assert g.bytes <= budget and g.time_s >= e.time_s - 1e-12


def _layer_groups(rng, layers: int):
  """Identical layers (the same options: choices, bytes, seconds) whose L options carry per-layer risks, as the
  memory methods build them: the run shape is what makes their order matter."""
  base = [((R,), 0, 3.0, False), ((H,), 700, 1.0, False), ((L,), 300, 1.6, True), ((H, L), 1000, 0.2, True)]
  return [[allocator.Option(c, b, t, float(rng.uniform(0, 0.01)) if lowp else 0.0) for c, b, t, lowp in base]
          for _ in range(layers)]


def _brute_runs(groups, budget, delta, runs):
  best = None
  for picks in itertools.product(*[range(len(g)) for g in groups]):
    a = allocator._summary(groups, picks)
    if (a.bytes <= budget and a.risk <= delta + 1e-12 and (runs <= 0 or allocator.shaped(groups, picks, runs))
        and (best is None or a.time_s < best.time_s - 1e-12)):
      best = a
  return best


def test_exact_with_a_run_limit_is_optimal_among_plans_of_the_run_shape():
  rng = np.random.default_rng(3)
  bound = 0
  for _ in range(12):
    groups = _layer_groups(rng, 6)
    budget, delta = int(rng.integers(600, 5000)), float(rng.uniform(0.0, 0.03))
    free = allocator.exact(groups, budget, delta)
    for runs in (1, 2, 3):
      got = allocator.exact(groups, budget, delta, runs=runs)
      best = _brute_runs(groups, budget, delta, runs)
      assert allocator.shaped(groups, got.picks, runs) and got.bytes <= budget and got.risk <= delta + 1e-12
      assert got.time_s == pytest.approx(best.time_s)
      assert got.time_s >= free.time_s - 1e-12
      bound += got.time_s > free.time_s + 1e-9
  assert bound  # the limit bound somewhere: the check above compared constrained plans, not free ones


def test_greedy_with_a_run_limit_merges_runs_into_the_shape_within_both_budgets():
  rng = np.random.default_rng(4)
  for _ in range(12):
    groups = _layer_groups(rng, 9)
    budget, delta = int(rng.integers(600, 8000)), float(rng.uniform(0.0, 0.05))
    free = allocator.greedy(groups, budget, delta)
    for runs in (1, 2, 4):
      got = allocator.greedy(groups, budget, delta, runs=runs)
      assert allocator.shaped(groups, got.picks, runs) and got.bytes <= budget
      assert got.risk <= max(delta, free.risk) + 1e-12 and got.time_s >= free.time_s - 1e-12


def test_the_run_shape_has_no_run_of_one_layer():
  rng = np.random.default_rng(5)
  groups = _layer_groups(rng, 2)
  for solve in (allocator.exact, allocator.greedy):
    assert allocator.num_runs(groups, solve(groups, 5000, 1.0, runs=4).picks) == 1  # two layers: one run
  groups = _layer_groups(rng, 7)
  got = allocator.exact(groups, 3500, 1.0, runs=4)  # two layers H+L, five L: two runs
  assert allocator.shaped(groups, got.picks, 4) and allocator.num_runs(groups, got.picks) > 1
  assert allocator.shaped(groups, [0, 0, 1, 1, 1, 0, 0], 3) and not allocator.shaped(groups, [0, 1, 1, 0, 0, 0, 0], 4)


def _greedy_misses():
  """Greedy takes a (the best seconds per byte) and then nothing fits; the optimum is b + c: 6 s left against 9."""
  units = [UnitCost("a", 6, None, 6.0), UnitCost("b", 5, None, 4.5), UnitCost("c", 5, None, 4.5)]
  return allocator.per_unit(units), 10


def test_exact_time_limit_falls_back_to_greedy_without_an_incumbent():
  groups, budget = _greedy_misses()
  assert allocator.greedy(groups, budget, 0.0).time_s == pytest.approx(9.0)
  full = allocator.exact(groups, budget, 0.0)
  assert (full.choice, full.time_s, full.proven) == ((R, H, H), pytest.approx(6.0), True)
  # HiGHS checks its clock before presolve: a limit of 1e-9 s stops it with no plan, every time
  capped = allocator.exact(groups, budget, 0.0, time_limit_s=1e-9)
  assert (capped.choice, capped.time_s, capped.proven) == ((H, R, R), pytest.approx(9.0), False)


@pytest.mark.parametrize("incumbent,expected", [((1, 0, 0, 1, 0, 1), (R, H, H)),  # 6 s, better than greedy's 9
                                                ((1, 0, 0, 1, 1, 0), (H, R, R)),  # R H R: 10.5 s, greedy's
                                                ((0, 1, 0, 1, 1, 0), (H, R, R))])  # H H R: 11 bytes, greedy's
def test_exact_time_limit_keeps_the_faster_feasible_of_incumbent_and_greedy(monkeypatch, incumbent, expected):
  import scipy.optimize
  from scipy.optimize import OptimizeResult

  groups, budget = _greedy_misses()  # options per group: (R, H); x is [a_R, a_H, b_R, b_H, c_R, c_H]
  stopped = OptimizeResult(status=1, success=False, message="Time limit reached.", x=np.array(incumbent, float))
  monkeypatch.setattr(scipy.optimize, "milp", lambda *a, **k: stopped)
  got = allocator.exact(groups, budget, 0.0, time_limit_s=5.0)
  assert got.choice == expected and not got.proven
  with pytest.raises(RuntimeError, match="MILP failed"):  # without a limit, status 1 is not the limit's doing
    allocator.exact(groups, budget, 0.0)


def test_exact_gives_the_solvers_freed_heap_back(monkeypatch):
  from hilore_jax import runtime

  calls = []
  monkeypatch.setattr(runtime, "release_host_memory", lambda: calls.append(1))
  groups, budget = _greedy_misses()
  allocator.exact(groups, budget, 0.0)
  allocator.exact(groups, budget, 0.0, time_limit_s=1e-9)
  assert len(calls) == 2  # after every solve, proven or stopped at its limit


def _same_layers(rng, layers: int, options: int):
  """Every layer the same random options (risk-free plans, an uncalibrated hilore), the first a full recompute (no
  bytes, no risk, the most seconds): only how many layers take each option matters."""
  opts = [allocator.Option((R,), 0, 3.0)] + [
      allocator.Option((f"c{i}",), int(rng.integers(1, 2000)), float(rng.uniform(0.0, 3.0)),
                       float(rng.uniform(0.0, 0.01)) if rng.random() < 0.5 else 0.0) for i in range(1, options)]
  return [list(opts) for _ in range(layers)]


def test_identical_layers_solve_to_the_optimum_of_the_run_shape():
  rng = np.random.default_rng(7)
  bound = 0
  for _ in range(10):
    groups = _same_layers(rng, 6, 4)
    assert solvers.identical(groups)
    budget, delta = int(rng.integers(1000, 8000)), float(rng.uniform(0.0, 0.03))
    for runs in (0, 1, 2, 3):
      best = _brute_runs(groups, budget, delta, runs)
      got = allocator.exact(groups, budget, delta, runs=runs)
      assert got.bytes <= budget and got.risk <= delta + 1e-12 and got.proven
      assert got.time_s == pytest.approx(best.time_s)
      if runs:
        assert allocator.shaped(groups, got.picks, runs)
      bytes_ = [groups[0][i].bytes for i in got.picks]
      assert bytes_ == sorted(bytes_)  # one run per option used, the fewest bytes first
      bound += runs == 1 and allocator.num_runs(groups, got.picks) == 1
  assert bound


def test_identical_layers_solve_by_counts_not_positions(monkeypatch):
  import scipy.optimize

  sizes, milp = [], scipy.optimize.milp
  monkeypatch.setattr(scipy.optimize, "milp", lambda c, **kw: sizes.append(len(c)) or milp(c, **kw))
  rng = np.random.default_rng(8)
  groups = _same_layers(rng, 30, 300)
  got = allocator.exact(groups, 20000, 0.02, runs=4)
  assert sizes == [2 * 300]  # n_o and y_o per option; positional binaries would be 30 x 300 + 29
  assert allocator.shaped(groups, got.picks, 4) and got.bytes <= 20000 and got.risk <= 0.02 + 1e-12
  groups[3] = [dataclasses.replace(o, risk=o.risk + 1e-3) for o in groups[3]]  # one layer differs: positions again
  assert not solvers.identical(groups)
  allocator.exact(groups[:6], 20000, 0.02, runs=3)
  assert sizes[-1] == 6 * 300 + 5


def test_two_runs_are_solved_by_trying_every_such_plan(monkeypatch):
  import scipy.optimize

  rng = np.random.default_rng(9)
  calls = []
  milp = scipy.optimize.milp
  monkeypatch.setattr(scipy.optimize, "milp", lambda *a, **kw: calls.append(1) or milp(*a, **kw))
  bound = 0
  for _ in range(12):
    groups = _layer_groups(rng, 7)  # per-layer risks: not identical
    groups[4] = groups[4][:3]  # a choice pruned from one layer: no run may cover it there
    budget, delta = int(rng.integers(600, 6000)), float(rng.uniform(0.0, 0.03))
    for runs in (1, 2):
      best = _brute_runs(groups, budget, delta, runs)
      got = allocator.exact(groups, budget, delta, runs=runs)
      small = allocator._summary(groups, solvers.two_runs(groups, budget, delta, runs, block=1))  # one a at a time
      assert got.time_s == pytest.approx(best.time_s) and small.time_s == pytest.approx(best.time_s)
      assert allocator.shaped(groups, got.picks, runs) and got.bytes <= budget and got.risk <= delta + 1e-12
      bound += allocator.num_runs(groups, got.picks) == 2
  assert calls == [] and bound  # no MILP; two-run plans were optimal somewhere
  allocator.exact(groups, 6000, 0.03, runs=3)
  assert calls  # three runs: the MILP


def test_two_runs_break_ties_by_fewest_bytes_then_least_risk():
  opts = lambda r: [allocator.Option((R,), 0, 2.0), allocator.Option((H,), 700, 0.0),  # noqa: E731
                    allocator.Option((L,), 300, 0.0, r), allocator.Option(("L2",), 300, 0.0, 2 * r)]
  groups = [opts(0.001 * (1 + i)) for i in range(5)]  # free codecs: H and L equally fast, L fewer bytes
  got = allocator.exact(groups, 10_000, 1.0, runs=2)
  assert got.time_s == 0.0 and got.choice == (L,) * 5
  assert allocator.exact(groups, 10_000, 0.0, runs=2).choice == (H,) * 5  # no risk allowed: H at the same seconds
