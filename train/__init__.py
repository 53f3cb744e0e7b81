"""Thin entry points (importing hilore_jax sets the XLA flags its memory figures depend on)."""

import hilore_jax  # noqa: F401
