"""Predicted against realised KL of a run trained with kl_control (`python -m experiments.kl.main RUN_DIR`)."""
