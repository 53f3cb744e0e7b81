"""The compiled step's memory with and without gradient clipping (`python -m experiments.clip.main`)."""
