"""Pytrees kept on disk and read back on each use: a bench's per-minibatch params (a real model's are hundreds of MB
each, and a run records dozens) would not fit in host memory."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Spilled:
  """One pytree as an .npy file of raw bytes per leaf under a directory, its dtypes and shapes kept here (so
  bfloat16 leaves round-trip too)."""

  def __init__(self, tree, directory: str):
    leaves, self.treedef = jax.tree_util.tree_flatten(jax.device_get(tree))
    leaves = [np.asarray(x) for x in leaves]
    os.makedirs(directory, exist_ok=True)
    self.directory, self.meta = directory, [(x.dtype, x.shape) for x in leaves]
    for i, x in enumerate(leaves):
      np.save(os.path.join(directory, f"{i}.npy"), np.ascontiguousarray(x.reshape(-1)).view(np.uint8))

  def load(self):
    """The pytree, as device arrays."""
    leaves = [jnp.asarray(np.load(os.path.join(self.directory, f"{i}.npy")).view(dt).reshape(shape))
              for i, (dt, shape) in enumerate(self.meta)]
    return jax.tree_util.tree_unflatten(self.treedef, leaves)


def keep(tree, directory: str | None) -> Any:
  """tree copied: into `directory` (a Spilled), or in memory where directory is None."""
  if tree is None:
    return None
  if directory is None:
    return jax.tree_util.tree_map(jnp.copy, tree)
  return Spilled(tree, directory)


def load(kept) -> Any:
  """What keep() returned, as a pytree."""
  return kept.load() if isinstance(kept, Spilled) else kept


@dataclasses.dataclass(frozen=True)
class KeptContext:
  """A calibration.UpdateContext read from its record (params and opt_state properties) on each use: a calibration
  keeps its contexts, and a real model's params copies (0.5 GB each for SmolLM2) stay on disk, not in host memory."""

  record: Any
  logp: Any = None
  params = property(lambda self: self.record.params)
  opt_state = property(lambda self: self.record.opt_state)
