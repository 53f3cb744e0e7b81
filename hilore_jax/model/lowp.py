"""L units: projections whose input is kept for backward only as a low-precision code (a custom-VJP residual)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hilore_jax.model import codec
from hilore_jax.model.units import code_names


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def project(x, weights: tuple, specs: tuple[str, ...], unit: str, group_size: int, fmt: str = "int8"):
  """(einsum(spec_i, x, w_i) for each weight): exact forward; backward's weight gradients read x's code.

  One unit may feed several projections (q/k/v, gate/up): it is quantized once.
  """
  return tuple(jnp.einsum(s, x, w.astype(x.dtype)) for s, w in zip(specs, weights))


def _fwd(x, weights, specs, unit, group_size, fmt):
  codes, scale = codec.encode(x, fmt, group_size)
  cname, sname = code_names(unit)
  # named so a save_only_these_names policy keeps exactly these (and not the float x) for backward
  codes, scale = checkpoint_name(codes, cname), checkpoint_name(scale, sname)
  ys = tuple(jnp.einsum(s, x, w.astype(x.dtype)) for s, w in zip(specs, weights))
  return ys, (codes, scale, weights, x.shape)


def _bwd(specs, unit, group_size, fmt, res, cotangents):
  codes, scale, weights, shape = res
  dtype = cotangents[0].dtype  # the outputs, and so their cotangents, are in x's dtype
  x_hat = codec.decode(codes, scale, shape, dtype, fmt)
  dx = jnp.zeros(shape, dtype)
  dws = []
  for spec, w, dy in zip(specs, weights, cotangents):
    ins, out = spec.split("->")
    x_sub, w_sub = ins.split(",")
    dx = dx + jnp.einsum(f"{out},{w_sub}->{x_sub}", dy, w.astype(dy.dtype))
    dws.append(jnp.einsum(f"{x_sub},{out}->{w_sub}", x_hat, dy).astype(w.dtype))
  return dx, tuple(dws)


project.defvjp(_fwd, _bwd)
