"""The train state as one typed pytree: params, optimizer state and step, with LoRA's frozen/trainable split.

Built in one place (`create`, `abstract`; the engine's shardings are a TrainState of shardings), advanced only by
`take_step` inside the update program, and written to a checkpoint in one layout (`checkpoint`, `restored`). As
levanter's `TrainerState` keeps the whole model with a filter of what trains, this keeps the whole params and
derives what trains from them (`model.lora.partition`: a LoRA model's adapters, else every parameter): the
gradient, the optimizer and its state, and a checkpoint see only that part. A chex dataclass: its leaves flatten in
name order (opt_state, params, step), as the dict it replaces did, and it reads as a Mapping too
(`state["params"]`), so the lab's reads run unchanged.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hilore_jax.model import lora


@chex.dataclass(frozen=True)
class TrainState:
  """params (the whole tree, in the train layout), opt_state (over what trains), step (optimizer updates done, int32
  scalar); leaves are arrays, shardings or abstract values alike."""

  params: Any
  opt_state: Any
  step: Any

  @property
  def split(self) -> lora.Split:
    """The params as their frozen base (None without LoRA) and what trains."""
    return lora.partition(self.params)

  @property
  def trainable(self):
    """What trains: a LoRA model's adapters, else the params."""
    return self.split.trainable

  def take_step(self, updates, opt_state) -> TrainState:
    """The state after one optimizer update: updates (shaped like what trains) applied, the optimizer's new state
    and the step count advanced."""
    split = self.split
    params = split.combined(optax.apply_updates(split.trainable, updates))
    return self.replace(params=params, opt_state=opt_state, step=self.step + 1)

  def checkpoint(self) -> dict:
    """What a checkpoint holds (its on-disk layout, unchanged since the state was a dict): what trains, the optimizer
    state and the step; the frozen base is saved by identity (loop/adapters.py), not as arrays."""
    return {"params": self.trainable, "opt_state": self.opt_state, "step": self.step}

  def restored(self, tree: dict) -> TrainState:
    """The state a checkpoint tree describes, on this state's frozen base."""
    return TrainState(params=self.split.combined(tree["params"]), opt_state=tree["opt_state"], step=tree["step"])


def create(params, optimizer: optax.GradientTransformation, shardings: TrainState | None = None) -> TrainState:
  """A fresh state on params: the optimizer state created over what trains (sharded by shardings.opt_state where
  given, in one program: never built whole and resharded), the step 0."""
  init = jax.jit(optimizer.init) if shardings is None else jax.jit(optimizer.init, out_shardings=shardings.opt_state)
  # from a host value: device_put of a committed device array onto a mesh spanning processes makes a broken array
  step = np.int32(0) if shardings is None else jax.device_put(np.int32(0), shardings.step)
  return TrainState(params=params, opt_state=init(lora.trainable(params)), step=step)


def abstract(params_shape, optimizer: optax.GradientTransformation) -> TrainState:
  """The state's shapes and dtypes (nothing allocated): to compile, measure or restore into."""
  return TrainState(params=params_shape, opt_state=jax.eval_shape(optimizer.init, lora.trainable(params_shape)),
                    step=jax.ShapeDtypeStruct((), jnp.int32))

