"""Token budgets and length buckets: how far buckets can go on simulated lengths (`python -m experiments.budget.sim`),
how full each setting's update is on real rollouts (`python -m experiments.budget.fill`), and what a packed
buffer's attention costs per position (`python -m experiments.budget.attention`)."""
