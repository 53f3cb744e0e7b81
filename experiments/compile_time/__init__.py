"""Compile seconds and the memory plan against depth (`python -m experiments.compile_time.main`)."""
