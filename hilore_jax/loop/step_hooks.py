"""The trainer's side of the memory manager (`memory.StepHooks`): compile probes on the engine's Stepper, exact and
probe gradients, the GRPO loss coefficients of an update batch, and the units' activations."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hilore_jax import model, sharding
from hilore_jax.loop.engine import Stepper
from hilore_jax.memory import exposure
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.model import lora
from hilore_jax.model.decoder import WEIGHT_READS, weight_read_leaves
from hilore_jax.rl import packing, prompt_share, train_step
from hilore_jax.rl.train_step import StepSpec
from hilore_jax.rl.update_batch import UpdateBatch

# one jitted gradient for the module: specs are static, so repeated specs compile once. The manager reads gradients
# per layer: from params in the train layout (stacked layers) they come back unstacked
_grad = jax.jit(lambda p, b, s, mix: model.unstacked(train_step.grads_and_stats(p, b, s, mix)[0]), static_argnums=2)


def error_channels(cfg, params) -> dict:
  """Each weight-read kind's error channels (model/lowp.py), zeros stacked over the layers: one per trained leaf
  that reads the kind's unit (decoder.weight_read_leaves), shaped like it: its projections' weights, or under LoRA
  (whose frozen weights have no gradient) the A of each adapter on them. A kind no trained leaf reads (a LoRA whose
  targets skip its projections) has none: its L error reaches no gradient."""
  layer = model.layer_params(lora.trainable(params), 0)
  return {kind: tuple(jnp.zeros((cfg.num_hidden_layers,) + layer[a][b].shape, jnp.float32) for a, b in paths)
          for kind, paths in weight_read_leaves(cfg).items() if paths}


@functools.partial(jax.jit, static_argnums=2)
def _weight_errors(params, batch, spec: StepSpec):
  """(exact gradient, [L, len(WEIGHT_READS)] ||dg_u||): the probe at zero mix, each weight-read unit's error channels
  differentiated alongside what trains. A channel's gradient is what that unit's int8 round trip alone adds to the
  gradient of the leaf it stands for (e^T ct: the VJP of the leaf's product is linear in the unit, e = decoded -
  exact), so ||dg_u|| is the norm of the difference between the gradient with that unit L and the exact one; 0
  exactly for a kind with no channel (error_channels)."""
  cfg = spec.model_cfg
  channels = error_channels(cfg, params)
  probe = {"mix": jnp.zeros((cfg.num_hidden_layers, len(model.UNITS)), jnp.float32), "channels": channels}
  (g, g_probe), _ = train_step.grads_and_stats(params, batch, spec, probe, wrt_probe=True)
  sq = lambda c: jnp.sum(jnp.square(c), axis=tuple(range(1, c.ndim)))
  norm_L = lambda kind: (jnp.sqrt(sum(sq(c) for c in g_probe["channels"][kind])) if kind in channels
                         else jnp.zeros((cfg.num_hidden_layers,), jnp.float32))
  return model.unstacked(g), jnp.stack([norm_L(kind) for kind in WEIGHT_READS], axis=1)


def _per_layer_update(update):
  """optimizer.update taking and giving per-layer gradients and updates (what the manager reads), whatever the
  layout of the params and optimizer state it is given (the train layout stacks the layers)."""

  def call(grads, opt_state, params):
    if not model.is_stacked(params):
      return update(grads, opt_state, params)
    updates, opt_state = update(model.stacked(grads), opt_state, params)
    return model.unstacked(updates), opt_state

  return call


def memory_hooks(stepper: Stepper | None, spec: StepSpec, max_grad_norm: float = 0.0) -> StepHooks:
  """This trainer's side of the memory manager: compile probes, gradients, loss coefficients, unit tensors.

  Per device: compiled peaks are XLA's per-device figures, so batch_shape gives one device's rows of a microbatch
  (the batch axis is split over every mesh axis), and unit bytes and the op profile follow from it. stepper None:
  no compile probes and no optimizer (calibration alone). max_grad_norm: the optimizer's clip (the clipped risk).
  """
  cfg = spec.model_cfg
  shards = 1 if stepper is None else sharding.num_batch_shards(stepper.mesh)
  with_policies = lambda pols: dataclasses.replace(spec, policies=tuple(pols))
  probe_spec = dataclasses.replace(spec, policies=(model.NO_REMAT,) * cfg.num_hidden_layers)

  def token_weights(params, batch: UpdateBatch, switches, logp=None):
    # params None: from what the batch carries. The policy before the update produced old_logp (ratio 1 on-policy)
    # unless `logp` gives the current log-probs (a previous pass's, or replayed rows' whose old_logp is the stored
    # behaviour's); on rows flagged on_policy without them old_logp, and so this logp, is a placeholder (only the KL
    # reads it)
    if params is not None:
      logp, _ = train_step.completion_logprobs(cfg, params, batch, None, spec.logprob_chunk, spec.temperature)
    elif logp is None:
      logp = batch.old_logp if batch.old_logp is not None else jnp.zeros(batch.mask.shape, jnp.float32)
    old = train_step.old_logprobs(logp, batch, spec)
    ref = batch.ref_logp if spec.use_ref_logp and batch.ref_logp is not None else logp
    return exposure.token_weights(logp, old, ref, batch.adv, batch.mask, spec.loss_cfg, switches)

  def unit_tensors(params, batch: UpdateBatch):
    ids, mask = train_step.sequence_inputs(batch)
    taps: dict = {}
    model.hidden_states(cfg, params, ids, mask, taps=taps)
    # every position but the last: the completion's last token predicts nothing, the prompt's positions feed the
    # completion's attention (their cotangent is not zero)
    T = batch.prompt_len + batch.completion_len - 1
    return [{k: v[layer][:, :T] for k, v in taps.items()} for layer in range(cfg.num_hidden_layers)]

  def logprobs(params, batch: UpdateBatch):
    return train_step.completion_logprobs(cfg, params, batch, None, spec.logprob_chunk, spec.temperature)[0]

  def optimizer_update(grads, opt_state, params):  # the optimizer sees what trains (a LoRA model's adapters)
    return stepper.optimizer.update(grads, opt_state, lora.trainable(params))

  return StepHooks(
      model_cfg=cfg,
      compile_peak=lambda pols, batch: stepper.get(with_policies(pols), batch, count=False).peak_bytes,
      # a packed microbatch counts its buffer's positions (and its table's prompts once)
      batch_shape=lambda b: (packing.activation_shape(b, shards) if b.packing is not None
                             else prompt_share.activation_shape(b, spec.microbatches, shards)),
      gradient=lambda p, b, pols: _grad(p, b, with_policies(pols), None),
      probe_gradient=lambda p, b, mix, fmt, group: _grad(p, b, dataclasses.replace(probe_spec, lowp_probe=(fmt, group)),
                                                         mix),
      # a weight-read unit's error lands in its projections' weight gradients, or with LoRA's frozen weights in the
      # A gradients of the adapters on them: the error channels stand for those leaves (error_channels)
      probe_errors=lambda p, b, fmt, group: _weight_errors(p, b, dataclasses.replace(probe_spec,
                                                                                    lowp_probe=(fmt, group))),
      token_weights=token_weights, unit_tensors=unit_tensors, logprobs=logprobs,
      optimizer_update=None if stepper is None else _per_layer_update(optimizer_update),
      max_grad_norm=max_grad_norm)
