"""The one jitted GRPO actor update: microbatched gradients, optax update, shardings and donation."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from hilore_jax import grpo, logprobs, model, sharding
from hilore_jax.model import LayerPolicy
from hilore_jax.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """Everything static about the compiled step; a new value means a new compilation."""

  model_cfg: ModelConfig
  loss_cfg: grpo.LossConfig
  policies: tuple[LayerPolicy, ...]
  microbatches: int = 1
  logprob_chunk: int = 128
  use_old_logp: bool = False  # False: on-policy single update, old = stop_gradient(logp) (ratio == 1)
  use_ref_logp: bool = False


def sequence_inputs(batch: dict) -> tuple[jax.Array, jax.Array]:
  """Prompt (left-padded) + completion (right-padded) ids and attention mask [B, P+N]."""
  ids = jnp.concatenate([batch["prompt_ids"], batch["tokens"]], axis=1)
  mask = jnp.concatenate([batch["prompt_mask"], batch["mask"]], axis=1)
  return ids, mask


def completion_logprobs(cfg: ModelConfig, params, batch: dict, policies=None, chunk: int = 128):
  """(log pi(completion token), entropy) [B, N] with chunked log-softmax over the vocabulary."""
  ids, mask = sequence_inputs(batch)
  P, N = batch["prompt_ids"].shape[1], batch["tokens"].shape[1]
  h = model.hidden_states(cfg, params, ids, mask, layer_policies=policies)
  # position t predicts token t+1: completion token j is predicted at P - 1 + j
  return logprobs.token_logprobs(h[:, P - 1:P + N - 1], model.lm_head_weight(cfg, params), batch["tokens"], chunk)


def loss_and_stats(params, batch: dict, spec: StepSpec, num_seqs, num_tokens):
  logp, entropy = completion_logprobs(spec.model_cfg, params, batch, spec.policies, spec.logprob_chunk)
  old = batch["old_logp"] if spec.use_old_logp else jax.lax.stop_gradient(logp)
  ref = batch["ref_logp"] if spec.use_ref_logp else jax.lax.stop_gradient(logp)
  loss, stats = grpo.grpo_loss(logp, old, ref, batch["adv"], batch["mask"], spec.loss_cfg, num_seqs, num_tokens)
  stats["entropy_sum"] = jnp.sum(entropy * batch["mask"])
  stats["loss"] = loss
  return loss, stats


def grads_and_stats(params, batch: dict, spec: StepSpec):
  """Gradient of the minibatch loss, accumulated over spec.microbatches slices (normalisers are global)."""
  num_seqs, num_tokens = grpo.normalisers(batch["mask"])
  grad_fn = jax.grad(loss_and_stats, has_aux=True)
  if spec.microbatches == 1:
    return grad_fn(params, batch, spec, num_seqs, num_tokens)
  A = spec.microbatches
  split = jax.tree_util.tree_map(lambda x: x.reshape(A, x.shape[0] // A, *x.shape[1:]), batch)

  def body(acc, mb):
    g, s = grad_fn(params, mb, spec, num_seqs, num_tokens)
    return jax.tree_util.tree_map(jnp.add, acc, (g, s)), None

  first = jax.tree_util.tree_map(lambda x: x[0], split)
  shapes = jax.eval_shape(lambda p, b: grad_fn(p, b, spec, num_seqs, num_tokens), params, first)
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  (grads, stats), _ = jax.lax.scan(body, zeros, split)
  return grads, stats


def step_metrics(stats: dict) -> dict:
  """Per-token means of the minibatch's loss statistics (computed in the gradient program)."""
  tokens = jnp.maximum(stats["tokens"], 1.0)
  return {"loss": stats["loss"], "clipfrac": stats["clipped_tokens"] / tokens, "kl": stats["kl_sum"] / tokens,
          "entropy": stats["entropy_sum"] / tokens, "tokens": stats["tokens"]}


def gradient_step(params, batch: dict, spec: StepSpec):
  """The gradient program: (grads, metrics) of one minibatch under spec's remat policies."""
  grads, stats = grads_and_stats(params, batch, spec)
  return grads, step_metrics(stats)


def update_step(state: dict, grads, optimizer: optax.GradientTransformation):
  """The update program: clipping and the optimizer on finished gradients -> (new state, metrics)."""
  updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"grad_norm": optax.tree.norm(grads)}


def train_step(state: dict, batch: dict, spec: StepSpec, optimizer: optax.GradientTransformation):
  """One optimizer update on a minibatch -> (new state, metrics), as one function (what the two programs compute).

  The trainer runs it as two compiled programs (`Step`): with global-norm clipping in the same program as the
  backward, XLA:CPU, which drops the optimization barriers that order remat, hoists recomputation into the forward
  and keeps most of what remat was meant to free.
  """
  grads, metrics = gradient_step(state["params"], batch, spec)
  state, m = update_step(state, grads, optimizer)
  return state, {**metrics, **m}


def init_state(mesh, optimizer: optax.GradientTransformation, params_shape, make_params) -> tuple[dict, dict]:
  """(state, state shardings): params from make_params(param shardings), optimizer state created sharded."""
  param_sh = sharding.param_shardings(mesh, params_shape)
  params = make_params(param_sh)
  opt_shape = jax.eval_shape(optimizer.init, params_shape)
  rep = sharding.replicated(mesh)
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, param_sh, transform_non_params=lambda _: rep)
  state_sh = {"params": param_sh, "opt_state": opt_sh, "step": rep}
  opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  return {"params": params, "opt_state": opt_state, "step": jax.device_put(jnp.int32(0), rep)}, state_sh


def batch_keys(spec: StepSpec) -> tuple[str, ...]:
  keys = ["prompt_ids", "prompt_mask", "tokens", "mask", "adv"]
  if spec.use_old_logp:
    keys.append("old_logp")
  if spec.use_ref_logp:
    keys.append("ref_logp")
  return tuple(keys)


def _memory(compiled) -> tuple[int, int]:
  mem = compiled.memory_analysis()
  return int(getattr(mem, "temp_size_in_bytes", 0) or 0), int(getattr(mem, "output_size_in_bytes", 0) or 0)


def _flops(compiled) -> float:
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0))


@dataclasses.dataclass
class Step:
  """The compiled train step: a gradient program (per StepSpec) then an update program (one per optimizer).

  peak_bytes is the step's memory beyond the state (params and optimizer state, arguments of both programs and
  the same for every remat policy): the larger program's temp plus the gradients that live from one to the other.
  """

  grad: Any
  update: Any
  grad_temp_bytes: int
  update_temp_bytes: int
  grad_bytes: int

  @property
  def peak_bytes(self) -> int:
    return max(self.grad_temp_bytes, self.update_temp_bytes) + self.grad_bytes

  @property
  def flops(self) -> float:
    return _flops(self.grad) + _flops(self.update)

  def __call__(self, state: dict, batch: dict):
    grads, metrics = self.grad(state["params"], batch)
    state, m = self.update(state, grads)
    return state, {**metrics, **m}


class Stepper:
  """Compiles the train step once per StepSpec (AOT, with shardings and donation) and counts compilations.

  The update program does not depend on the spec: it is compiled once and shared by every Step.
  """

  def __init__(self, mesh, optimizer, state_shardings):
    self.mesh, self.optimizer, self.state_shardings = mesh, optimizer, state_shardings
    self._compiled: dict[tuple, Step] = {}
    self._probed: dict[tuple, Step] = {}  # compiled only to read their memory; promoted (not recompiled) if run
    self._update = None
    self.compile_count = 0
    self.compile_log: list[dict] = []
    self.reference_compiles = 0  # compiled to measure memory (the GC reference, budget probes); counted when run

  def _abstract(self, tree, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

  def _update_program(self, state):
    if self._update is None:
      param_sh, metrics_sh = self.state_shardings["params"], sharding.replicated(self.mesh)
      fn = jax.jit(lambda s, g: update_step(s, g, self.optimizer), in_shardings=(self.state_shardings, param_sh),
                   out_shardings=(self.state_shardings, metrics_sh), donate_argnums=0)
      abstract = self._abstract(state, self.state_shardings)
      self._update = fn.lower(abstract, abstract["params"]).compile()
    return self._update

  def _compile(self, spec: StepSpec, state, batch: dict) -> Step:
    batch_sh = {k: sharding.batch_sharding(self.mesh) for k in batch}
    param_sh, metrics_sh = self.state_shardings["params"], sharding.replicated(self.mesh)
    fn = jax.jit(lambda p, b: gradient_step(p, b, spec), in_shardings=(param_sh, batch_sh),
                 out_shardings=(param_sh, metrics_sh))
    grad = fn.lower(self._abstract(state["params"], param_sh), self._abstract(batch, batch_sh)).compile()
    update = self._update_program(state)
    grad_temp, grad_out = _memory(grad)
    update_temp, _ = _memory(update)
    return Step(grad, update, grad_temp, update_temp, grad_out)

  def get(self, spec: StepSpec, state, batch: dict, reason: str = "", count: bool = True) -> tuple[Step, int]:
    """(compiled step, its peak bytes); count=False compiles only to measure (a probe), counted if it later runs."""
    key = (spec, tuple((k, v.shape, str(v.dtype)) for k, v in sorted(batch.items())))
    if key in self._probed:
      if not count:
        return self._probed[key], self._probed[key].peak_bytes
      self._compiled[key] = self._probed.pop(key)
      self._count(reason, 0.0, key)
    if key not in self._compiled:
      t0 = time.perf_counter()
      step = self._compile(spec, state, batch)
      if not count:
        self.reference_compiles += 1
        self._probed[key] = step
        return step, step.peak_bytes
      self._compiled[key] = step
      self._count(reason, time.perf_counter() - t0, key)
    return self._compiled[key], self._compiled[key].peak_bytes

  def _count(self, reason: str, seconds: float, key):
    self.compile_count += 1
    entry = {"count": self.compile_count, "reason": reason or "first use", "seconds": seconds,
             "peak_bytes": self._compiled[key].peak_bytes}
    self.compile_log.append(entry)
    log.info("compiled train step #%d (%s) in %.1fs, peak %d bytes", entry["count"], entry["reason"],
             entry["seconds"], entry["peak_bytes"])

  def __call__(self, spec: StepSpec, state, batch: dict, reason: str = ""):
    step, _ = self.get(spec, state, batch, reason)
    return step(state, batch)
