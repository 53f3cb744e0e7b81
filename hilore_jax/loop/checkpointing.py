"""Orbax checkpoints of the train state plus JSON metadata (step, RNG, data position, config).

Saves are atomic (orbax writes `<step>.orbax-checkpoint-tmp` and renames it); what a killed save leaves is removed
when the next run opens the directory. Every array's checksum is saved with it, so a damaged checkpoint is found
on restore, and resuming falls back to the newest good one instead of training on corrupt weights.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import shutil
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from hilore_jax.errors import CheckpointError

log = logging.getLogger(__name__)


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """Wrapping uint32 sum of the array's bit patterns: any changed element changes it, on any sharding."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
  return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree_util.tree_map(_leaf_checksum, tree))


def checksums(tree) -> dict[str, int]:
  """{leaf path: checksum} of a tree of arrays (one small device program, one transfer)."""
  sums = jax.device_get(_checksums(tree))
  return {jax.tree_util.keystr(path): int(v) for path, v in jax.tree_util.tree_leaves_with_path(sums)}


def _orbax_read_report(unraisable) -> bool:
  """An unraisable report left by a failed restore's other reads: a coroutine of the read (whatever it raised as it
  was closed) or a callback after the read's event loop closed."""
  obj, exc = unraisable.object, unraisable.exc_value
  if inspect.iscoroutine(obj) or "coroutine" in (unraisable.err_msg or "") or "coroutine" in repr(obj)[:80]:
    return True
  return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


@contextlib.contextmanager
def _quiet_failed_reads():
  """Around one restore: if a read of a damaged checkpoint fails, orbax's other reads of it still finish on
  tensorstore threads, after their event loop closed, and each would print a traceback ("Exception ignored in
  coroutine ...") for what is already one CheckpointError. Drop those reports (their count is logged once at debug
  level) and asyncio's 'Task exception was never retrieved' until the restore is over, then put the previous hook
  back; any other unraisable report still prints."""
  previous, dropped = sys.unraisablehook, [0]

  def hook(unraisable):
    if not _orbax_read_report(unraisable):
      previous(unraisable)
      return
    dropped[0] += 1
    if dropped[0] == 1:
      log.debug("dropping the unraisable reports of a failed restore's other reads (first: %s)",
                _first_line(unraisable.exc_value) if unraisable.exc_value else unraisable.err_msg)

  def no_lost_task(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Task exception was never retrieved")

  asyncio_log = logging.getLogger("asyncio")
  sys.unraisablehook = hook
  asyncio_log.addFilter(no_lost_task)
  try:
    yield
  except BaseException:
    gc.collect()  # the failed restore's suspended reads are finalised now, while their reports are dropped
    raise
  finally:
    if sys.unraisablehook is hook:  # one installed meanwhile by someone else stays
      sys.unraisablehook = previous
    asyncio_log.removeFilter(no_lost_task)


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


class Checkpointer:
  """CheckpointManager wrapper: atomic, checksummed saves; keeps the last K; restores the newest good one."""

  def __init__(self, directory: str, keep: int, create: bool = True):
    self.directory = os.path.abspath(directory)
    self.writable = create
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=False,
                                           cleanup_tmp_directories=create)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, meta: dict):
    meta = {**meta, "checksums": checksums(state)}
    try:  # a failed save leaves only its temporary directory: the previous checkpoint stays the newest
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
      self.manager.wait_until_finished()
    except OSError as e:
      raise CheckpointError(f"saving step {step} to {self.directory} failed ({_first_line(e)}); the newest "
                            f"checkpoint is still step {self.latest_step()}") from None

  def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
    """State restored straight into the shardings that abstract_state carries; CheckpointError if damaged."""
    try:  # orbax and tensorstore raise many types (KeyError, ValueError, JSONDecodeError, bare Exception)
      with _quiet_failed_reads():
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                                 meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"step {step} does not restore ({_first_line(e)})") from None
    state, meta = out["state"], out["meta"]
    saved = (meta or {}).get("checksums") or {}  # absent in checkpoints written before checksums
    for key, value in checksums(state).items():
      if key in saved and saved[key] != value:
        raise CheckpointError(f"step {step}: {key} does not match the checksum saved with it (damaged data)")
    return state, meta

  def restore_meta(self, step: int) -> dict:
    """Only the JSON metadata of a checkpoint."""
    try:
      with _quiet_failed_reads():
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"step {step}: metadata does not restore ({_first_line(e)})") from None

  def restore_newest(self, abstract_for: Callable[[dict], object]) -> tuple[int, dict, dict] | None:
    """(step, state, meta) of the newest checkpoint that restores intact; None if there is none at all.

    abstract_for(meta) gives the abstract state to restore into. A damaged newer checkpoint is reported with the
    step resumed instead and, when writable, moved to `<directory>.broken/` so later saves can reuse its step.
    CheckpointError if checkpoints exist but none restores: a run never silently starts over.
    """
    failures: list[tuple[int, str]] = []
    # one quiet scope over every attempt: a failed restore's other reads may finish while an older checkpoint is
    # being tried, after that restore's own scope has ended
    with _quiet_failed_reads():
      for step in reversed(self.steps()):
        try:
          state, meta = self.restore(step, abstract_for(self.restore_meta(step)))
        except CheckpointError as e:
          failures.append((step, str(e)))
          continue
        if failures:
          moved = self._set_aside([s for s, _ in failures])
          log.warning("checkpoint %s in %s is unusable (%s); resuming from step %d, the newest good checkpoint%s",
                      ", ".join(str(s) for s, _ in failures), self.directory, "; ".join(m for _, m in failures),
                      step, f" (moved the broken ones to {moved})" if moved else "")
        return step, state, meta
      if failures:
        raise CheckpointError(f"no usable checkpoint in {self.directory}: {'; '.join(m for _, m in failures)}; "
                              f"resume with the config that wrote them, or move the directory away to start over")
    return None

  def _set_aside(self, steps: list[int]) -> str | None:
    """Move broken step directories out of orbax's sight (kept for inspection, never deleted)."""
    if not self.writable:
      return None
    if jax.process_index() != 0:  # one process moves them on a shared filesystem
      self.manager.reload()
      return None
    dest = self.directory + ".broken"
    os.makedirs(dest, exist_ok=True)
    for step in steps:
      src, target, n = os.path.join(self.directory, str(step)), os.path.join(dest, str(step)), 1
      while os.path.exists(target):
        target, n = os.path.join(dest, f"{step}-{n}"), n + 1
      if os.path.exists(src):
        shutil.move(src, target)
    self.manager.reload()
    return dest

  def close(self):
    self.manager.close()


def run_tree(train, ref=None, replay=None) -> dict:
  """The one layout of a run's checkpoint: the train state, the KL's reference params and the replay buffer (each
  present only when the run has it); a tree of arrays, of their shardings or of abstract arrays alike."""
  tree = {"train": train}
  if ref is not None:
    tree["ref"] = ref
  if replay is not None:
    tree["replay"] = replay
  return tree


# What a checkpoint's meta says of its params' layout: the train layout (every layer leaf stacked along a leading
# axis, model/layers.py). Checkpoints written before it hold the layers as a list and are stacked on restore.
LAYERS_KEY, STACKED = "layers", "stacked"


def _layer_dicts(tree, fn):
  """fn applied to every params-shaped dict of tree (the params, the reference, each optimizer moment)."""
  return jax.tree_util.tree_map(lambda x: fn(x) if isinstance(x, dict) and "layers" in x else x, tree,
                                is_leaf=lambda x: isinstance(x, dict) and "layers" in x)


def per_layer_abstract(abstract):
  """The abstract tree of a checkpoint written with per-layer params: each stacked abstract leaf of a layers dict
  becomes L leaves without the leading axis, sharded as the stacked one less that axis."""
  from jax.sharding import NamedSharding, PartitionSpec

  def one(s, i):
    del i
    sh = s.sharding
    if isinstance(sh, NamedSharding):
      sh = NamedSharding(sh.mesh, PartitionSpec(*tuple(sh.spec)[1:]))
    return jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=sh)

  def unstack(d):
    layers = d["layers"]
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return {**d, "layers": [jax.tree_util.tree_map(lambda s, i=i: one(s, i), layers) for i in range(n)]}

  return _layer_dicts(abstract, unstack)


def restore_train_layout(checkpointer: Checkpointer, abstract, shardings) -> tuple[int, dict, dict] | None:
  """restore_newest into abstract (the train layout, shardings its shardings), whichever layout each checkpoint was
  written in: a per-layer one is restored as such and stacked once, in one program (a transient copy)."""
  from hilore_jax.model.layers import stacked

  is_stacked = lambda meta: meta.get(LAYERS_KEY) == STACKED
  found = checkpointer.restore_newest(lambda meta: abstract if is_stacked(meta) else per_layer_abstract(abstract))
  if found is None or is_stacked(found[2]):
    return found
  step, tree, meta = found
  return step, jax.jit(lambda t: _layer_dicts(t, stacked), out_shardings=shardings)(tree), meta
