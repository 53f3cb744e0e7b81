"""Which key blocks the blockwise kernel (model/attention.py) visits for each query block, and the keys laid out in
those blocks: every block (dense), or, on packed rows whose segments are at most `max_len` positions long, the
prompt table's blocks and the band of blocks that can hold a query block's own segment (band).

A packed buffer's query at position t sees its own segment's earlier keys, all within [t - max_len + 1, t], and its
prompt's entries in the table: no buffer key farther back. The band visits the table's blocks and the
ceil((max_len - 1) / block) buffer blocks before each query block's own, so a position's cost follows max_len and
the table, not the buffer's length; dense visits every key block and skips the invisible ones one by one (a cond
per block pair: the buffer's length squared). Both compute the same blocks' scores, so the results are equal."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_FAR = np.iinfo(np.int32).max  # a padding key's slot: after every query, so never causally visible


@dataclasses.dataclass(frozen=True)
class Schedule:
  """T queries in blocks of bq over S keys in blocks of bk (static). band, with bk = bq: the last T keys are the
  buffer (key S - T + t is query t's own position), the first S - T the table (visited whole), and query block i
  visits the `window` buffer blocks before its own and its own."""

  T: int
  S: int
  bq: int
  bk: int
  band: bool = False
  window: int = 0

  @property
  def nq(self) -> int:
    return -(-self.T // self.bq)

  @property
  def table(self) -> int:
    return self.S - self.T

  @property
  def ntab(self) -> int:
    return -(-self.table // self.bk)

  @property
  def nk(self) -> int:
    return self.ntab + self.window + self.nq if self.band else -(-self.S // self.bk)

  def layout(self, x, fill=0):
    """Keys x [B, S, ...] -> [nk, B, bk, ...]. Dense: padded to nk blocks. Band: the table padded to whole blocks,
    `window` empty blocks (the band before the first query block), then the buffer padded to nq blocks."""
    pad = lambda y, lo, hi: jnp.pad(y, [(0, 0), (lo, hi)] + [(0, 0)] * (y.ndim - 2), constant_values=fill)
    if self.band:
      x = jnp.concatenate([pad(x[:, :self.table], 0, self.ntab * self.bk - self.table),
                           pad(x[:, self.table:], self.window * self.bk, self.nq * self.bq - self.T)], axis=1)
    else:
      x = pad(x, 0, self.nk * self.bk - self.S)
    return jnp.moveaxis(x.reshape(x.shape[0], self.nk, self.bk, *x.shape[2:]), 1, 0)

  def unlayout(self, x_n):
    """[nk, B, bk, ...] -> [B, S, ...]: layout's inverse on the keys it holds."""
    x = jnp.moveaxis(x_n, 0, 1)
    x = x.reshape(x.shape[0], self.nk * self.bk, *x.shape[3:])
    if not self.band:
      return x[:, :self.S]
    start = (self.ntab + self.window) * self.bk
    return jnp.concatenate([x[:, :self.table], x[:, start:start + self.T]], axis=1)

  def slots(self) -> np.ndarray:
    """[nk, bk] int32: each laid-out key's slot, a padding key's after every query."""
    if not self.band:
      s = np.arange(self.nk * self.bk)
      return np.where(s < self.S, s, _FAR).reshape(self.nk, self.bk).astype(np.int32)
    pad = lambda s, lo, hi: np.pad(s, (lo, hi), constant_values=_FAR)
    s = np.concatenate([pad(np.arange(self.table), 0, self.ntab * self.bk - self.table),
                        pad(self.table + np.arange(self.T), self.window * self.bk, self.nq * self.bq - self.T)])
    return s.reshape(self.nk, self.bk).astype(np.int32)

  def visits(self) -> np.ndarray:
    """[nq, nc] int32: the key blocks query block i visits, in order (dense: every one; band: the table's, then the
    band's, its own last)."""
    if not self.band:
      return np.broadcast_to(np.arange(self.nk, dtype=np.int32), (self.nq, self.nk))
    band = self.ntab + np.arange(self.nq)[:, None] + np.arange(self.window + 1)[None]
    return np.concatenate([np.broadcast_to(np.arange(self.ntab), (self.nq, self.ntab)), band], 1).astype(np.int32)


def schedule(T: int, S: int, block_q: int, block_k: int, max_len: int | None = None) -> Schedule:
  """The band where segments are at most max_len long and a query block visits fewer keys in it than dense (its
blocks are bq wide); else dense."""
  bq, bk = min(block_q, T), min(block_k, S)
  dense = Schedule(T, S, bq, bk)
  if max_len is None or S < T:
    return dense
  band = Schedule(T, S, bq, bq, True, -(-(max_len - 1) // bq))
  return band if band.visits().shape[1] * bq < dense.nk * bk else dense


def spans(k_segment_BS, key_mask_BS, T: int) -> tuple[jax.Array, jax.Array]:
  """(the longest segment among the last T keys, from its first valid key to its last, padding between counted;
  whether their ids ascend along each row, one run per segment) of valid keys: what the band requires."""
  seg_BT, valid_BT = jnp.asarray(k_segment_BS)[:, -T:].astype(jnp.int32), jnp.asarray(key_mask_BS)[:, -T:] > 0
  t = jnp.arange(T, dtype=jnp.int32)
  last = jax.lax.cummax(jnp.where(valid_BT, seg_BT, -_FAR), axis=1)  # the latest valid id so far, while they ascend
  prev = jnp.concatenate([jnp.full_like(last[:, :1], -_FAR), last[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(valid_BT & (seg_BT != prev), t, 0), axis=1)
  longest = jnp.max(jnp.where(valid_BT, t - start + 1, 0), initial=0)
  return longest, ~jnp.any(valid_BT & (seg_BT < prev))


def outside_band(k_segment_BS, key_mask_BS, T: int, max_len: int) -> jax.Array:
  """Whether some query could see a key outside the band: a segment longer than max_len, or split in two runs."""
  longest, ascending = spans(k_segment_BS, key_mask_BS, T)
  return (longest > max_len) | ~ascending


def check(segment_BT, valid_BT, max_len: int | None, setting: str = "max_segment_len") -> None:
  """Raise a ValueError naming the length and `setting` where concrete segments do not fit the band (traced ones
  are checked in the kernel, which then returns NaN: a non-finite loss, never a silently wrong one)."""
  if max_len is None:
    return
  try:
    seg, valid = np.asarray(segment_BT), np.asarray(valid_BT)
  except jax.errors.TracerArrayConversionError:
    return
  if max_len < 1:
    raise ValueError(f"{setting} must be >= 1, got {max_len}")
  with jax.ensure_compile_time_eval():  # concrete inputs while a caller traces: computed now, not staged
    longest, ascending = (int(x) for x in spans(seg, valid, seg.shape[1]))
  if not ascending:
    raise ValueError("packed segments must be contiguous runs of ascending ids along a row (the band of "
                     f"{setting}={max_len} assumes it)")
  if longest > max_len:
    raise ValueError(f"a packed segment of {longest} positions is longer than {setting}={max_len}: raise "
                     f"{setting} to {longest} or more")
