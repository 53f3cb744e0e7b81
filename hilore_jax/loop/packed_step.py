"""The token budget's compiled programs: per microbatch shape a packed gradient program (gather the microbatch from
its placed minibatch: a length bucket's rows, rl/token_budget.py, or a buffer of rows end to end, rl/packing.py; with
a shared prompt the microbatch's prompt table; gradient; add to a donated accumulator) and a packed log-prob
forward; the update program (clipping, the optimizer) runs once per minibatch, on its accumulated gradient.
Gradient programs are counted and logged on the engine's Stepper like the unpacked ones."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from hilore_jax import sharding
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError
from hilore_jax.loop.engine import Stepper, _memory, abstract
from hilore_jax.rl import token_budget, train_step
from hilore_jax.rl.train_state import TrainState
from hilore_jax.rl.train_step import StepSpec
from hilore_jax.rl.update_batch import UpdateBatch

log = logging.getLogger(__name__)
_metrics = jax.jit(train_step.step_metrics)


class PackedStepper:
  """Compiles a packed program once per (spec, minibatch signature, microbatch shape) and runs a minibatch's plan."""

  def __init__(self, stepper: Stepper):
    self.stepper = stepper
    self._programs: dict[tuple, tuple] = {}
    # (pass, rows, cap) (a bucket) or (pass, buffer rows, buffer length) (packed) compiled so far:
    # budget/compiled_shapes
    self.shapes: set[tuple[str, int, int]] = set()

  def _shardings(self, batch: UpdateBatch):
    st = self.stepper
    rep = sharding.replicated(st.mesh)
    acc_sh = (st.grad_shardings, {k: rep for k in train_step.STAT_SUMS}, sharding.batch_sharding(st.mesh))
    return st.batch_shardings(batch), rep, acc_sh

  def _idx_shardings(self, micro) -> dict:
    """A microbatch's index arrays' shardings: a packed buffer's rows split like the batch, the rest replicated."""
    split, rep = sharding.batch_sharding(self.stepper.mesh), sharding.replicated(self.stepper.mesh)
    return {k: split if k in micro.split_arrays else rep for k in micro.arrays()}

  def _abstract(self, batch: UpdateBatch, micro):
    batch_sh, _, _ = self._shardings(batch)
    idx_sh = self._idx_shardings(micro)
    idx = {k: jax.ShapeDtypeStruct(x.shape, jnp.int32, sharding=idx_sh[k]) for k, x in micro.arrays().items()}
    return abstract(batch, batch_sh), idx

  def _start(self, batch: UpdateBatch):
    key = ("start", batch.signature())
    if key not in self._programs:
      batch_sh, rep, acc_sh = self._shardings(batch)
      fn = jax.jit(train_step.packed_start, in_shardings=(self.stepper.state_shardings.params, batch_sh),
                   out_shardings=(acc_sh, rep))
      self._programs[key] = (fn.lower(self.stepper.state_abstract.params, abstract(batch, batch_sh)).compile(), 0)
    return self._programs[key][0]

  def _gradient(self, spec: StepSpec, batch: UpdateBatch, micro):
    """(the packed gradient program of micro's shape (a token_budget.Micro or packing.Buffer), its peak bytes: temp
    plus the accumulator it writes)."""
    key = ("grad", spec, batch.signature(), micro.key, micro.layout)  # a bucket and a buffer can share a key
    if key not in self._programs:
      t0, st = time.perf_counter(), self.stepper
      batch_sh, rep, acc_sh = self._shardings(batch)
      layout = micro.layout
      fn = jax.jit(lambda p, b, i, n, a: train_step.packed_gradient(p, b, i, n, a, spec, layout),
                   in_shardings=(st.state_shardings.params, batch_sh, self._idx_shardings(micro), rep, acc_sh),
                   out_shardings=acc_sh, donate_argnums=4)
      b_abs, idx = self._abstract(batch, micro)
      acc_abs = jax.eval_shape(train_step.packed_start, st.state_abstract.params, b_abs)
      acc = abstract(acc_abs[0], acc_sh)
      norm = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=rep)
      compiled = fn.lower(st.state_abstract.params, b_abs, idx, norm, acc).compile()
      temp, out = _memory(compiled)
      self._programs[key] = (compiled, temp + out)
      self.shapes.add(("grad", *micro.shape))
      st.compile_count += 1
      entry = {"count": st.compile_count, "reason": micro.describe(), "seconds": time.perf_counter() - t0,
               "peak_bytes": temp + out, "batch": f"packed {list(micro.shape)}"}
      st.compile_log.append(entry)
      log.info("compiled packed gradient program #%d (%s) in %.1fs, peak %d bytes", entry["count"], entry["reason"],
               entry["seconds"], entry["peak_bytes"])
    return self._programs[key]

  def step(self, spec: StepSpec | list[StepSpec], state: TrainState, batch: UpdateBatch, micros: list):
    """One optimizer update on a packed minibatch -> (new state, metrics as the unpacked step's, peak bytes); spec
    a list: one per microbatch (a memory plan per shape)."""
    specs = spec if isinstance(spec, list) else [spec] * len(micros)
    spec = specs[0]  # the update program does not depend on the remat policies
    acc, norm = self._start(batch)(state.params, batch)
    peak = 0
    for spec_m, m in zip(specs, micros):
      program, bytes_ = self._gradient(spec_m, batch, m)
      acc = program(state.params, batch, m.arrays(), norm, acc)
      peak = max(peak, bytes_)
    grads, stats, logp = acc
    update = self.stepper.update_program(spec, batch)
    if self.stepper.kl is not None:
      state, metrics = update(state, grads, batch.sequences())
    else:
      state, metrics = update(state, grads)
    return state, {**_metrics({**stats, train_step.TOKEN_LOGP: logp}), **metrics}, peak

  def logprobs(self, spec: StepSpec, params, batch: UpdateBatch, micros: list) -> jax.Array:
    """log pi(completion token) [B, N] of params on batch's sequences, microbatch by microbatch (0 past a row's
    bucket cap and on rows without a completion token, which no loss reads)."""
    seqs = batch.sequences()
    spec = dataclasses.replace(spec, policies=())
    batch_sh, rep, acc_sh = self._shardings(seqs)
    acc = None
    for m in micros:
      key = ("logp", spec, seqs.signature(), m.key, m.layout)
      if key not in self._programs:
        layout = m.layout
        fn = jax.jit(lambda p, b, i, a: train_step.packed_logprobs(spec, p, b, i, a, layout),
                     in_shardings=(self.stepper.state_shardings.params, batch_sh, self._idx_shardings(m),
                                   acc_sh[2]),
                     out_shardings=acc_sh[2], donate_argnums=3)
        b_abs, idx = self._abstract(seqs, m)
        logp_abs = jax.ShapeDtypeStruct(seqs.tokens.shape, jnp.float32, sharding=acc_sh[2])
        self._programs[key] = (fn.lower(self.stepper.state_abstract.params, b_abs, idx, logp_abs).compile(), 0)
        self.shapes.add(("logp", *m.shape))
      if acc is None:
        acc = jax.device_put(jnp.zeros(seqs.tokens.shape, jnp.float32), acc_sh[2])
      acc = self._programs[key][0](params, seqs, m.arrays(), acc)
    return acc if acc is not None else jax.device_put(jnp.zeros(seqs.tokens.shape, jnp.float32), acc_sh[2])


def build(c: Config, stepper: Stepper, n_shards: int) -> PackedStepper | None:
  """The token budget's programs (train.max_tokens_per_*), checked against the mesh's n_shards batch shards; None
  when both are off."""
  tb = c.train
  if not (tb.max_tokens_per_microbatch or tb.max_tokens_per_logprob_pass):
    return None
  P, N = c.rollout.max_prompt_len, c.rollout.max_new_tokens
  row = N if tb.packing and tb.share_prompt else P + N  # a packed row: its completion, or prompt and completion
  for key in ("max_tokens_per_microbatch", "max_tokens_per_logprob_pass"):
    budget = getattr(tb, key)
    if budget and tb.packing and budget // n_shards < row:
      raise ConfigError(f"train.{key} ({budget}) gives each of the mesh's {n_shards} devices a packed buffer of "
                        f"{budget // n_shards} positions, fewer than a row at the cap ({row}): raise it to "
                        f"{n_shards * row} or more")
    if budget and not tb.packing and token_budget.rows_per_microbatch(budget, P, N, c.minibatch_size, n_shards) < 1:
      raise ConfigError(f"train.{key} ({budget}) holds fewer than the mesh's {n_shards} rows of "
                        f"{P} + {N} tokens ({n_shards * (P + N)})")
  return PackedStepper(stepper)
