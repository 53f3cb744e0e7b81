"""The optimizer wing: global-norm clipping then AdamW or LoGRA (AdamW on low-rank gradient sketches) with its
schedule. Its settings are in optim/config.py."""

from hilore_jax.optim.optimizer import DENSE_NAMES, make_optimizer, schedule

__all__ = ["DENSE_NAMES", "make_optimizer", "schedule"]
