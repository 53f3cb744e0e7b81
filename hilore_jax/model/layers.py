"""The decoder's layer stack: its two layouts, and its layers run as a few scans, one per run of one remat policy.

Layouts. `init_params` and HF checkpoints hold the layers as a list of per-layer dicts; the train layout (what the
engine holds) stacks every leaf along a leading layer axis. Both run here; the stacked one scans without a copy.

Runs. `run_layers` runs each run of consecutive layers with one policy as one `lax.scan`, so the compiled program
holds one layer per run whatever the depth: compile time and the compiler's memory follow the number of runs (the
allocator's `memory.plan_runs`), not the number of layers. One custom VJP covers all the runs of a remat plan, so
that on XLA:CPU the scanned plan keeps what the same plan unrolled keeps (docs/design.md#layers-under-laxscan):
- each step reads its layer from the stack by index, forward and backward: a run is never a sliced copy of the
  layers (a scan over `layers[a:b]` held that copy from the forward to the backward: +33% measured);
- its residuals are stacked as bit patterns: XLA:CPU has no bf16 (or fp8) dynamic-slice, so a stack of bf16
  residuals got a float32 copy of the whole stack, hoisted out of the backward loop (+288 MiB for 8 layers at
  8 x 2048 tokens);
- the layers' gradients are written into one stacked buffer that every run's backward loop carries on to the next,
  so no run's weight gradients wait past another run's loop (XLA:CPU deferred them and the activations they read);
  only the first run in backward, while every run's residuals are still held, carries a stack of its own layers'
  gradients, placed in the whole buffer after its loop (a buffer carried from the start is held before any gradient
  exists, where the unrolled program still uses that memory: SmolLM2 x16, 8 x 2048 tokens, +9% peak);
- a one-layer run (XLA inlines a loop of one) reruns its forward only once its output's cotangent exists, and passes
  its input's cotangent on only with its weight gradients (policy.tie).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax.model.policy import LayerPolicy, ordered, remat, tie


def stack_layers(layers: Sequence[dict] | dict) -> dict:
  """Per-layer param dicts -> one dict whose leaves carry a leading layer axis; a stacked dict as it is."""
  if isinstance(layers, dict):
    return layers
  # host arrays (a loaded checkpoint) stay on the host until placed with their shardings
  return jax.tree_util.tree_map(lambda *xs: (np.stack if isinstance(xs[0], np.ndarray) else jnp.stack)(xs), *layers)


def unstack_layers(layers: Sequence[dict] | dict) -> list[dict]:
  """A stacked layers dict -> the per-layer list (HF's order); a list as it is."""
  if not isinstance(layers, dict):
    return list(layers)
  return [layer_at(layers, i) for i in range(jax.tree_util.tree_leaves(layers)[0].shape[0])]


def stacked(params: dict) -> dict:
  """params (or anything shaped like them: gradients, optimizer moments) in the train layout: layers stacked."""
  return {**params, "layers": stack_layers(params["layers"])}


def unstacked(params: dict) -> dict:
  """params with the layers as a per-layer list: the layout of init_params, HF checkpoints and per-layer readers."""
  return {**params, "layers": unstack_layers(params["layers"])}


def is_stacked(params: dict) -> bool:
  return isinstance(params["layers"], dict)


def layer_at(layers, i) -> dict:
  """Layer i of a stacked dict (i may be traced) or a list."""
  if isinstance(layers, dict):
    return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
                                  if not isinstance(x, np.ndarray) else x[i], layers)
  return layers[i]


def policy_runs(policies: Sequence[LayerPolicy]) -> list[tuple[int, int, LayerPolicy]]:
  """Maximal runs of consecutive layers with the same policy, as (start, end, policy)."""
  runs: list[tuple[int, int, LayerPolicy]] = []
  for i, pol in enumerate(policies):
    if runs and runs[-1][2] == pol:
      runs[-1] = (runs[-1][0], i + 1, pol)
    else:
      runs.append((i, i + 1, pol))
  return runs


def run_layers(make_step: Callable, policies: Sequence[LayerPolicy], layers, carry, consts, scan: bool = True):
  """carry through every layer in order; make_step(policy) -> step(layer params, carry, consts) -> carry, consts
  what every layer reads besides (the layer context: not differentiated through here, its cotangent is zero).

  scan=False (model.scan_layers) runs every layer as a plain call (what XLA's cost analysis counts layer by layer).
  """
  runs = policy_runs(policies)
  if not scan:
    for start, end, policy in runs:
      step = remat(make_step(policy), policy)
      call = ordered(lambda p, x, step=step: step(p, x, consts)) if policy.remat else (
          lambda p, x, step=step: step(p, x, consts))
      for i in range(start, end):
        carry = call(layer_at(layers, i), carry)
    return carry
  layers = stack_layers(layers)
  # no remat keeps every activation (JAX's scan hoists what is loop-invariant), and offloaded residuals live in host
  # memory: both under JAX's own scan, over a slice of the stack per run (a copy, unless one run covers the stack)
  if not all(policy.remat and not policy.offload for _, _, policy in runs):
    for start, end, policy in runs:
      part = layers if end - start == _depth(layers) else jax.tree_util.tree_map(lambda x: x[start:end], layers)
      step = make_step(policy)
      carry, _ = jax.lax.scan(lambda c, p, step=step: (step(p, c, consts), None), carry, part)
    return carry
  steps = tuple(remat(make_step(policy), policy) for _, _, policy in runs)
  return _stack(tuple((start, end) for start, end, _ in runs), steps)(layers, carry, consts)


def _depth(layers: dict) -> int:
  return jax.tree_util.tree_leaves(layers)[0].shape[0]


_UINT = {1: jnp.uint8, 2: jnp.uint16}


def _narrow(dtype) -> bool:
  """A float type XLA:CPU has no native dynamic-slice for (bf16, f16, the fp8 formats of L codes)."""
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in _UINT


def _bits(x):
  return jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]) if _narrow(x.dtype) else x


@jax.tree_util.register_static
class _Static:
  """Static metadata carried in a residual pytree (no leaves): the residuals' structure, found while tracing."""

  def __init__(self, value):
    self.value = value

  def __hash__(self):
    return hash(self.value)

  def __eq__(self, other):
    return isinstance(other, _Static) and other.value == self.value


def _stack(spans: tuple[tuple[int, int], ...], steps: tuple[Callable, ...]):
  """The custom VJP of all runs: (stacked layers, carry, consts) -> carry (the module docstring says why)."""

  def primal(layers, carry, consts):
    for (start, end), step in zip(spans, steps):
      body = lambda c, i, step=step: (step(layer_at(layers, i), c, consts), None)
      carry, _ = jax.lax.scan(body, carry, jnp.arange(start, end))
    return carry

  run = jax.custom_vjp(primal)

  def fwd(layers, carry, consts):
    kept, found = [], []
    for (start, end), step in zip(spans, steps):
      meta = []

      def body(c, i, step=step, meta=meta):
        p = layer_at(layers, i)
        y, vjp = jax.vjp(step, p, c, consts)
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        # the step's own params and the consts are read again in backward, not stacked: only what differs per layer
        known = {id(x): ("p", k) for k, x in enumerate(jax.tree_util.tree_leaves(p))}
        known.update({id(x): ("c", k) for k, x in enumerate(jax.tree_util.tree_leaves(consts))})
        where, own = [], []
        for x in leaves:
          if id(x) in known:
            where.append(known[id(x)])
          else:
            where.append(("r", len(own), str(x.dtype)))
            own.append(_bits(x))
        meta[:] = [(tree, tuple(where))]
        return y, own

      carry, stacks = jax.lax.scan(body, carry, jnp.arange(start, end))
      kept.append(stacks)
      found.append(meta[0])
    return carry, (layers, consts, kept, _Static(tuple(found)))

  def bwd(res, ct):
    layers, consts, kept, static = res
    const_leaves = jax.tree_util.tree_leaves(consts)
    acc = None
    for (start, end), stacks, (tree, where) in reversed(list(zip(spans, kept, static.value))):
      first = acc is None  # the first run in backward carries only its own layers' gradients (module docstring)
      if first:
        acc = jax.tree_util.tree_map(lambda x: jnp.zeros((end - start, *x.shape[1:]), x.dtype), layers)

      def body(state, xs, tree=tree, where=where, single=end - start == 1, base=start if first else 0):
        ct_c, acc = state
        i, own = xs
        p = jax.tree_util.tree_leaves(layer_at(layers, i))
        leaves = [p[w[1]] if w[0] == "p" else const_leaves[w[1]] if w[0] == "c" else
                  (jax.lax.bitcast_convert_type(own[w[1]], w[2]) if _narrow(w[2]) else own[w[1]]) for w in where]
        if single:  # a loop of one is inlined: its rerun must wait for the cotangent (policy.ordered)
          leaves = tie(leaves, jax.tree_util.tree_leaves(ct_c))
        # the consts' cotangents are dropped unread (XLA does not compute them): the layer context is not trained
        g_p, ct_c, _ = jax.tree_util.tree_unflatten(tree, leaves)(ct_c)
        if single:  # and what flows on waits for its weight gradients (no loop of its own carries them on)
          ct_c = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(ct_c),
                                              tie(jax.tree_util.tree_leaves(ct_c), jax.tree_util.tree_leaves(g_p)))
        acc = jax.tree_util.tree_map(
            lambda a, g: jax.lax.dynamic_update_index_in_dim(a, g.astype(a.dtype), i - base, 0), acc, g_p)
        return (ct_c, acc), None

      (ct, acc), _ = jax.lax.scan(body, (ct, acc), (jnp.arange(start, end), stacks), reverse=True)
      if first and end - start < _depth(layers):
        acc = jax.tree_util.tree_map(
            lambda a, x: jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(x), a, start, 0), acc, layers)
    zero = lambda x: jnp.zeros(x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else np.zeros(
        x.shape, jax.dtypes.float0)
    return acc, ct, jax.tree_util.tree_map(zero, consts)

  run.defvjp(fwd, bwd)
  return run
