"""The sampler at length (`python -m experiments.sampler.main`) and its FLOPs with each group's prompt prefilled
once (`python -m experiments.sampler.prefill`)."""
