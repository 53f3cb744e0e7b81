"""Optimizer-state, gradient and step bytes, AdamW against LoGRA (`python -m experiments.optim.main`)."""
