"""Two settings' update (and sampler) times on the same rollouts, paired (`python -m experiments.paired.main`)."""
