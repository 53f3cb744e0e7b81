"""What the studies share: the lab's config sections (config.py), the one engine builder (engines.py) and the
interleaved timing rounds (timing.py)."""
