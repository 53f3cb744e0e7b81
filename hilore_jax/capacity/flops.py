"""Matmul FLOPs of a program from its jaxpr: every dot_general, scan bodies times their trip count.

XLA's cost analysis counts a while loop's body once, so a plan that splits the layer scan into several runs would
look costlier than one that does not; the jaxpr has the scan lengths and, under jax.grad, each checkpointed
layer's recompute (remat's body in the backward), so its count is comparable across every plan.
"""

from __future__ import annotations

import math
from typing import Callable

import jax

# dead-code elimination of a jaxpr has no public API; without it a checkpointed layer's backward still lists the
# forward ops whose outputs only an L code replaces (XLA drops them), so L plans would count as full recompute
from jax._src.interpreters import partial_eval as pe


def _dot_flops(eqn) -> float:
  """2 x (output elements) x (contracted size) of one dot_general."""
  (lhs_c, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  out = eqn.outvars[0].aval.shape
  return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lhs_c)


def _subjaxprs(eqn):
  for v in eqn.params.values():
    for sub in (v if isinstance(v, (list, tuple)) else (v,)):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def jaxpr_flops(jaxpr) -> float:
  """Matmul FLOPs of a (closed) jaxpr; a scan counts its body `length` times, a cond its costliest branch."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name == "cond":
      total += max(jaxpr_flops(b) for b in eqn.params["branches"])
    else:
      inner = sum(jaxpr_flops(s) for s in _subjaxprs(eqn))
      total += inner * (eqn.params["length"] if name == "scan" else 1)
  return total


def program_flops(fn: Callable, *args) -> float:
  """Matmul FLOPs of fn(*args) as traced (forward, backward and any recompute it contains), dead code removed."""
  closed = jax.make_jaxpr(fn)(*args)
  live, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  return jaxpr_flops(live)
