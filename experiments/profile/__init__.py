"""Where each memory plan's update spends its time: jax.profiler traces per op and category beside XLA's counts and
the cost model (`python -m experiments.profile.main`)."""
