"""Per-layer remat policies (H / L / R / O per unit) and what backward then keeps (its saved residuals)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from typing import Callable

import jax
import jax.numpy as jnp

from hilore_jax.model import codec
from hilore_jax.model.units import ATTN_PROBS, CHECKPOINT_NAMES, LAYER_INPUT, LOWP_UNITS, UNITS, code_names


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
  """How one layer keeps activations for backward.

  remat=False keeps everything (H) except the `lowp` units, kept as low-precision codes plus scales (L, format
  per unit in `formats`, default int8): nothing is recomputed. remat=True keeps the `save` names in compute dtype
  (H), the `lowp` units as L, the `offload` names in host memory (O, accelerators only), and recomputes the rest
  (R); what it keeps is then exactly the named units, nothing the autodiff of the layer would keep besides (norm
  statistics, RoPE tables). The layer input may be L under remat only when every other unit is kept (H, L or O;
  the attention probabilities may be R): a recompute would start from the argument, which then stays exact.
  """

  remat: bool = False
  save: tuple[str, ...] = ()
  lowp: tuple[str, ...] = ()
  group_size: int = 64
  formats: tuple[str, ...] = ()  # one codec format per lowp unit; empty: all int8
  offload: tuple[str, ...] = ()

  def __post_init__(self):
    # model/ imports nothing outside itself, so its own invariants are checked here rather than with the
    # package's config helpers
    for field, names, valid in (("save", self.save, CHECKPOINT_NAMES), ("lowp", self.lowp, LOWP_UNITS),
                                ("offload", self.offload, CHECKPOINT_NAMES)):
      bad = sorted(set(names) - set(valid))
      if bad:
        raise ValueError(f"LayerPolicy.{field}: {bad} are not valid here; valid: {list(valid)}")
    if (self.save or self.offload) and not self.remat:
      raise ValueError("LayerPolicy.save / offload only apply when remat=True")
    rerun = sorted(set(UNITS) - {LAYER_INPUT, ATTN_PROBS} - set(self.save) - set(self.lowp) - set(self.offload))
    if self.remat and LAYER_INPUT in self.lowp and rerun:
      raise ValueError(f"LayerPolicy.lowp: {LAYER_INPUT!r} may be L under remat only when no other unit is "
                       f"recomputed; {rerun} are (a recompute starts from the layer's exact input)")
    both = sorted((set(self.save) & set(self.lowp)) | (set(self.offload) & (set(self.save) | set(self.lowp))))
    if both:
      raise ValueError(f"units {both} have more than one of H (save), L (lowp) and O (offload)")
    if self.formats and len(self.formats) != len(self.lowp):
      raise ValueError(f"LayerPolicy.formats has {len(self.formats)} entries for {len(self.lowp)} lowp units")
    bad = sorted(set(self.formats) - set(codec.FORMATS))
    if bad:
      raise ValueError(f"unknown low-precision formats {bad}; choose from {list(codec.FORMATS)}")

  def format_of(self, unit: str) -> str:
    return self.formats[self.lowp.index(unit)] if self.formats else "int8"

  @property
  def saved_names(self) -> tuple[str, ...]:
    """Names the checkpoint policy keeps: H units and the codes/scales of L units."""
    return tuple(self.save) + tuple(n for u in self.lowp for n in code_names(u))


NO_REMAT = LayerPolicy(remat=False)
FULL_REMAT = LayerPolicy(remat=True)


def uniform(num_layers: int, policy: LayerPolicy) -> tuple[LayerPolicy, ...]:
  """The same policy for every layer."""
  return (policy,) * num_layers


def offload_supported() -> bool:
  """True on backends whose device has its own memory and a pinned_host memory kind (GPU, TPU)."""
  if jax.default_backend() == "cpu":
    return False  # CPU "device" memory already is host memory: offloading would move nothing
  return any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories())


def ordered(fn: Callable) -> Callable:
  """fn(p, x) -> y (a remat'd layer called outside a loop; x, y may be tuples) whose backward reruns its forward
  only once the output's cotangent exists, and passes its input's cotangent on only with its weight gradients.

  XLA:CPU drops the optimization barriers that order recomputation, and its scheduler then runs a plain layer's
  recompute as early as its inputs allow: before a later loop's backward (the next layers' scan, a blockwise
  kernel's, the log-prob chunks'), whose whole peak it then adds to (measured: one layer followed by a scan of three,
  46.1 vs 34.0 MB; GC's layers unrolled in the train step, 904 vs 741 MiB). Here every residual the recompute reads
  gets a zero that depends on the cotangent, a data dependency no scheduler can move: an add (fused into the
  residual's first reader, or one layer's transient copy), zero also where the cotangent is not finite.
  """

  @jax.custom_vjp
  def call(p, x):
    return fn(p, x)

  def fwd(p, x):
    return jax.vjp(fn, p, x)

  def bwd(vjp, ct):
    leaves, tree = jax.tree_util.tree_flatten(vjp)
    ct_p, ct_x = jax.tree_util.tree_unflatten(tree, tie(leaves, jax.tree_util.tree_leaves(ct)))(ct)
    # and what flows on to the layers before it waits for this layer's weight gradients: else XLA:CPU deferred
    # them (and the activations they read) past the next loop's backward
    treedef = jax.tree_util.tree_structure(ct_x)
    return ct_p, jax.tree_util.tree_unflatten(treedef, tie(jax.tree_util.tree_leaves(ct_x),
                                                           jax.tree_util.tree_leaves(ct_p)))

  call.defvjp(fwd, bwd)
  return call


def tie(leaves, on) -> list:
  """leaves (arrays), each plus a zero computed from every element of the arrays `on`: a data dependency no
  scheduler can move (an add, fused into each leaf's first reader); zero also where `on` is not finite."""
  total = sum(jnp.sum(a.astype(jnp.float32)) for a in on)
  zero = jnp.where(jnp.isfinite(total), total * 0.0, 0.0)
  return [r + zero.astype(r.dtype) if jnp.issubdtype(r.dtype, jnp.floating) else r for r in leaves]


def remat(fn: Callable, policy: LayerPolicy) -> Callable:
  """fn under jax.checkpoint with the policy's names saved (and offloaded); fn itself when remat is off."""
  if not policy.remat:
    return fn
  if policy.offload:
    pol = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(policy.saved_names), names_which_can_be_offloaded=list(policy.offload),
        offload_src="device", offload_dst="pinned_host")
  else:
    pol = jax.checkpoint_policies.save_only_these_names(*policy.saved_names)
  return jax.checkpoint(fn, policy=pol)


# ----------------------------------------------------------------------------- saved residuals


@dataclasses.dataclass(frozen=True)
class Residual:
  dtype: str  # short dtype, e.g. 'f32', 'bf16', 'i8'
  shape: tuple[int, ...]
  source: str  # e.g. "named 'mlp_gate' from ...", "from the argument p"

  @property
  def name(self) -> str | None:
    m = re.search(r"named '([^']+)'", self.source)
    return m.group(1) if m else None


def saved_residuals(fn, *args, **kwargs) -> list[Residual]:
  """Residuals that reverse-mode AD of fn(*args) keeps for the backward pass."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, *args, **kwargs)
  out = []
  for line in buf.getvalue().splitlines():
    m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line.strip())
    if m:
      shape = tuple(int(s) for s in m.group(2).split(",") if s)
      out.append(Residual(m.group(1), shape, m.group(3)))
  return out
