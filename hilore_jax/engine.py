"""The sharded train state and its compiled steps: one set-up shared by the trainer and the bench.

`Stepper` is the one owner of compilation: every train step (and every probe compile the memory manager asks
for through its hooks) is compiled here, once per StepSpec, ahead of time with explicit shardings and donation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hilore_jax import logra, model, optim, sharding, train_step
from hilore_jax.config import Config, KLControlConfig
from hilore_jax.memory import exposure
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.train_step import StepSpec

log = logging.getLogger(__name__)


def opt_state_shardings(optimizer: optax.GradientTransformation, opt_shape, param_sh, rep):
  """Param-shaped optimizer state takes the params' shardings (optax.tree_map_params), the rest is replicated.

  LoGRA's init needs real leaf shapes and names, which tree_map_params' placeholders lack: its state is mapped by
  logra.state_shardings (dense moments as their params, the small sketched state replicated), every other leaf
  of such a chain (counts, clipping's empty state) replicated.
  """
  is_logra = lambda x: isinstance(x, logra.LograState)
  if not any(is_logra(x) for x in jax.tree_util.tree_leaves(opt_shape, is_leaf=is_logra)):
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, param_sh, transform_non_params=lambda _: rep)
  return jax.tree_util.tree_map(lambda x: logra.state_shardings(x, param_sh, rep) if is_logra(x) else rep, opt_shape,
                                is_leaf=is_logra)


def init_state(mesh, optimizer: optax.GradientTransformation, params_shape, make_params) -> tuple[dict, dict]:
  """(state, state shardings): params from make_params(param shardings), optimizer state created sharded."""
  param_sh = sharding.param_shardings(mesh, params_shape)
  params = make_params(param_sh)
  opt_shape = jax.eval_shape(optimizer.init, params_shape)
  rep = sharding.replicated(mesh)
  opt_sh = opt_state_shardings(optimizer, opt_shape, param_sh, rep)
  state_sh = {"params": param_sh, "opt_state": opt_sh, "step": rep}
  opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  # from a host value: device_put of a committed device array onto a mesh spanning processes makes a broken array
  return {"params": params, "opt_state": opt_state, "step": jax.device_put(np.int32(0), rep)}, state_sh


def _memory(compiled) -> tuple[int, int]:
  mem = compiled.memory_analysis()
  return int(getattr(mem, "temp_size_in_bytes", 0) or 0), int(getattr(mem, "output_size_in_bytes", 0) or 0)


def _flops(compiled, key: str = "flops") -> float:
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get(key, 0.0))


@dataclasses.dataclass
class Step:
  """The compiled train step: a gradient program (per StepSpec) then an update program (one per optimizer).

  Two programs, because with global-norm clipping in the same program as the backward XLA:CPU (which drops the
  optimization barriers that order remat) hoists recomputation into the forward and keeps most of what remat
  frees. peak_bytes is the step's memory beyond the state (params and optimizer state, arguments of both programs
  and the same for every remat policy): the larger program's temp plus the gradients that live between them. With
  KL control the update program also takes the minibatch's log-prob inputs (`kl_keys`) and its temp includes the
  KL's forward and JVP on them, so the max stays honest.
  """

  grad: Any
  update: Any
  grad_temp_bytes: int
  update_temp_bytes: int
  grad_bytes: int
  kl_keys: tuple[str, ...] = ()

  @property
  def peak_bytes(self) -> int:
    return max(self.grad_temp_bytes, self.update_temp_bytes) + self.grad_bytes

  @property
  def flops(self) -> float:
    return _flops(self.grad) + _flops(self.update)

  @property
  def bytes_accessed(self) -> float:
    """XLA's estimate of the bytes both programs read and write."""
    return _flops(self.grad, "bytes accessed") + _flops(self.update, "bytes accessed")

  def __call__(self, state: dict, batch: dict):
    grads, metrics = self.grad(state["params"], train_step.step_inputs(batch))
    if self.kl_keys:
      state, m = self.update(state, grads, {k: batch[k] for k in self.kl_keys})
    else:
      state, m = self.update(state, grads)
    return state, {**metrics, **m}


def _abstract(tree, shardings):
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Stepper:
  """Compiles the train step once per StepSpec and batch shapes, and counts and logs every compilation.

  The update program does not depend on the remat policies: it is compiled once (with KL control: once per
  minibatch shape) and shared by every Step.
  """

  def __init__(self, mesh, optimizer, state, state_shardings, kl_control: KLControlConfig | None = None):
    self.mesh, self.optimizer, self.state_shardings = mesh, optimizer, state_shardings
    self.kl = kl_control if kl_control is not None and kl_control.target > 0 else None
    self.state_abstract = _abstract(state, state_shardings)
    self._compiled: dict[tuple, Step] = {}
    self._probed: dict[tuple, Step] = {}  # compiled only to read their memory; promoted (not recompiled) if run
    self._updates: dict[Any, Any] = {}
    self.compile_count = 0
    self.compile_log: list[dict] = []
    self.probe_compiles = 0  # compiled to measure memory (the GC reference, budget probes)

  def update_program(self, spec: StepSpec, batch: dict):
    """The update program; with KL control keyed by the spec without its policies and the log-prob inputs' shapes."""
    param_sh, metrics_sh = self.state_shardings["params"], sharding.replicated(self.mesh)
    if self.kl is None:
      if None not in self._updates:
        fn = jax.jit(lambda s, g: train_step.update_step(s, g, self.optimizer),
                     in_shardings=(self.state_shardings, param_sh), out_shardings=(self.state_shardings, metrics_sh),
                     donate_argnums=0)
        self._updates[None] = fn.lower(self.state_abstract, self.state_abstract["params"]).compile()
      return self._updates[None]
    spec = dataclasses.replace(spec, policies=())  # the KL's forward has no backward: no remat to choose
    kl_batch = {k: batch[k] for k in train_step.LOGPROB_KEYS}
    key = (spec, tuple((k, v.shape, str(v.dtype)) for k, v in kl_batch.items()))
    if key not in self._updates:
      batch_sh = {k: sharding.batch_sharding(self.mesh) for k in kl_batch}
      fn = jax.jit(lambda s, g, b: train_step.update_step(s, g, self.optimizer, b, spec, self.kl),
                   in_shardings=(self.state_shardings, param_sh, batch_sh),
                   out_shardings=(self.state_shardings, metrics_sh), donate_argnums=0)
      self._updates[key] = fn.lower(self.state_abstract, self.state_abstract["params"],
                                    _abstract(kl_batch, batch_sh)).compile()
    return self._updates[key]

  def _compile(self, spec: StepSpec, batch: dict) -> Step:
    batch_sh = {k: sharding.batch_sharding(self.mesh) for k in batch}
    param_sh, metrics_sh = self.state_shardings["params"], sharding.replicated(self.mesh)
    metrics_sh = {**{k: metrics_sh for k in train_step.SCALAR_METRICS},
                  train_step.TOKEN_LOGP: sharding.batch_sharding(self.mesh)}
    fn = jax.jit(lambda p, b: train_step.gradient_step(p, b, spec), in_shardings=(param_sh, batch_sh),
                 out_shardings=(param_sh, metrics_sh))
    grad = fn.lower(self.state_abstract["params"], _abstract(batch, batch_sh)).compile()
    update = self.update_program(spec, batch)
    grad_temp, grad_out = _memory(grad)
    update_temp, _ = _memory(update)
    return Step(grad, update, grad_temp, update_temp, grad_out, train_step.LOGPROB_KEYS if self.kl else ())

  def with_update_of(self, step: Step, spec: StepSpec, batch: dict) -> Step:
    """step's gradient program with this stepper's update program (another optimizer's; the gradient program does
    not depend on it): to measure optimizers without recompiling the gradient."""
    update = self.update_program(spec, batch)
    return dataclasses.replace(step, update=update, update_temp_bytes=_memory(update)[0],
                               kl_keys=train_step.LOGPROB_KEYS if self.kl else ())

  def get(self, spec: StepSpec, batch: dict, reason: str = "", count: bool = True) -> Step:
    """The compiled step; count=False compiles only to measure (a probe), counted as a compile if it later runs."""
    batch = train_step.step_inputs(batch)
    key = (spec, tuple((k, v.shape, str(v.dtype)) for k, v in sorted(batch.items())))
    if key in self._probed:
      if not count:
        return self._probed[key]
      self._compiled[key] = self._probed.pop(key)
      self._count(reason, 0.0, key)
    if key not in self._compiled:
      t0 = time.perf_counter()
      step = self._compile(spec, batch)
      if not count:
        self.probe_compiles += 1
        self._probed[key] = step
        return step
      self._compiled[key] = step
      self._count(reason, time.perf_counter() - t0, key)
    return self._compiled[key]

  def _count(self, reason: str, seconds: float, key):
    self.compile_count += 1
    entry = {"count": self.compile_count, "reason": reason or "first use", "seconds": seconds,
             "peak_bytes": self._compiled[key].peak_bytes}
    self.compile_log.append(entry)
    log.info("compiled train step #%d (%s) in %.1fs, peak %d bytes", entry["count"], entry["reason"],
             entry["seconds"], entry["peak_bytes"])

  def __call__(self, spec: StepSpec, state, batch: dict, reason: str = ""):
    return self.get(spec, batch, reason)(state, batch)


# ----------------------------------------------------------------------------- set-up


def model_config(cfg: Config) -> model.ModelConfig:
  """The model's shape: from model.path's config.json, or the config's shape fields."""
  if cfg.model.path:
    from hilore_jax import preflight

    return preflight.load_model_config("model.path", cfg.model.path, cfg.model)
  return cfg.model.shape_config()


@dataclasses.dataclass
class Engine:
  """Mesh, optimizer, sharded state and the step compiler of one run."""

  mesh: Any
  optimizer: optax.GradientTransformation
  state: dict
  state_shardings: dict
  stepper: Stepper

  @property
  def param_shardings(self):
    return self.state_shardings["params"]


def build(cfg: Config, model_cfg: model.ModelConfig, total_updates: int, host_params: dict | None = None,
          rng: jax.Array | None = None) -> Engine:
  """The run's engine: params from host_params (a loaded checkpoint) or initialised from rng, created sharded."""
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
  optimizer = optim.make_optimizer(cfg.optimizer, total_updates)
  rng = jax.random.PRNGKey(cfg.seed) if rng is None else rng
  init = lambda k: model.init_params(model_cfg, k, cfg.model.init_std)
  params_shape = jax.eval_shape(init, rng)
  if host_params is not None:
    make = lambda sh: jax.device_put(host_params, sh)
  else:
    make = lambda sh: jax.jit(init, out_shardings=sh)(rng)
  state, state_sh = init_state(mesh, optimizer, params_shape, make)
  return Engine(mesh, optimizer, state, state_sh, Stepper(mesh, optimizer, state, state_sh, cfg.optimizer.kl_control))


# one jitted gradient for the module: specs are static, so repeated specs compile once
_grad = jax.jit(lambda p, b, s: train_step.grads_and_stats(p, b, s)[0], static_argnums=2)


def memory_hooks(stepper: Stepper, spec: StepSpec) -> StepHooks:
  """This trainer's side of the memory manager: compile probes, gradients, loss coefficients, unit tensors.

  Per device: compiled peaks are XLA's per-device figures, so batch_shape gives one device's rows of a microbatch
  (the batch axis is split over every mesh axis), and unit bytes and the op profile follow from it.
  """
  cfg = spec.model_cfg
  shards = 1 if stepper is None else sharding.num_batch_shards(stepper.mesh)
  with_policies = lambda pols: dataclasses.replace(spec, policies=tuple(pols))

  def token_weights(params, batch, switches):
    # params None: the policy before the update, which is the one that produced old_logp (ratio 1 on-policy)
    # unless the batch carries its log-probs as `logp` (replayed rows: old_logp is the stored behaviour's); on
    # rows flagged on_policy without `logp`, old_logp, and so this logp, is a placeholder (only the KL reads it)
    if params is None:
      logp = batch.get("logp", batch.get("old_logp", jnp.zeros(batch["mask"].shape, jnp.float32)))
    else:
      logp, _ = train_step.completion_logprobs(cfg, params, batch, None, spec.logprob_chunk, spec.temperature)
    old = train_step.old_logprobs(logp, batch, spec)
    ref = batch["ref_logp"] if spec.use_ref_logp and "ref_logp" in batch else logp
    return exposure.token_weights(logp, old, ref, batch["adv"], batch["mask"], spec.loss_cfg, switches)

  def unit_tensors(params, batch):
    ids, mask = train_step.sequence_inputs(batch)
    P, N = batch["prompt_ids"].shape[1], batch["tokens"].shape[1]
    taps: dict = {}
    model.hidden_states(cfg, params, ids, mask, taps=taps)
    return [{k: v[layer, :, P - 1:P + N - 1] for k, v in taps.items()} for layer in range(cfg.num_hidden_layers)]

  return StepHooks(
      model_cfg=cfg,
      compile_peak=lambda pols, batch: stepper.get(with_policies(pols), batch, count=False).peak_bytes,
      batch_shape=lambda b: (-(-b["tokens"].shape[0] // (spec.microbatches * shards)),
                             b["prompt_ids"].shape[1] + b["tokens"].shape[1]),
      gradient=lambda p, b, pols: _grad(p, train_step.step_inputs(b), with_policies(pols)),
      probe_gradient=lambda p, b, mix, fmt, group: _grad(
          p, {**train_step.step_inputs(b), "lowp_probe": mix},
          dataclasses.replace(spec, policies=(model.NO_REMAT,) * cfg.num_hidden_layers, lowp_probe=(fmt, group))),
      token_weights=token_weights, unit_tensors=unit_tensors)
