"""Rows packed end to end (issue 45, verl's remove-padding with fixed shapes): a minibatch's rows laid one after
another into buffer rows of fixed lengths, with no padding between them.

Host (numpy): `plan` packs a minibatch's rows, by their real tokens (a shared prompt's rows only their completions),
into buffers of a few lengths (`sizes`: the budget / 2^k), first-fit decreasing one buffer at a time, the last
buffers of a minibatch the smallest lengths that hold its rest. Each `Buffer` says, per position, which minibatch
row and column it holds, the row's segment id (its ordinal in the buffer row) and its RoPE position (restarting at
each row); with a shared prompt also its table of distinct prompts. A buffer length is one compiled shape: a new
mix of lengths never recompiles. Per microbatch there are S buffer rows, one per device of the batch axes.

Device: `gather` gives the packed microbatch as an `UpdateBatch` (the minibatch's rows, mask and advantages zero
outside the buffer, `packing` set); `completion_logprobs` runs the model over the buffer (attention block-diagonal
by segment) and scatters each completion token's log-prob back to its row's [B, N] slot, so the loss, its three
aggregations, the KL and the ratio are the unpacked minibatch's functions of the same values.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from hilore_jax import model
from hilore_jax.errors import ConfigError
from hilore_jax.rl import logprobs, prompt_share, token_budget
from hilore_jax.rl.update_batch import Packing, UpdateBatch


def sizes(budget: int, n: int, granule: int = 0) -> tuple[int, ...]:
  """Buffer lengths, largest first: every multiple of granule below budget and budget itself (granule > 0), else
  budget / 2^k (k < n) rounded up to a multiple of 8 from 64 on, distinct."""
  if granule:
    return (budget, *range((budget - 1) // granule * granule, 0, -granule))
  return token_budget.bucket_caps(budget, n)


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One packed microbatch of a minibatch: S buffer rows of L positions (numpy; a device holds its buffer row)."""

  row: np.ndarray  # [S, L] int32 minibatch row of each position; B (past the end) on padding
  column: np.ndarray  # [S, L] int32 column in the row's prompt + completion; 0 on padding
  segment: np.ndarray  # [S, L] int32 the row's ordinal in its buffer row, from 1; 0 on padding
  position: np.ndarray  # [S, L] int32 RoPE position within the row
  table: np.ndarray | None = None  # [U] int32 minibatch rows holding its distinct prompts (padded with a copy)
  index: np.ndarray | None = None  # [B] int32 each minibatch row's entry in the table (0 for rows not here)

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.row.shape)

  @property
  def key(self) -> tuple[int, int, int]:
    """What a compiled program of this buffer depends on: (S, L, table length or 0)."""
    return (*self.shape, 0 if self.table is None else len(self.table))

  @property
  def layout(self) -> Packed:
    return PACKED

  @property
  def rows(self) -> np.ndarray:
    """The minibatch rows it holds, in buffer order."""
    r = self.row[self.segment > 0]
    return r[np.concatenate([[True], r[1:] != r[:-1]])] if len(r) else r

  # arrays() split over the mesh's batch axes (a device's buffer rows, so its activations stay its own); the table
  # and each row's entry are replicated
  split_arrays = ("row", "column", "segment", "position")

  def arrays(self) -> dict[str, np.ndarray]:
    """The index arrays a packed program takes."""
    out = {"row": self.row, "column": self.column, "segment": self.segment, "position": self.position}
    if self.table is not None:
      out.update(table=self.table, index=self.index)
    return out

  def computed_positions(self, prompt_len: int) -> int:
    """Token positions it computes: every buffer position and a table's entries x P."""
    return self.row.size + (0 if self.table is None else len(self.table) * prompt_len)

  def describe(self) -> str:
    table = "" if self.table is None else f", {len(self.table)} prompts"
    return f"packed {self.shape[0]} x {self.shape[1]} positions{table}"


def _fill_one(items: list[int], size_of, length: int) -> tuple[list[int], list[int]]:
  """(items one buffer of `length` takes, first fit in the given (decreasing) order; the rest)."""
  taken, rest, free = [], [], length
  for i in items:
    if size_of[i] <= free:
      taken.append(i)
      free -= size_of[i]
    else:
      rest.append(i)
  return taken, rest


def _pack_rest(items: list[int], size_of, lengths: tuple[int, ...],
               overhead: int) -> tuple[int, list[tuple[int, list[int]]]]:
  """(positions, buffers) for items whose total fits the largest of `lengths` (ascending): the better of one buffer
  of the smallest length that holds them all, and the largest length below their total filled first fit decreasing
  followed by the best packing of what it leaves (a minibatch's rest after its full buffers); each buffer costs its
  length plus `overhead` positions (its prompt table)."""
  if not items:
    return 0, []
  total, longest = sum(int(size_of[i]) for i in items), int(size_of[items[0]])
  fits = [n for n in lengths if n >= longest]
  whole = min(n for n in fits if n >= total)
  best = (whole + overhead, [(whole, items)])
  below = [n for n in fits if n < total]
  if below:
    taken, rest = _fill_one(items, size_of, below[-1])
    n, bufs = _pack_rest(rest, size_of, lengths, overhead)
    if n + below[-1] + overhead < best[0]:
      best = (n + below[-1] + overhead, [(below[-1], taken), *bufs])
  return best


def pack_lengths(sizes_R, lengths: tuple[int, ...], overhead: int = 0) -> list[tuple[int, list[int]]]:
  """Items of sizes_R into buffers of the given lengths (largest first): (buffer length, its items in order) each.

  Longest items first, full-length buffers filled first fit while the rest exceeds one; the rest then goes to the
  combination of buffer lengths, each filled first fit decreasing, that computes the fewest positions, a buffer
  counting `overhead` positions beyond its length (a shared prompt's table, computed once per buffer)."""
  size_of = np.asarray(sizes_R)
  items = [int(i) for i in np.argsort(-size_of, kind="stable")]
  out = []
  while sum(size_of[i] for i in items) > lengths[0]:
    taken, items = _fill_one(items, size_of, lengths[0])
    out.append((lengths[0], taken))
  return out + _pack_rest(items, size_of, tuple(sorted(lengths)), overhead)[1]


def row_extent(mask_BN, prompt_mask_BP) -> tuple[np.ndarray, np.ndarray]:
  """(completion lengths, prompt lengths) [B] of rows whose completion mask is a prefix and prompt mask a suffix
  (what packing reads as their real tokens); any other mask is an error."""
  mask, pmask = np.asarray(mask_BN) > 0, np.asarray(prompt_mask_BP) > 0
  n, p = mask.sum(1), pmask.sum(1)
  if not (np.array_equal(mask, np.arange(mask.shape[1])[None] < n[:, None]) and
          np.array_equal(pmask, np.arange(pmask.shape[1])[None] >= pmask.shape[1] - p[:, None])):
    raise ValueError("packing needs right-padded completions and left-padded prompts (masks without holes)")
  return n, p


def plan(mask_BN, prompt_mask_BP, lengths: tuple[int, ...], shards: int = 1, prompt_keys_B=None, distinct: int = 0,
         setting: str = "train.max_tokens_per_microbatch") -> list[Buffer]:
  """A minibatch's packed microbatches: every row with a completion token exactly once, its real tokens (with
  prompt_keys_B, a shared prompt: its completion only; the table gets its prompt) end to end in buffer rows of the
  given lengths (per device), `shards` buffer rows of one length per microbatch. distinct: the run's bound on a
  minibatch's distinct prompts (prompt_share.max_distinct), so every table has one length. A row longer than the
  largest buffer is an error naming `setting`."""
  n_B, p_B = row_extent(mask_BN, prompt_mask_BP)
  B, P = len(n_B), np.shape(prompt_mask_BP)[1]
  shared = prompt_keys_B is not None
  rows = np.flatnonzero(n_B > 0)
  size_R = n_B[rows] if shared else n_B[rows] + p_B[rows]
  if len(rows) and size_R.max() > lengths[0]:
    split = "" if shards == 1 else f", split over {shards} devices"
    raise ConfigError(f"a row of {int(size_R.max())} tokens does not fit a packed buffer of {lengths[0]} positions: "
                      f"raise {setting} (now {lengths[0] * shards}{split}) to {int(size_R.max()) * shards} or more")
  by_length: dict[int, list[list[int]]] = {}
  # a buffer's table: the run's table length of prompts, each P positions (per device: the table is replicated)
  overhead = prompt_share.table_size(max(distinct, 1), B) * P if shared else 0
  for length, items in pack_lengths(size_R, lengths, overhead):
    by_length.setdefault(length, []).append([int(rows[i]) for i in items])
  out = []
  for length, bufs in sorted(by_length.items(), reverse=True):
    for j in range(0, len(bufs), shards):
      group = bufs[j:j + shards]
      group += [[] for _ in range(shards - len(group))]  # a short last microbatch: empty buffer rows
      out.append(_buffer(group, length, B, P, n_B, p_B, shared))
  if shared:
    out = [_with_table(b, prompt_keys_B, distinct, B) for b in out]
  return out


def _buffer(groups: list[list[int]], length: int, B: int, P: int, n_B, p_B, shared: bool) -> Buffer:
  """The index arrays of S buffer rows holding groups[s]'s rows in order."""
  S = len(groups)
  row, col, seg, pos = (np.zeros((S, length), np.int32) for _ in range(4))
  row[:] = B
  for s, rows in enumerate(groups):
    t = 0
    for k, r in enumerate(rows):
      cols = np.arange(P, P + n_B[r]) if shared else np.arange(P - p_B[r], P + n_B[r])
      span = slice(t, t + len(cols))
      row[s, span], col[s, span], seg[s, span] = r, cols, k + 1
      pos[s, span] = cols - (P - p_B[r])  # the row's real tokens before it: its unpacked position
      t += len(cols)
  return Buffer(row, col, seg, pos)


def _with_table(buf: Buffer, prompt_keys_B, distinct: int, B: int) -> Buffer:
  """buf with the table of its rows' distinct prompts (prompt_share.table_size entries: one length per run)."""
  keys = np.asarray(prompt_keys_B)
  rows = buf.rows
  if not len(rows):  # an empty microbatch (no row has a token): any prompt, no row indexes it
    rows = np.zeros(1, np.int64)
  _, first, inverse = np.unique(keys[rows], return_index=True, return_inverse=True)
  size = prompt_share.table_size(max(distinct, len(first)), B)
  index = np.zeros(B, np.int32)
  index[rows] = inverse.reshape(-1)
  return dataclasses.replace(buf, table=rows[np.pad(first, (0, size - len(first)), mode="edge")].astype(np.int32),
                             index=index)


def worth_packing(packed_positions: int, padded_positions: int, min_saving: float) -> bool:
  """Whether buffers computing packed_positions save at least min_saving of the padded layout's positions (0: always
  pack): where they save less, the padded rows are cheaper, a buffer's attention spanning all its rows."""
  return min_saving == 0 or packed_positions <= (1 - min_saving) * padded_positions


def choose(buffers: list[Buffer], padded: list, prompt_len: int, min_saving: float) -> list:
  """A minibatch's microbatches: its packed buffers where worth_packing against its padded microbatches (the token
  budget's length buckets of the same rows), else those."""
  count = lambda micros: sum(m.computed_positions(prompt_len) for m in micros)
  return buffers if worth_packing(count(buffers), count(padded), min_saving) else padded


def real_positions(buffers: list[Buffer], prompt_lengths_B) -> int:
  """Positions that hold a real token: the buffers' rows and each table's distinct prompts a row reads."""
  p = np.asarray(prompt_lengths_B)
  out = 0
  for b in buffers:
    out += int(np.sum(b.segment > 0))
    if b.table is not None and len(b.rows):
      out += int(p[b.table[np.unique(b.index[b.rows])]].sum())
  return out


# ----------------------------------------------------------------------------- device


@dataclasses.dataclass(frozen=True)
class Packed:
  """How a packed program reads a buffer out of its minibatch and writes per-token values back (static)."""

  def gather(self, batch: UpdateBatch, idx: dict) -> UpdateBatch:
    return gather(batch, idx)

  def scatter(self, acc_BN, idx: dict, values_BN):
    """values are already in the minibatch's [B, N] layout, zero outside the buffer's rows."""
    del idx
    return acc_BN + values_BN.astype(acc_BN.dtype)

  def values(self, x_BN, idx: dict):
    """A minibatch's [B, N] values as the packed microbatch's: the same layout."""
    del idx
    return x_BN


PACKED = Packed()


def gather(batch: UpdateBatch, idx: dict) -> UpdateBatch:
  """The packed microbatch of Buffer.arrays() idx: batch with mask and advantages zero outside the buffer's rows,
  its packing, and with idx's table its own prompt table (the minibatch's, if any, is not carried)."""
  B = batch.rows
  in_B = jnp.zeros(B, jnp.int32).at[idx["row"].reshape(-1)].set(1, mode="drop")
  fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
            if f.name not in prompt_share.SHARE_FIELDS and f.name != "packing"}
  fields["mask"] = fields["mask"] * in_B[:, None].astype(fields["mask"].dtype)
  if fields.get("adv") is not None:
    fields["adv"] = fields["adv"] * in_B.astype(fields["adv"].dtype)
  if "table" in idx:
    fields.update(prompt_table=jnp.take(batch.prompt_ids, idx["table"], axis=0),
                  prompt_table_mask=jnp.take(batch.prompt_mask, idx["table"], axis=0), prompt_index=idx["index"])
  return UpdateBatch(**fields, packing=Packing(idx["row"], idx["column"], idx["segment"], idx["position"]))


def completion_logprobs(cfg: model.ModelConfig, params, batch: UpdateBatch, policies=None, chunk: int = 128,
                        temperature: float = 1.0):
  """(log pi(completion token), entropy) [B, N] of a packed batch's buffer, each at its row's slot (0 elsewhere):
  the model over the buffer rows [S, L], segment by segment (block-diagonal causal attention, positions restarting
  at each row; with a prompt table each completion also reads its prompt's keys and values there)."""
  pk = batch.packing
  B, P = batch.rows, batch.prompt_len
  valid_SL = pk.segment > 0
  row_SL = jnp.minimum(pk.row, B - 1)
  seq_BT = jnp.concatenate([batch.prompt_ids, batch.tokens], axis=1)
  ids_SL = jnp.where(valid_SL, seq_BT[row_SL, pk.column], 0)
  if batch.prompt_index is not None:
    entry_SL = jnp.where(valid_SL, jnp.take(batch.prompt_index, row_SL), -1)
    # a segment is one completion, at most the batch's N tokens: blockwise attention visits only that band
    h = model.packed_shared_hidden_states(cfg, params, batch.prompt_table, batch.prompt_table_mask, ids_SL,
                                          pk.position, pk.segment, entry_SL, policies, batch.completion_len)
  else:  # each segment holds its prompt too: position t - 1 predicts token t
    h = model.hidden_states(cfg, params, ids_SL, valid_SL, positions_BT=pk.position, layer_policies=policies,
                            segment_ids_BT=pk.segment, max_segment_len=P + batch.completion_len)
    h = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
  logp_SL, ent_SL = logprobs.token_logprobs(h, model.lm_head_weight(cfg, params), ids_SL, chunk, temperature)
  target_SL = valid_SL & (pk.column >= P)
  r, c = jnp.where(target_SL, pk.row, B), jnp.where(target_SL, pk.column - P, 0)  # others dropped
  back = lambda x_SL: jnp.zeros(batch.tokens.shape, jnp.float32).at[r, c].set(x_SL, mode="drop")
  return back(logp_SL), back(ent_SL)


def activation_shape(batch: UpdateBatch, shards: int) -> tuple[int, int]:
  """(rows, length) of the activations a packed gradient pass holds on one device: its buffer rows and the length
  that makes rows x length the positions it computes (its buffers and, replicated, the table's prompts once)."""
  S, L = batch.packing.shape
  rows = -(-S // shards)
  if batch.prompt_table is None:
    return rows, L
  return rows, -(-(batch.prompt_table.shape[0] * batch.prompt_len + rows * L) // rows)
