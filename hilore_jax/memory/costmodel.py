"""Per-layer cost of an H/L/R/O choice: which forward ops backward must rerun given what is kept (the layer's
dataflow graph), plus codec and host-transfer time; and the Pareto set of choices the allocator picks from.

Why a graph and not a per-unit sum: keeping a unit saves its producer op only if nothing else forces it. Attention
backward reads q, k, v and the softmax probabilities, SiLU backward reads gate and up, the MLP norm backward reads
its input, so those are rerun (with their inputs) unless kept; an L code serves backward wherever it reads the
tensor (model/lowp.py), but a rerun needs its inputs exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from hilore_jax.memory import allocator
from hilore_jax.memory.allocator import H, L, O, R
from hilore_jax.memory.profile import Unit
from hilore_jax.model import units as U


def rerun_ops(choice: dict[str, str], rows: tuple[U.Tensor, ...] = U.TABLE) -> frozenset[str]:
  """Producer ops backward must rerun when units are kept as `choice` (kind -> H/L/R/O; missing: R, the layer
  boundary H): what backward reads is served by H, O or an L code; an R tensor's producer reruns, and a rerun
  reads its inputs exactly, so an input that is R or only L reruns its own producer too. rows: the layer's table
  (units.table; a LoRA layer's, whose frozen weights read no input in backward)."""
  rerun: set[str] = set()
  exact: set[str] = set()
  by_name = {t.name: t for t in rows}
  for t in reversed(rows):  # consumers before producers
    if t.producer is None:
      continue  # the boundary is always there exactly when anything reruns (a checkpointed layer's argument)
    c = choice.get(t.name, R) if t.unit else R
    if (t.backward != U.NONE and c == R) or (t.name in exact and c in (R, L)):
      rerun.add(t.name)
      exact.update(t.reads)
  return frozenset(by_name[n].producer for n in rerun)


def choice_time(choice: dict[str, str], op_s: dict[str, float], layer_units: Sequence[Unit]) -> float:
  """Rerun + encode/decode + host-transfer seconds of one layer's choice."""
  t = sum(op_s.get(op, 0.0) for op in rerun_ops(choice, U.lora_rows(u.kind for u in layer_units)))
  for u in layer_units:
    c = choice.get(u.kind, R)
    t += u.codec_s if c == L else (u.offload_s or 0.0) if c == O else 0.0
  return t


def unit_bytes(u: Unit, c: str) -> int:
  """Bytes a unit adds on top of full checkpointing, which keeps the layer boundary already (so its L is a
  saving)."""
  base = u.bytes_h if u.kind in U.BOUNDARY else 0
  return (u.bytes_h if c == H else u.bytes_l if c == L else base) - base


def choice_bytes(choice: dict[str, str], layer_units: Sequence[Unit]) -> int:
  return sum(unit_bytes(u, choice.get(u.kind, H if u.kind in U.BOUNDARY else R)) for u in layer_units)


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


_CODE = {H: 0, L: 1, R: 2, O: 3}


def _rerun_matrix(codes: np.ndarray, kinds: Sequence[str]) -> dict[str, np.ndarray]:
  """rerun_ops for many choices at once: codes [n, units] (_CODE) -> op -> [n] bool."""
  col = {k: i for i, k in enumerate(kinds)}
  n = len(codes)
  rows = U.lora_rows(kinds)
  exact = {t.name: np.zeros(n, bool) for t in rows}
  ops = {t.producer: np.zeros(n, bool) for t in rows if t.producer}
  for t in reversed(rows):
    if t.producer is None:
      continue
    c = codes[:, col[t.name]] if t.name in col else np.full(n, _CODE[R])
    r = ((c == _CODE[R]) & (t.backward != U.NONE)) | (exact[t.name] & ((c == _CODE[R]) | (c == _CODE[L])))
    ops[t.producer] |= r
    for s in t.reads:
      exact[s] |= r
  return ops


def _dominated(b: np.ndarray, t: np.ndarray, lbits: np.ndarray) -> np.ndarray:
  """Which rows another row beats: no more bytes, no more time and a subset of the L units, one of them strictly.
  Rows come sorted by L set, then bytes, each set's rows its strict (bytes, time) front: a set's best time at no more
  bytes is a prefix minimum, and its proper supersets follow it. A pass over the later rows per set, where comparing
  every pair of rows took seconds at ~10^4 rows."""
  dominated = np.zeros(len(b), bool)
  sets, starts = np.unique(lbits, return_index=True)
  for s, lo, hi in zip(sets, starts, [*starts[1:], len(b)]):
    sb, best_t = b[lo:hi], np.minimum.accumulate(t[lo:hi])
    # its supersets' rows (s's rows with no more bytes), and its own (those with fewer: its front has no ties)
    over = hi + np.flatnonzero((lbits[hi:] & s) == s)
    for rows, side in ((over, "right"), (np.arange(lo, hi), "left")):
      k = np.searchsorted(sb, b[rows], side=side) - 1
      dominated[rows] |= (k >= 0) & (best_t[np.maximum(k, 0)] <= t[rows] + 1e-15)
  return dominated


@functools.lru_cache(maxsize=64)
def _candidates_cached(layer_units: tuple[Unit, ...], op_items: tuple, allow: tuple) -> tuple[Candidate, ...]:
  op_s = dict(op_items)
  kinds = [u.kind for u in layer_units]
  allowed = dict(allow)
  # every combination, the last unit's choice varying fastest (itertools.product's order) without a Python tuple each
  grids = np.meshgrid(*[np.array([_CODE[c] for c in allowed[k]], np.int8) for k in kinds], indexing="ij")
  combos = np.stack([g.reshape(-1) for g in grids], axis=1)
  # an L layer boundary only where nothing reruns (or moves to the host): a recompute would need it exactly
  bnd = [i for i, k in enumerate(kinds) if k in U.BOUNDARY]
  if bnd:
    rest = np.delete(combos, bnd, axis=1)
    ok = ~((combos[:, bnd] == _CODE[L]).any(1) & ((rest == _CODE[R]) | (rest == _CODE[O])).any(1))
    combos = combos[ok]
  per_unit_b = np.array([[unit_bytes(u, c) for c in (H, L, R, O)] if u.bytes_l is not None else
                         [unit_bytes(u, H), 0, 0, 0] for u in layer_units], float)
  per_unit_t = np.array([[0.0, u.codec_s, 0.0, u.offload_s or 0.0] for u in layer_units])
  idx = np.arange(len(kinds))
  b = per_unit_b[idx, combos].sum(1)
  t = per_unit_t[idx, combos].sum(1)
  for op, mask in _rerun_matrix(combos, kinds).items():
    t = t + mask * op_s.get(op, 0.0)
  lbits = ((combos == _CODE[L]) * (1 << idx)).sum(1)
  # per L set (risk depends only on it), keep what is (bytes, time)-Pareto: sort by set, bytes, time and keep a
  # row only when it is faster than every earlier row of its set
  order = np.lexsort((t, b, lbits))
  b, t, lbits, combos = b[order], t[order], lbits[order], combos[order]
  gid = np.cumsum(np.r_[0, lbits[1:] != lbits[:-1]])
  shifted = t - gid * (t.max() + 1.0)  # later sets lie below earlier ones, so a running minimum restarts per set
  prev = np.r_[np.inf, np.minimum.accumulate(shifted)[:-1]]
  keep = np.where(np.r_[True, gid[1:] != gid[:-1]], True, shifted < prev - 1e-15)
  # across sets: a choice with no more bytes, no more time and a subset of the L units is as good for any risks
  b, t, lbits, combos = b[keep], t[keep], lbits[keep], combos[keep]
  dominated = _dominated(b, t, lbits)
  names = {v: k for k, v in _CODE.items()}
  return tuple(Candidate(tuple(names[int(c)] for c in row), int(bb), float(tt), tuple(k for k, c in zip(kinds, row)
                                                                                      if c == _CODE[L]))
               for row, bb, tt, d in zip(combos, b, t, dominated) if not d)


def candidates(layer_units: Sequence[Unit], op_s: dict[str, float], allow_l: bool = True,
               allow_o: bool = False) -> tuple[Candidate, ...]:
  """Every layer choice that is Pareto in (bytes, time, L set) (risk grows with the L set)."""
  allow = []
  for u in layer_units:
    lo = [L] if allow_l and u.bytes_l is not None else []
    if u.kind in U.BOUNDARY:
      opts = [H] + lo
    else:
      opts = [H, R] + lo + ([O] if allow_o and u.offload_s is not None else [])
    allow.append((u.kind, tuple(opts)))
  # every layer has the same shapes and costs: key the cache without the layer index
  key = tuple(dataclasses.replace(u, layer=0) for u in layer_units)
  return _candidates_cached(key, tuple(sorted(op_s.items())), tuple(allow))


def _beaten(b: np.ndarray, t: np.ndarray, r: np.ndarray, rows: np.ndarray, by: np.ndarray) -> np.ndarray:
  """Which of rows some row of `by` beats: no more bytes, time and risk, one of them strictly."""
  bi, ti, ri = b[rows][:, None], t[rows][:, None], r[rows][:, None]
  bj, tj, rj = b[by][None], t[by][None], r[by][None]
  return ((bj <= bi) & (tj <= ti + 1e-15) & (rj <= ri) & ((bj < bi) | (tj < ti - 1e-15) | (rj < ri))).any(axis=1)


def _beaten_rows(b: np.ndarray, t: np.ndarray, r: np.ndarray, chunk: int = 256) -> np.ndarray:
  """Which rows another row beats, as the test of every pair decides, without testing every pair (~10^4 rows of a
  few hundred unbeaten ones: 0.2-0.8 s a layer): chunks in (bytes, time, risk) order, each row first tested against
  the unbeaten rows so far, then its chunk, and only what is left against every row. A row is marked only where a
  row beats it, and is left unmarked only once no row does: the pairwise answer (within the time tolerance beating
  is not transitive, so a row only a beaten row beats is still found by the last test)."""
  beaten = np.zeros(len(b), bool)
  front, every = np.zeros(0, np.intp), np.arange(len(b))
  order = np.lexsort((r, t, b))
  for lo in range(0, len(b), chunk):
    rows = order[lo:lo + chunk]
    for by in (front, rows, every):
      if len(rows) and len(by):
        hit = _beaten(b, t, r, rows, by)
        beaten[rows[hit]] = True
        rows = rows[~hit]
    front = np.concatenate([front, rows])
  return beaten


def layer_options(cands: Sequence[Candidate], risk_of: dict[str, float]) -> list[allocator.Option]:
  """Options with risk = sum of the L units' risks, pruned to the (bytes, time, risk) Pareto set."""
  b = np.array([c.bytes for c in cands], float)
  t = np.array([c.time_s for c in cands])
  r = np.array([sum(risk_of.get(k, 0.0) for k in c.lowp) for c in cands])
  dominated = _beaten_rows(b, t, r)
  return [allocator.Option(c.choice, c.bytes, c.time_s, float(ri)) for c, ri, d in zip(cands, r, dominated) if not d]
