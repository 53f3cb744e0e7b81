"""The token budget for long completions: a minibatch's rows packed by completion length into microbatches of at
most a budget of positions, rows x (prompt length + bucket cap), the cap one of a short ladder of lengths.

The minibatch is unchanged: the plan (host numpy, from its rows' completion lengths) says which of its rows each
microbatch holds, and the programs gather them on the device (`gather`) and scatter per-row results back into the
minibatch's [B, N] layout (`scatter`), so the loss normalisers and the row order are those of the unpacked update.
Each bucket's microbatches have one row count (the last padded with zero-weight dummy slots), so a run compiles at
most one program per bucket and pass. With a shared prompt (rl/prompt_share.py) each microbatch also says which of
its rows hold its distinct prompts (`share`): the programs gather that table from the minibatch's rows too, one
table length per row count, so the shapes stay fixed.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from hilore_jax.rl import prompt_share
from hilore_jax.rl.update_batch import UpdateBatch

COLUMN_FIELDS = ("tokens", "mask", "old_logp", "ref_logp")  # the [B, N] fields a bucket's cap cuts


@dataclasses.dataclass(frozen=True)
class Micro:
  """One microbatch of a minibatch: which rows, which are real, how many completion columns."""

  rows: np.ndarray  # [R] int32 row indices into the minibatch; a dummy slot repeats a real row
  live: np.ndarray  # [R] int32: 0 on dummy slots (no token counts, zero weight)
  cap: int  # completion columns kept (every real row's completion fits)
  # a shared prompt: [U] int32 minibatch rows holding its distinct prompts (padded with a copy no slot indexes) and
  # [R] int32 each slot's entry among them; None: every row computes its own prompt
  table: np.ndarray | None = None
  index: np.ndarray | None = None

  @property
  def shape(self) -> tuple[int, int]:
    return len(self.rows), self.cap

  @property
  def key(self) -> tuple[int, int, int]:
    """What a compiled program of this microbatch depends on: (rows, cap, table length or 0)."""
    return len(self.rows), self.cap, 0 if self.table is None else len(self.table)

  @property
  def layout(self) -> Columns:
    return Columns(self.cap)

  def computed_positions(self, prompt_len: int) -> int:
    """Token positions it computes: rows x (P + cap), shared its table entries x P + rows x cap."""
    if self.table is None:
      return len(self.rows) * (prompt_len + self.cap)
    return len(self.table) * prompt_len + len(self.rows) * self.cap

  def describe(self) -> str:
    shared = "" if self.table is None else f", {len(self.table)} prompts"
    return f"token budget: {len(self.rows)} rows x {self.cap} completion tokens{shared}"

  split_arrays = ()  # arrays() split over the mesh's batch axes: none, every device gathers the same rows

  def arrays(self) -> dict[str, np.ndarray]:
    """The index arrays a packed program takes (replicated on the mesh)."""
    out = {"rows": self.rows, "live": self.live}
    if self.table is not None:
      out.update(table=self.table, index=self.index)
    return out


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


def share(micros: list[Micro], prompt_keys_B, distinct: int) -> list[Micro]:
  """micros with the table of their distinct prompts (prompt_keys_B: each minibatch row's prompt, equal ids for
  equal prompts), prompt_share.table_size(distinct) entries at most the rows (distinct: the run's bound, so a row
  count has one table length); a microbatch whose table would not be below its rows stays unshared."""
  keys = np.asarray(prompt_keys_B)
  out = []
  for m in micros:
    _, first, inverse = np.unique(keys[m.rows], return_index=True, return_inverse=True)
    size = prompt_share.table_size(max(distinct, len(first)), len(m.rows))
    if size >= len(m.rows):
      out.append(m)
      continue
    table = m.rows[np.pad(first, (0, size - len(first)), mode="edge")]
    out.append(dataclasses.replace(m, table=table.astype(np.int32), index=inverse.reshape(-1).astype(np.int32)))
  return out


def positions(micros: list[Micro], prompt_len: int) -> int:
  """Sequence positions the microbatches hold (real and padded), every row with its own prompt."""
  return sum(m.shape[0] * (prompt_len + m.cap) for m in micros)


def computed_positions(micros: list, prompt_len: int) -> int:
  """Token positions the microbatches (bucketed or packed) compute."""
  return sum(m.computed_positions(prompt_len) for m in micros)


def step_tokens(batches: list[UpdateBatch], plans: list) -> tuple[int, int]:
  """(token positions one gradient pass over a step's minibatches computes, with packing (plans: each minibatch's
  microbatches, or None) and sharing; the positions without either, rows x (P + N)): tokens/computed and
  tokens/unshared per pass."""
  computed = sum(prompt_share.token_counts(b)[0] if m is None else computed_positions(m, b.prompt_len)
                 for b, m in zip(batches, plans))
  return computed, sum(prompt_share.token_counts(b)[1] for b in batches)


def gather(batch: UpdateBatch, idx: dict, cap: int) -> UpdateBatch:
  """The microbatch [R, P + cap] of Micro.arrays() idx: rows of batch, completion columns cut to cap, dummy slots
  (live 0) masked and zero-weighted, and with idx's table its own prompt table (the minibatch's table, if any, is
  the minibatch's: not carried). Cutting columns past every row's completion changes no earlier position (causal)."""
  rows_R, live_R = idx["rows"], idx["live"]
  fields = {}
  for f in dataclasses.fields(batch):
    x = getattr(batch, f.name)
    if x is not None and f.name not in prompt_share.SHARE_FIELDS:
      x = jnp.take(x, rows_R, axis=0)
      x = x[:, :cap] if f.name in COLUMN_FIELDS else x
      fields[f.name] = x
  fields["mask"] = fields["mask"] * live_R[:, None].astype(fields["mask"].dtype)
  if "adv" in fields:
    fields["adv"] = fields["adv"] * live_R.astype(fields["adv"].dtype)
  if "table" in idx:
    fields.update(prompt_table=jnp.take(batch.prompt_ids, idx["table"], axis=0),
                  prompt_table_mask=jnp.take(batch.prompt_mask, idx["table"], axis=0), prompt_index=idx["index"])
  return UpdateBatch(**fields)


@dataclasses.dataclass(frozen=True)
class Columns:
  """How a bucketed microbatch is read out of its minibatch (its rows, completions cut to cap) and its per-token
  values written back (static: a packed program's layout, rl/packing.py's Packed the other)."""

  cap: int

  def gather(self, batch: UpdateBatch, idx: dict) -> UpdateBatch:
    return gather(batch, idx, self.cap)

  def scatter(self, acc_BN, idx: dict, values_RC):
    return scatter(acc_BN, idx, values_RC)

  def values(self, x_BN, idx: dict):
    """A minibatch's [B, N] values as the microbatch's [R, cap]."""
    return x_BN[idx["rows"], :self.cap]


def scatter(acc_BN, idx: dict, values_RC):
  """acc [B, N] with a microbatch's per-token values [R, cap] written to its real rows' first cap columns."""
  B = acc_BN.shape[0]
  rows = jnp.where(idx["live"] > 0, idx["rows"], B)  # dummy slots point past the end: dropped
  return acc_BN.at[rows, :values_RC.shape[1]].set(values_RC.astype(acc_BN.dtype), mode="drop")
