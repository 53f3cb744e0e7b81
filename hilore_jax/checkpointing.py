"""Orbax checkpoints of the train state plus JSON metadata (step, RNG, data position, config)."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """CheckpointManager wrapper: atomic saves (orbax writes to a temp dir, then renames), keeps the last K."""

  def __init__(self, directory: str, keep: int, create: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict):
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                      force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
    """State restored straight into the shardings that abstract_state carries."""
    out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                             meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def restore_meta(self, step: int) -> dict:
    """Only the JSON metadata of a checkpoint."""
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def close(self):
    self.manager.close()


def abstract_with_shardings(tree, shardings):
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
