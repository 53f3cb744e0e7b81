"""python -m experiments.budget.sim [--median 95] [--sigma 0.75] [--rows 16] [--prompt 96] [--cap 256]
[--budget 2816] [--trials 300]

How far length buckets can go: positions a minibatch's update computes, rows padded to the longest against the best
bucketed plan, on completion lengths drawn log-normal (median, sigma; cut at the cap). The best plan is found by
dynamic programming over the rows sorted by length, for ladders of caps (halving, or by sqrt 2) and of row counts
per cap (the budget's, then halved): what any planner with that many compiled shapes could reach. A microbatch
costs rows x cap completion positions, its prompt table (min(rows, table) prompts; all of them when no smaller),
and one prompt's positions of fixed cost (weights read again, a program launched). Host numpy only."""

from __future__ import annotations

import argparse

import numpy as np

from hilore_jax.rl import token_budget


def ladder(cap: int, ratio: float, n: int) -> tuple[int, ...]:
  """n caps from cap down by ratio, rounded up to multiples of 8, distinct."""
  out: list[int] = []
  for k in range(n):
    c = min(cap, int(np.ceil(cap / ratio**k / 8) * 8))
    if c not in out:
      out.append(c)
  return tuple(out)


def shapes(caps, budget: int, prompt: int, max_rows: int, sizes: int) -> list[tuple[int, int]]:
  """(cap, rows) a planner may compile: per cap the budget's row count, then halved, `sizes` of them."""
  out = set()
  for c in caps:
    full = token_budget.rows_per_microbatch(budget, prompt, c, max_rows)
    out.update((c, full >> k) for k in range(sizes) if full >> k >= 1)
  return sorted(out)


def micro_cost(cap: int, rows: int, prompt: int, table: int) -> int:
  """Positions of one microbatch: completions, its prompt table, and one prompt's worth of fixed cost."""
  return rows * cap + (table if rows > table else rows) * prompt + prompt


def best(lengths, prompt: int, allowed, table: int) -> int:
  """The fewest positions any plan of `allowed` shapes computes for these rows (each row in a microbatch whose cap
  holds it; a microbatch takes the next rows in length order)."""
  L = np.sort(np.asarray(lengths))[::-1]
  cost = [0] + [np.inf] * len(L)
  for i in range(len(L)):
    for cap, rows in allowed:
      if L[i] <= cap:
        j = min(len(L), i + rows)
        cost[j] = min(cost[j], cost[i] + micro_cost(cap, rows, prompt, table))
  return int(cost[-1])


def padded(lengths, prompt: int, table: int) -> int:
  """Positions of the minibatch as one microbatch, every row padded to the longest."""
  return micro_cost(int(np.max(lengths)), len(lengths), prompt, table)


def run(median: float, sigma: float, rows: int, prompt: int, cap: int, budget: int, trials: int, table: int,
        seed: int = 0) -> list[dict]:
  """padded / best positions, summed over trials, per cap ladder and row-count ladder."""
  out = []
  for name, caps in (("halving, 3 caps", ladder(cap, 2.0, 3)), ("by sqrt 2, 5 caps", ladder(cap, 2**0.5, 5)),
                     ("by sqrt 2, 7 caps", ladder(cap, 2**0.5, 7))):
    for sizes in (1, 2, 3):
      rng = np.random.default_rng(seed)
      allowed = shapes(caps, budget, prompt, rows, sizes)
      pad = fit = 0
      for _ in range(trials):
        lengths = np.minimum(np.exp(rng.normal(np.log(median), sigma, rows)).astype(int) + 1, cap)
        pad, fit = pad + padded(lengths, prompt, table), fit + best(lengths, prompt, allowed, table)
      out.append({"caps": name, "row_counts": sizes, "shapes": len(allowed), "padded_over_best": pad / fit})
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description="How far length buckets can go against rows padded to the longest")
  for flag, kind, default in (("--median", float, 95.0), ("--sigma", float, 0.75), ("--rows", int, 16),
                              ("--prompt", int, 96), ("--cap", int, 256), ("--budget", int, 2816),
                              ("--trials", int, 300), ("--table", int, 4)):
    p.add_argument(flag, type=kind, default=default)
  a = p.parse_args(argv)
  print(f"| caps | row counts per cap | compiled shapes | padded / best positions (median {a.median:g}, "
        f"sigma {a.sigma:g}, {a.rows} rows) |\n| --- | --- | --- | --- |")
  for r in run(a.median, a.sigma, a.rows, a.prompt, a.cap, a.budget, a.trials, a.table):
    print(f"| {r['caps']} | {r['row_counts']} | {r['shapes']} | {r['padded_over_best']:.2f} |")


if __name__ == "__main__":
  main()
