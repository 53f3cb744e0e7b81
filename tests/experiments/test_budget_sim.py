"""experiments/budget/sim.py: the best bucketed plan by hand, and the ladders it searches."""

from experiments.budget import sim as budget_sim


def test_the_best_plan_and_its_costs_by_hand():
  assert budget_sim.micro_cost(10, 3, 2, 4) == 30 + 3 * 2 + 2  # completions, 3 prompts (no table below 3), fixed
  assert budget_sim.micro_cost(10, 8, 2, 4) == 80 + 4 * 2 + 2  # a table of 4 prompts for 8 rows
  allowed = [(10, 4), (10, 2), (10, 1), (2, 4), (2, 2), (2, 1)]
  lengths = [2, 10, 2, 2]
  assert budget_sim.padded(lengths, 1, 4) == 40 + 4 + 1
  # the long row alone (10 + 1 + 1), then 2 rows at cap 2 (4 + 2 + 1) and 1 (2 + 1 + 1): 23, below one row of 4 at
  # cap 2 (8 + 4 + 1 after the long row: 25) and the padded 45
  assert budget_sim.best(lengths, 1, allowed, 4) == 23
  assert budget_sim.best(lengths, 1, [(10, 4)], 4) == 45  # one shape: the padded minibatch


def test_ladders_and_shapes():
  assert budget_sim.ladder(256, 2.0, 3) == (256, 128, 64)
  assert budget_sim.ladder(256, 2**0.5, 5) == (256, 184, 128, 96, 64)
  # per cap the budget's row count (2816 // (96 + cap), at most 16), then halved
  assert budget_sim.shapes((256, 128), 2816, 96, 16, 2) == [(128, 6), (128, 12), (256, 4), (256, 8)]
  rows = budget_sim.run(95, 0.75, 16, 96, 256, 2816, trials=5, table=4)
  assert len(rows) == 9 and all(r["padded_over_best"] > 0.5 for r in rows)
  assert rows[2]["padded_over_best"] >= rows[0]["padded_over_best"]  # more shapes never plan worse
