"""Several arms trained from the same seeds: paired quality differences (`python -m experiments.quality.main`)."""
