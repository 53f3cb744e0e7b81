"""What the memory manager needs from a trainer, as callables: it never imports a train step, so another JAX
trainer (a flax.nnx model, say) can use it by supplying these."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from hilore_jax.model import LayerPolicy, ModelConfig

Policies = Sequence[LayerPolicy]


@dataclasses.dataclass(frozen=True)
class StepHooks:
  """The trainer's side of the memory manager.

  compile_peak(policies, batch): compile the train step for these per-layer policies on this batch's shapes and
    return its peak bytes on one device (a probe: the trainer may keep the compiled step and reuse it if it runs).
  batch_shape(batch): (rows, sequence length) of the activations one gradient pass holds on one device (a
    microbatch's rows divided by the mesh axes the batch is split over), so unit bytes and the op profile are
    per device, like compile_peak and the budget.
  gradient(params, batch, policies): the parameter gradient under these policies (calibrated methods).
  probe_gradient(params, batch, mix [layers, units], format, group size): the gradient with every unit read in
    backward as exact + mix * (decoded - exact): one compiled program for any set of L units (calibration).
  token_weights(params, batch, switches, logp=None): |w_t| [B, N], the loss coefficient of every completion token;
    params None means from what the batch carries alone (no forward pass), with logp [B, N] the current policy's
    log-probs where known.
  unit_tensors(params, batch): per layer, the L-capable units' activations [B, P-1+N, ...] at every position whose
    activations reach a completion log-prob: the prompt's but its last, then the N that predict the completion
    tokens (for per-token reconstruction errors).
  op_profile(model_cfg, rows, seq, group_size): the op times the cost model prices plans with (default: measured).
  probe_errors(params, batch, format, group size): (the exact gradient, [layers, len(WEIGHT_READS)] the norm of each
    weight-read unit's L error on its projections' weight gradients, or under LoRA on the A gradients of their
    adapters; 0 where no trained leaf reads the unit), both from one backward: the probe program at zero mix with
    an error channel per such unit (model/lowp.py).
  logprobs(params, batch): the current policy's log-probs of the completion tokens [B, N] (a forward pass).
  optimizer_update(grads, opt_state, params) -> (updates, opt_state): the optimizer (optax), for the update risk
    metric; max_grad_norm: its global-norm clip (0: none), for the clipped one.
  Batches are the trainer's own; calibration reads only their masks `batch.mask` [B, N] and `batch.prompt_mask`
  [B, P] besides what these callables read.
  """

  model_cfg: ModelConfig
  compile_peak: Callable[[Policies, Any], int]
  batch_shape: Callable[[Any], tuple[int, int]]
  gradient: Callable[[Any, Any, Policies], Any] | None = None
  token_weights: Callable[..., jax.Array] | None = None
  unit_tensors: Callable[[Any, Any], list[dict[str, jax.Array]]] | None = None
  probe_gradient: Callable[[Any, Any, Any, str, int], Any] | None = None
  logprobs: Callable[[Any, Any], jax.Array] | None = None
  optimizer_update: Callable[[Any, Any, Any], Any] | None = None
  max_grad_norm: float = 0.0
  # op_profile(model_cfg, rows, seq, group_size): the cost model's op times ({"ops", "codec", "offload"} as
  # profile.profile_ops returns); None measures them on this machine. Given times make a plan independent of the
  # machine's speed (a test, a compile-only capacity search)
  op_profile: Callable[[ModelConfig, int, int, int], dict] | None = None
  probe_errors: Callable[[Any, Any, str, int], tuple[Any, jax.Array]] | None = None

  @property
  def calibrates(self) -> bool:
    return None not in (self.gradient, self.token_weights, self.unit_tensors, self.probe_gradient)
