"""A run's checkpoints (checkpoint.*): the train state's checkpoint (rl/train_state.py), the KL reference and the
replay buffer as arrays (checkpointing.run_tree), and the host side of the run as JSON metadata: the step, the data
stream's position, the RNG, the evaluation before training, the warm-start losses, the memory manager's state and
the learner (LoRA's rank and base). A hook saves after every checkpoint.every-th step and after the last."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import runtime, sharding
from hilore_jax.loop import adapters, checkpointing, engine
from hilore_jax.rl import replay

if TYPE_CHECKING:
  from hilore_jax.loop.callbacks import StepInfo
  from hilore_jax.loop.trainer import Trainer

log = logging.getLogger(__name__)


class RunCheckpoints:
  """Saves and restores one trainer's run; remembers the step last saved (what a diverged run can go back to)."""

  def __init__(self, t: Trainer):
    self.t = t
    self.checkpointer = checkpointing.Checkpointer(os.path.join(t.out_dir, "checkpoints"), t.config.checkpoint.keep)
    self.last_saved: int | None = None

  def _tree(self) -> tuple[dict, dict]:
    """(tree, shardings) of a checkpoint: train state, reference params (KL), replay buffer (host arrays)."""
    t, eng = self.t, self.t.engine
    replay_state = t.replay.state() if t.replay is not None else None  # the same on every process
    tree = checkpointing.run_tree(t.state.checkpoint(), t.ref_params, replay_state)
    rep = sharding.replicated(eng.mesh)
    sh = checkpointing.run_tree(eng.state_shardings.checkpoint(),
                                eng.param_shardings if t.ref_params is not None else None,
                                jax.tree.map(lambda _: rep, replay_state))
    return tree, sh

  def save(self, step: int):
    t = self.t
    meta = {"step": step, "data_position": t.data_position,
            "rng": np.asarray(jax.random.key_data(t.rng)).tolist(), "eval_before": t.eval_before,
            "warmstart_losses": t.warmstart_losses, "config": t.config.to_dict(),
            "memory_manager": t.memory.state_json() if t.memory is not None else None,
            "lora": adapters.checkpoint_meta(t.model_cfg, t.base),
            checkpointing.LAYERS_KEY: checkpointing.STACKED}
    self.checkpointer.save(step, self._tree()[0], meta)
    self.last_saved = step
    runtime.release_host_memory()  # the save's host copies, freed

  def hook(self, info: StepInfo) -> None:
    """Save after info.step unless that step is saved already (a last step that checkpoint.every divides)."""
    if info.step != self.last_saved:
      self.save(info.step)

  def restore_latest(self) -> bool:
    """Restore the newest intact checkpoint into the trainer (a damaged newer one is reported and skipped); False
    if there is none."""
    t = self.t
    latest = self.checkpointer.latest_step()
    if latest is not None:  # a checkpoint of another learner or base is refused, never restored onto this one
      adapters.check_checkpoint(self.checkpointer.restore_meta(latest), t.model_cfg, t.base, latest)
    if t.config.grpo.beta > 0 and not t.config.lora.enabled:
      t.ref_params = t.state.params  # shape donor; replaced by the restored reference
    tree, shardings = self._tree()
    found = checkpointing.restore_train_layout(self.checkpointer, engine.abstract(tree, shardings), shardings)
    if found is None:
      t.ref_params = None
      return False
    _, tree, meta = found
    t.state = t.state.restored(tree["train"])
    t.ref_params = tree.get("ref")
    if t.replay is not None:
      t.replay = replay.ReplayBuffer.from_state(t.config.replay, jax.device_get(tree["replay"]))
    t.start_step = self.last_saved = int(meta["step"])
    t.data_position = int(meta["data_position"])
    t.rng = jnp.asarray(np.asarray(meta["rng"], np.uint32))
    t.eval_before = meta.get("eval_before") or {}
    t.warmstart_losses = meta.get("warmstart_losses") or []
    if t.memory is not None and meta.get("memory_manager"):
      t.memory.load_state(meta["memory_manager"])
    log.info("resumed from step %d (data position %d)", t.start_step, t.data_position)
    return True
