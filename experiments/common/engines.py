"""The engines the studies build: one builder, with the learning-rate schedule of the run the config describes (its
train.steps x the optimizer updates of a step, as the trainer sets it), and the bytes of a train state's trees."""

from __future__ import annotations

import math

import jax
import numpy as np

from hilore_jax import model
from hilore_jax.config import Config
from hilore_jax.loop import engine
from hilore_jax.rl import update_batch


def schedule_updates(cfg: Config) -> int:
  """The optimizer updates a run of cfg makes: the length of its learning-rate schedule."""
  return cfg.train.steps * update_batch.updates_per_step(cfg)


def build(cfg: Config, mcfg: model.ModelConfig | None = None, abstract: bool = False) -> tuple[engine.Engine, dict]:
  """(engine, sharded train state) of cfg's run at mcfg's shape (default: the config's model), params initialised
  from cfg.seed; abstract: shapes only (compile-only studies)."""
  mcfg = engine.model_config(cfg) if mcfg is None else mcfg
  return engine.build(cfg, mcfg, schedule_updates(cfg), abstract=abstract)


def nbytes(tree) -> int:
  """Bytes of a pytree's arrays (or abstract shapes)."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
