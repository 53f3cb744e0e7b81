"""Token budgets and length buckets: how far buckets can go on simulated lengths (`python -m experiments.budget.sim`)
and how full each setting's update is on real rollouts (`python -m experiments.budget.fill`)."""
