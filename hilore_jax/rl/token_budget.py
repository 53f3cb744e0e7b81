"""The token budget for long completions: a minibatch's rows packed by completion length into microbatches of at
most a budget of positions, rows x (prompt length + bucket cap), the cap one of a short ladder of lengths.

The minibatch is unchanged: the plan (host numpy, from its rows' completion lengths) says which of its rows each
microbatch holds, and the programs gather them on the device (`gather`) and scatter per-row results back into the
minibatch's [B, N] layout (`scatter`), so the loss normalisers and the row order are those of the unpacked update.
Each bucket's microbatches have one row count (the last padded with zero-weight dummy slots), so a run compiles at
most one program per bucket and pass.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from hilore_jax.rl.update_batch import UpdateBatch

COLUMN_FIELDS = ("tokens", "mask", "old_logp", "ref_logp")  # the [B, N] fields a bucket's cap cuts


@dataclasses.dataclass(frozen=True)
class Micro:
  """One microbatch of a minibatch: which rows, which are real, how many completion columns."""

  rows: np.ndarray  # [R] int32 row indices into the minibatch; a dummy slot repeats a real row
  live: np.ndarray  # [R] int32: 0 on dummy slots (no token counts, zero weight)
  cap: int  # completion columns kept (every real row's completion fits)

  @property
  def shape(self) -> tuple[int, int]:
    return len(self.rows), self.cap


def bucket_caps(max_new_tokens: int, n: int) -> tuple[int, ...]:
  """The ladder of completion caps max_new_tokens / 2^k (k < n), rounded up to a multiple of 8 from 64 tokens on
  (of 1 below), distinct, largest first."""
  quantum = 8 if max_new_tokens >= 64 else 1
  caps: list[int] = []
  for k in range(n):
    cap = -(-max_new_tokens // 2**k)  # ceil
    cap = min(max_new_tokens, -(-cap // quantum) * quantum)
    if cap not in caps:
      caps.append(cap)
  return tuple(caps)


def rows_per_microbatch(budget: int, prompt_len: int, cap: int, max_rows: int, multiple: int = 1) -> int:
  """A bucket's fixed row count: as many rows as the budget holds at this cap, at most max_rows (the minibatch),
  a multiple of `multiple` (the devices the rows are split over)."""
  rows = min(budget // (prompt_len + cap), max_rows)
  return rows - rows % multiple


def plan(lengths_B, prompt_len: int, caps: tuple[int, ...], budget: int, max_rows: int,
         multiple: int = 1) -> list[Micro]:
  """Microbatches holding every row with a completion token exactly once (rows without one carry no loss and are
  left out), longest first: each starts at its longest remaining row's bucket and fills up with the next longest;
  the last takes the bucket that holds the rest in the fewest positions. Every microbatch's rows x (prompt_len +
  cap) is within budget."""
  lengths = np.asarray(lengths_B)
  order = np.argsort(-lengths, kind="stable")
  order = order[lengths[order] > 0]
  up = sorted(caps)
  out, pos = [], 0
  rows_at = {c: rows_per_microbatch(budget, prompt_len, c, max_rows, multiple) for c in up}
  while pos < len(order):
    fits = [c for c in up if c >= lengths[order[pos]]]
    cap, left = fits[0], len(order) - pos
    if rows_at[cap] < 1:
      raise ValueError(f"a token budget of {budget} holds no {multiple} row(s) of {prompt_len} + {cap} tokens")
    whole = [c for c in fits if rows_at[c] >= left]  # the last microbatch: the fewest positions that hold the rest
    if left <= rows_at[cap] and whole:
      cap = min(whole, key=lambda c: (rows_at[c] * (prompt_len + c), c))
    n = rows_at[cap]
    take = order[pos:pos + n]
    pos += len(take)
    pad = n - len(take)
    out.append(Micro(np.concatenate([take, np.full(pad, take[0])]).astype(np.int32),
                     np.concatenate([np.ones(len(take)), np.zeros(pad)]).astype(np.int32), int(cap)))
  return out


def positions(micros: list[Micro], prompt_len: int) -> int:
  """Sequence positions the microbatches compute (real and padded)."""
  return sum(m.shape[0] * (prompt_len + m.cap) for m in micros)


def gather(batch: UpdateBatch, rows_R, live_R, cap: int) -> UpdateBatch:
  """The microbatch [R, P + cap]: rows_R of batch, completion columns cut to cap, dummy slots (live 0) masked
  and zero-weighted. Cutting columns past every row's completion changes no earlier position (causal)."""
  fields = {}
  for f in dataclasses.fields(batch):
    x = getattr(batch, f.name)
    if x is not None:
      x = jnp.take(x, rows_R, axis=0)
      x = x[:, :cap] if f.name in COLUMN_FIELDS else x
    fields[f.name] = x
  fields["mask"] = fields["mask"] * live_R[:, None].astype(fields["mask"].dtype)
  if fields["adv"] is not None:
    fields["adv"] = fields["adv"] * live_R.astype(fields["adv"].dtype)
  return UpdateBatch(**fields)


def scatter(acc_BN, rows_R, live_R, values_RC):
  """acc [B, N] with a microbatch's per-token values [R, cap] written to its real rows' first cap columns."""
  B = acc_BN.shape[0]
  idx = jnp.where(live_R > 0, rows_R, B)  # dummy slots point past the end: dropped
  return acc_BN.at[idx, :values_RC.shape[1]].set(values_RC.astype(acc_BN.dtype), mode="drop")
