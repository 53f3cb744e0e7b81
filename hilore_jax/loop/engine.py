"""The sharded train state and its compiled steps: one set-up shared by the trainer and the bench.

Where programs are compiled: `Stepper` compiles (ahead of time, with explicit shardings and donation), counts and
logs the train step (a gradient and an update program per StepSpec and batch signature, the memory manager's probe
compiles included) and the log-prob forward (old and reference log-probs). Besides it: `memory_hooks`' gradient
program (calibration's exact and probe gradients), the sampler's programs (rl/sampler.py), the warm-start step
(rl/sft.py) and the memory manager's exposure scorer (memory/manager.py).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

import jax
import optax

from hilore_jax import model, optim, sharding
from hilore_jax.model import lora
from hilore_jax.config import Config
from hilore_jax.optim import logra
from hilore_jax.optim.config import KLControlConfig
from hilore_jax.rl import prompt_share, train_state, train_step
from hilore_jax.rl.train_state import TrainState
from hilore_jax.rl.train_step import StepSpec
from hilore_jax.rl.update_batch import UpdateBatch

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


def init_state(mesh, optimizer: optax.GradientTransformation, params_shape, make_params
               ) -> tuple[TrainState, TrainState]:
  """(state, state shardings): params from make_params(param shardings), optimizer state created sharded over what
  trains (model.lora.partition: a LoRA model's adapters); with make_params None, the abstract state (shapes and
  dtypes only: to compile and measure, nothing allocated)."""
  shapes = train_state.abstract(params_shape, optimizer)
  param_sh, rep = sharding.param_shardings(mesh, params_shape), sharding.replicated(mesh)
  state_sh = TrainState(params=param_sh, step=rep,
                        opt_state=opt_state_shardings(optimizer, shapes.opt_state, lora.trainable(param_sh), rep))
  if make_params is None:
    return shapes, state_sh
  return train_state.create(make_params(param_sh), optimizer, state_sh), state_sh


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
  KL control the update program also takes the minibatch's sequences and its temp includes the KL's forward and JVP
  on them, so the max stays honest.
  """

  grad: Any
  update: Any
  grad_temp_bytes: int
  update_temp_bytes: int
  grad_bytes: int
  kl_control: bool = False  # the update program also takes the batch's sequences (predicted-KL step control)

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

  def program_costs(self, key: str) -> tuple[float, float]:
    """XLA's cost-analysis figure `key` ("flops", "bytes accessed") of the gradient and of the update program."""
    return _flops(self.grad, key), _flops(self.update, key)

  def __call__(self, state: TrainState, batch: UpdateBatch):
    grads, metrics = self.grad(state.params, batch)
    if self.kl_control:
      state, m = self.update(state, grads, batch.sequences())
    else:
      state, m = self.update(state, grads)
    return state, {**metrics, **m}


def abstract(tree, shardings):
  """ShapeDtypeStructs of tree's arrays carrying these shardings (what AOT lowering and orbax restores take)."""
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Stepper:
  """Compiles the train step once per StepSpec and batch shapes, and counts and logs every compilation.

  The update program does not depend on the remat policies: it is compiled once (with KL control: once per
  minibatch shape) and shared by every Step. Both are named functions, so their XLA modules (and a profiler's
  events) read jit_grad_program and jit_update_program.
  """

  def __init__(self, mesh, optimizer, state, state_shardings, kl_control: KLControlConfig | None = None,
               probe_cache: int = 16):
    self.mesh, self.optimizer, self.state_shardings = mesh, optimizer, state_shardings
    self.kl = kl_control if kl_control is not None and kl_control.target > 0 else None
    self.state_abstract = abstract(state, state_shardings)
    # gradients are shaped like what trains (model.lora.partition: a LoRA model's adapters, else the params)
    self.grad_shardings = lora.trainable(state_shardings.params) if state_shardings is not None else None
    self._compiled: dict[tuple, Step] = {}
    # compiled only to read their memory; promoted (not recompiled) if run. Bounded, least recently used out: every
    # XLA:CPU executable holds JIT-mapped code, and a run that probes hundreds of plans (the exposure bench's arms)
    # hit the process's map limit ("LLVM compilation error: Cannot allocate memory", then a crash)
    self._probed: collections.OrderedDict[tuple, Step] = collections.OrderedDict()
    self.probe_cache = probe_cache
    self._updates: dict[Any, Any] = {}
    self._forwards: dict[Any, Any] = {}
    self.compile_count = 0
    self.compile_log: list[dict] = []
    self.probe_compiles = 0  # compiled to measure memory (the GC reference, budget probes)

  def batch_shardings(self, batch: UpdateBatch):
    """Every present field of a batch split over the mesh's batch axes, but a prompt table (replicated)."""
    return prompt_share.field_shardings(batch, sharding.batch_sharding(self.mesh), sharding.replicated(self.mesh))

  def logprobs(self, spec: StepSpec, params, batch: UpdateBatch) -> jax.Array:
    """log pi(completion token) [B, N] of params on batch's sequences (forward only, as the gradient program
    slices rows): the old and the reference log-probs. One program per spec (without policies) and shape."""
    seqs = batch.sequences()
    spec = dataclasses.replace(spec, policies=())  # a forward keeps nothing for backward: no remat to choose
    key = (spec, seqs.signature())
    if key not in self._forwards:
      batch_sh = self.batch_shardings(seqs)
      fn = jax.jit(lambda p, b: train_step.sequence_logprobs(spec, p, b),
                   in_shardings=(self.state_shardings.params, batch_sh),
                   out_shardings=sharding.batch_sharding(self.mesh))
      self._forwards[key] = fn.lower(self.state_abstract.params, abstract(seqs, batch_sh)).compile()
    return self._forwards[key](params, seqs)

  def update_program(self, spec: StepSpec, batch: UpdateBatch):
    """The update program; with KL control keyed by the spec without its policies and the sequences' shapes."""
    param_sh, metrics_sh = self.grad_shardings, sharding.replicated(self.mesh)
    grads_abstract = lora.trainable(self.state_abstract.params)
    if self.kl is None:
      if None not in self._updates:
        def update_program(s, g):
          return train_step.update_step(s, g, self.optimizer)

        fn = jax.jit(update_program, in_shardings=(self.state_shardings, param_sh),
                     out_shardings=(self.state_shardings, metrics_sh), donate_argnums=0)
        self._updates[None] = fn.lower(self.state_abstract, grads_abstract).compile()
      return self._updates[None]
    spec = dataclasses.replace(spec, policies=())  # the KL's forward has no backward: no remat to choose
    kl_batch = batch.sequences()
    key = (spec, kl_batch.signature())
    if key not in self._updates:
      batch_sh = self.batch_shardings(kl_batch)

      def update_program(s, g, b):
        return train_step.update_step(s, g, self.optimizer, b, spec, self.kl)

      fn = jax.jit(update_program, in_shardings=(self.state_shardings, param_sh, batch_sh),
                   out_shardings=(self.state_shardings, metrics_sh), donate_argnums=0)
      self._updates[key] = fn.lower(self.state_abstract, grads_abstract, abstract(kl_batch, batch_sh)).compile()
    return self._updates[key]

  def _compile(self, spec: StepSpec, batch: UpdateBatch) -> Step:
    batch_sh = self.batch_shardings(batch)
    param_sh, metrics_sh = self.state_shardings.params, sharding.replicated(self.mesh)
    metrics_sh = {**{k: metrics_sh for k in train_step.SCALAR_METRICS},
                  train_step.TOKEN_LOGP: sharding.batch_sharding(self.mesh)}

    def grad_program(p, b):
      return train_step.gradient_step(p, b, spec)

    fn = jax.jit(grad_program, in_shardings=(param_sh, batch_sh), out_shardings=(self.grad_shardings, metrics_sh))
    grad = fn.lower(self.state_abstract.params, abstract(batch, batch_sh)).compile()
    update = self.update_program(spec, batch)
    grad_temp, grad_out = _memory(grad)
    update_temp, _ = _memory(update)
    return Step(grad, update, grad_temp, update_temp, grad_out, self.kl is not None)

  def with_update_of(self, step: Step, spec: StepSpec, batch: UpdateBatch) -> Step:
    """step's gradient program with this stepper's update program (another optimizer's; the gradient program does
    not depend on it): to measure optimizers without recompiling the gradient."""
    update = self.update_program(spec, batch)
    return dataclasses.replace(step, update=update, update_temp_bytes=_memory(update)[0],
                               kl_control=self.kl is not None)

  def get(self, spec: StepSpec, batch: UpdateBatch, reason: str = "", count: bool = True) -> Step:
    """The compiled step; count=False compiles only to measure (a probe), counted as a compile if it later runs.
    The key is the spec and the batch's signature (which fields it carries, their shapes)."""
    key = (spec, batch.signature())
    if key in self._probed:
      if not count:
        self._probed.move_to_end(key)
        return self._probed[key]
      self._compiled[key] = self._probed.pop(key)
      self._count(reason, 0.0, key)
    if key not in self._compiled:
      t0 = time.perf_counter()
      step = self._compile(spec, batch)
      if not count:
        self.probe_compiles += 1
        self._probed[key] = step
        while len(self._probed) > self.probe_cache:
          self._probed.popitem(last=False)
        return step
      self._compiled[key] = step
      self._count(reason, time.perf_counter() - t0, key)
    return self._compiled[key]

  def _count(self, reason: str, seconds: float, key):
    self.compile_count += 1
    entry = {"count": self.compile_count, "reason": reason or "first use", "seconds": seconds,
             "peak_bytes": self._compiled[key].peak_bytes, "batch": ", ".join(f"{n}{list(sh)}" for n, sh, _ in key[1])}
    self.compile_log.append(entry)
    log.info("compiled train step #%d (%s) in %.1fs, peak %d bytes, batch %s", entry["count"], entry["reason"],
             entry["seconds"], entry["peak_bytes"], entry["batch"])

  def __call__(self, spec: StepSpec, state, batch: UpdateBatch, reason: str = ""):
    return self.get(spec, batch, reason)(state, batch)


# ----------------------------------------------------------------------------- set-up


def model_config(cfg: Config) -> model.ModelConfig:
  """The model's shape: from model.path's config.json, or the config's shape fields."""
  if cfg.model.path:
    from hilore_jax.loop import preflight

    return preflight.load_model_config("model.path", cfg.model.path, cfg.model)
  return cfg.model.shape_config()


@dataclasses.dataclass
class Engine:
  """Mesh, optimizer (and its learning-rate schedule), state shardings and the step compiler of one run; the state
  itself belongs to the caller (the steps donate it, so a copy here would point at deleted buffers)."""

  mesh: Any
  optimizer: optax.GradientTransformation
  lr_schedule: optax.Schedule
  state_shardings: dict
  stepper: Stepper

  @property
  def param_shardings(self):
    return self.state_shardings.params

  def place(self, batch):
    """A host pytree (an UpdateBatch, a dict of arrays) on the mesh in one transfer: an UpdateBatch as the compiled
    steps read it (Stepper.batch_shardings), a dict's rows split over the batch axes where they divide, else
    replicated."""
    split, rep = sharding.batch_sharding(self.mesh), sharding.replicated(self.mesh)
    n = sharding.num_batch_shards(self.mesh)
    shardings = (self.stepper.batch_shardings(batch) if isinstance(batch, UpdateBatch)
                 else jax.tree.map(lambda v: split if v.shape[0] % n == 0 else rep, batch))
    if jax.process_count() == 1:
      return jax.device_put(batch, shardings)
    # every process holds the whole host batch and places only its own devices' rows: device_put would first
    # check that the processes agree, and NaN (old_logp's "to be filled in") never equals itself
    return jax.tree.map(lambda v, s: jax.make_array_from_callback(v.shape, s, lambda idx: v[idx]), batch, shardings)


def build(cfg: Config, model_cfg: model.ModelConfig, total_updates: int, host_params: dict | None = None,
          rng: jax.Array | None = None, abstract: bool = False) -> tuple[Engine, TrainState]:
  """(the run's engine, its sharded train state): params from host_params (a loaded checkpoint) or initialised
  from rng, created sharded; abstract: shapes only (compile-only measurements)."""
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
  lr = optim.schedule(cfg.optimizer, total_updates)
  optimizer = optim.make_optimizer(cfg.optimizer, total_updates, lr)
  rng = jax.random.PRNGKey(cfg.seed) if rng is None else rng
  # the train layout: each layer leaf stacked [L, ...], which the layer scans read without a copy (stacking per
  # call held a second copy of the layers through the step, and fragmented XLA:CPU's heap: +19-28% peak measured)
  init = lambda k: model.stacked(model.init_params(model_cfg, k, cfg.model.init_std))
  params_shape = jax.eval_shape(init, rng)
  if abstract:
    make = None
  elif host_params is not None:
    make = lambda sh: jax.device_put(model.stacked(host_params), sh)
  else:
    make = lambda sh: jax.jit(init, out_shardings=sh)(rng)
  state, state_sh = init_state(mesh, optimizer, params_shape, make)
  stepper = Stepper(mesh, optimizer, state, state_sh, cfg.optimizer.kl_control)
  return Engine(mesh, optimizer, lr, state_sh, stepper), state
