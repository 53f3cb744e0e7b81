"""A GRPO group's prompt computed once in the update (issue 35): each minibatch's distinct prompts as a table, each row
an index into it (`UpdateBatch.prompt_table`, `prompt_table_mask`, `prompt_index`), built on the host.

Minibatches keep their rows (the shuffle decides them, as without sharing): a table holds the distinct prompts of
each microbatch slice, so a partial group (any 1..G of its rows, replayed rows) is just fewer rows indexing the same
entry. The table's length per microbatch is the run's bound on distinct prompts (`max_distinct`: its rollout's
prompts plus the most replayed rows) rounded up to a power of two, so every step compiles one shape and the memory
budget measured on one step holds for all; it is padded with copies of a real prompt no row indexes; where that is
not below the slice's rows the batch stays unshared (sharing would compute as much). On the data mesh the table is
replicated and the rows (and their indices) split as always: every shard computes every prompt of the minibatch,
which is exact whatever rows it holds; the saving is G-fold per shard only when a shard holds whole groups."""

from __future__ import annotations

import jax
import numpy as np

from hilore_jax.rl import replay
from hilore_jax.rl.update_batch import UpdateBatch

TABLE_FIELDS = ("prompt_table", "prompt_table_mask")  # replicated on the mesh (not split by rows)
SHARE_FIELDS = (*TABLE_FIELDS, "prompt_index")


def table_size(distinct: int, rows: int) -> int:
  """Table entries per microbatch: the distinct prompts rounded up to a power of two, at most the rows."""
  return min(rows, 1 << max(distinct - 1, 0).bit_length())


def _slices(batch: UpdateBatch, microbatches: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Per microbatch slice: the rows (batch indices) of its distinct prompts and each row's index among them."""
  ids, pmask = np.asarray(batch.prompt_ids), np.asarray(batch.prompt_mask)
  m = ids.shape[0] // microbatches
  firsts, inverses = [], []
  for j in range(microbatches):
    key = np.concatenate([ids[j * m:(j + 1) * m], pmask[j * m:(j + 1) * m]], axis=1)
    _, first, inverse = np.unique(key, axis=0, return_index=True, return_inverse=True)
    firsts.append(j * m + first)
    inverses.append(inverse.reshape(-1))
  return firsts, inverses


def prompt_keys(batch: UpdateBatch) -> np.ndarray:
  """[B] int: each row's prompt as an id, equal for rows of equal prompts (the token budget's tables read them)."""
  return _slices(batch, 1)[1][0]


def distinct_prompts(batch: UpdateBatch, microbatches: int = 1) -> int:
  """The most distinct prompts any microbatch slice of batch holds."""
  return max(len(f) for f in _slices(batch, microbatches)[0])


def share_prompts(batch: UpdateBatch, microbatches: int = 1, distinct: int | None = None) -> UpdateBatch:
  """batch (host arrays) with a prompt table per microbatch slice and each row's index into its own slice's
  entries, table_size(distinct) entries each (default: batch's own count); batch unchanged where the table would
  not be smaller than the slice."""
  firsts, inverses = _slices(batch, microbatches)
  m = batch.rows // microbatches
  U = table_size(max(distinct or 0, *(len(f) for f in firsts)), m)
  if U >= m:
    return batch
  rows = np.concatenate([np.pad(f, (0, U - len(f)), mode="edge") for f in firsts])
  return batch.replace(prompt_table=np.asarray(batch.prompt_ids)[rows],
                       prompt_table_mask=np.asarray(batch.prompt_mask)[rows],
                       prompt_index=np.concatenate(inverses).astype(np.int32))


def share_all(batches: list[UpdateBatch], microbatches: int = 1, distinct: int = 0) -> list[UpdateBatch]:
  """A step's minibatches, all with tables of one size (one compiled signature; the memory manager stacks them)
  or all unshared: sized for `distinct` prompts (a run's bound: its tables keep one shape, so the memory budget
  measured on one step's holds for every step) or the most any minibatch holds, whichever is more."""
  if not batches:
    return batches
  distinct = max(distinct, *(distinct_prompts(b, microbatches) for b in batches))
  return [share_prompts(b, microbatches, distinct) for b in batches]


def max_distinct(c, rows: int | None = None) -> int:
  """The most distinct prompts a contiguous slice of `rows` rows (default: a minibatch) of run config c can hold.
  Rows shuffled: every fresh prompt of a rollout and every replayed row's own (rollouts enter the update in groups,
  replayed rows may each be another prompt's). Whole groups (train.shuffle=group): rows / G groups where the slices
  cut at group boundaries (every group of G rows, none replayed, rows a multiple of G), else the groups inside the
  slice, a partial one at each end, and the replayed rows."""
  G, prompts = c.rollout.num_generations, c.rollout.num_prompts
  replayed = replay.max_replay_rows(c.replay, prompts * G)
  if c.train.shuffle == "row":
    return prompts + replayed
  rows = rows or c.minibatch_size
  if not replayed and rows % G == 0:
    return min(prompts, rows // G)
  return min(prompts, rows // G + 2) + replayed


def unshared(batch: UpdateBatch) -> UpdateBatch:
  """The same batch without its prompt table (every row computes its own prompt)."""
  return batch.replace(**{f: None for f in SHARE_FIELDS})


def shared(batch: UpdateBatch) -> bool:
  return batch.prompt_index is not None


def token_counts(batch: UpdateBatch) -> tuple[int, int]:
  """(token positions the update computes, token positions it would compute unshared) of one minibatch."""
  unshared_tokens = batch.rows * (batch.prompt_len + batch.completion_len)
  if not shared(batch):
    return unshared_tokens, unshared_tokens
  return batch.prompt_table.shape[0] * batch.prompt_len + batch.rows * batch.completion_len, unshared_tokens


def field_shardings(batch, split, rep):
  """Each present field's sharding: the prompt table replicated, every other field (a packing's arrays too: its
  buffer rows) split over the batch axes."""
  one = lambda f, v: None if v is None else rep if f in TABLE_FIELDS else jax.tree.map(lambda _: split, v)
  return type(batch)(**{f: one(f, v) for f, v in vars(batch).items()})


def activation_shape(batch: UpdateBatch, microbatches: int, shards: int) -> tuple[int, int]:
  """(rows, sequence length) of the activations one gradient pass holds on one device: a microbatch's rows on a
  device and, with a table, the length that makes rows x length the token positions it computes (its share of the
  completions and, replicated, every prompt of the table once). The memory units of [B, T, ...] tensors count
  exactly these; the xla kernel's [B, K, G, T, S] probabilities are then approximated at T = S = that length."""
  rows = -(-batch.rows // (microbatches * shards))
  if not shared(batch):
    return rows, batch.prompt_len + batch.completion_len
  table = batch.prompt_table.shape[0] // microbatches
  return rows, -(-(table * batch.prompt_len + rows * batch.completion_len) // rows)
