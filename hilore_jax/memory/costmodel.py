"""Per-layer cost of an H/L/R/O choice: which forward ops backward must rerun given what is kept (the layer's
dataflow graph), plus codec and host-transfer time; and the Pareto set of choices the allocator picks from.

Why a graph and not a per-unit sum: keeping a unit saves its producer op only if nothing else forces it. Attention
backward reads q, k, v and the softmax probabilities, SiLU backward reads gate and up, the MLP norm backward reads
its input, so those are rerun (with their inputs) unless kept exactly; a projection input is read only by its
weight gradient, so an L code is enough there.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Sequence

import numpy as np

from hilore_jax.memory import allocator
from hilore_jax.memory.allocator import H, L, O, R
from hilore_jax.memory.profile import Unit
from hilore_jax.model import units as U


def rerun_ops(choice: dict[str, str]) -> frozenset[str]:
  """Producer ops backward must rerun when units are kept as `choice` (kind -> H/L/R/O; missing: R)."""
  # backward reads these exactly; a unit read only by its weights' gradient is satisfied by an L code
  need = list(U.EXACT_READS) + [t.name for t in U.TABLE if t.backward == U.WEIGHTS and choice.get(t.name, R) == R]
  ops, seen = set(), set()
  while need:
    v = need.pop()
    if v in seen or U.BY_NAME[v].producer is None or choice.get(v, R) in (H, O):
      continue  # kept exactly, or the layer boundary (always kept)
    seen.add(v)
    ops.add(U.BY_NAME[v].producer)
    need.extend(U.BY_NAME[v].reads)
  return frozenset(ops)


def choice_time(choice: dict[str, str], op_s: dict[str, float], layer_units: Sequence[Unit]) -> float:
  """Rerun + encode/decode + host-transfer seconds of one layer's choice."""
  t = sum(op_s.get(op, 0.0) for op in rerun_ops(choice))
  for u in layer_units:
    c = choice.get(u.kind, R)
    t += u.codec_s if c == L else (u.offload_s or 0.0) if c == O else 0.0
  return t


def choice_bytes(choice: dict[str, str], layer_units: Sequence[Unit]) -> int:
  return sum(u.bytes_h if choice.get(u.kind, R) == H else u.bytes_l if choice.get(u.kind, R) == L else 0
             for u in layer_units)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A layer choice before risk is known: kinds' choices, bytes, seconds, and which kinds are L."""

  choice: tuple[str, ...]
  bytes: int
  time_s: float
  lowp: tuple[str, ...]


def _pareto_2d(cands: list[Candidate]) -> list[Candidate]:
  """Keep candidates not dominated in (bytes, time)."""
  out, best_t = [], np.inf
  for c in sorted(cands, key=lambda c: (c.bytes, c.time_s)):
    if c.time_s < best_t - 1e-15:
      out.append(c)
      best_t = c.time_s
  return out


@functools.lru_cache(maxsize=64)
def _candidates_cached(layer_units: tuple[Unit, ...], op_items: tuple, allow: tuple) -> tuple[Candidate, ...]:
  op_s = dict(op_items)
  kinds = [u.kind for u in layer_units]
  allowed = dict(allow)
  per_kind = [allowed.get(u.kind, (H, R)) for u in layer_units]
  by_lset: dict[tuple, list[Candidate]] = {}
  for combo in itertools.product(*per_kind):
    ch = dict(zip(kinds, combo))
    lset = tuple(k for k, c in ch.items() if c == L)
    cand = Candidate(tuple(combo), choice_bytes(ch, layer_units), choice_time(ch, op_s, layer_units), lset)
    by_lset.setdefault(lset, []).append(cand)
  return tuple(c for group in by_lset.values() for c in _pareto_2d(group))


def candidates(layer_units: Sequence[Unit], op_s: dict[str, float], allow_l: bool = True,
               allow_o: bool = False) -> tuple[Candidate, ...]:
  """Every layer choice that is (bytes, time)-Pareto for its set of L units (risk depends only on that set)."""
  allow = []
  for u in layer_units:
    opts = [H, R] + ([L] if allow_l and u.bytes_l is not None else []) + ([O] if allow_o and u.offload_s is not None
                                                                         else [])
    allow.append((u.kind, tuple(opts)))
  # every layer has the same shapes and costs: key the cache without the layer index
  key = tuple(dataclasses.replace(u, layer=0) for u in layer_units)
  return _candidates_cached(key, tuple(sorted(op_s.items())), tuple(allow))


def layer_options(cands: Sequence[Candidate], risk_of: dict[str, float]) -> list[allocator.Option]:
  """Options with risk = sum of the L units' risks, pruned to the (bytes, time, risk) Pareto set."""
  b = np.array([c.bytes for c in cands], float)
  t = np.array([c.time_s for c in cands])
  r = np.array([sum(risk_of.get(k, 0.0) for k in c.lowp) for c in cands])
  le = (b[None] <= b[:, None]) & (t[None] <= t[:, None] + 1e-15) & (r[None] <= r[:, None])
  lt = (b[None] < b[:, None]) | (t[None] < t[:, None] - 1e-15) | (r[None] < r[:, None])
  dominated = (le & lt).any(axis=1)
  return [allocator.Option(c.choice, c.bytes, c.time_s, float(ri)) for c, ri, d in zip(cands, r, dominated) if not d]
