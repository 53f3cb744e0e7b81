"""The memory manager per microbatch shape (the token budget): a HiLoRe plan, its byte budget and its calibration
belong to one compiled shape, so each (rows, sequence length) of the packed microbatches gets its own
`MemoryManager`. `ShapedMemory` routes a step's microbatches to them (one lookup per shape) and keeps their states
under one checkpoint entry; to the trainer it answers as one manager does."""

from __future__ import annotations

from typing import Callable

from hilore_jax.memory import MemoryManager


def shape_key(batch) -> str:
  """rows x length of a bucket's microbatch, or `packed` buffer rows x length."""
  if batch.packing is not None:
    return "packed {}x{}".format(*batch.packing.shape)
  return f"{batch.rows}x{batch.prompt_len + batch.completion_len}"


class ShapedMemory:
  """MemoryManagers by microbatch shape, made on first use by make()."""

  def __init__(self, make: Callable[[], MemoryManager]):
    self._make = make
    self.managers: dict[str, MemoryManager] = {}

  def manager(self, key: str) -> MemoryManager:
    if key not in self.managers:
      m = self._make()
      m.defer_fits = True  # a bucket met mid-step is fitted after it, not on the step's clock
      self.managers[key] = m
    return self.managers[key]

  @staticmethod
  def _groups(batches: list) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, b in enumerate(batches):
      groups.setdefault(shape_key(b), []).append(i)
    return groups

  def _route(self, batches: list, logp, call) -> list:
    out = [None] * len(batches)
    for key, idx in self._groups(batches).items():
      lp = None if logp is None else [logp[i] for i in idx]
      for i, a in zip(idx, call(self.manager(key), [batches[i] for i in idx], lp)):
        out[i] = a
    return out

  def step(self, params, batches: list, step: int, logp=None, opt_state=None) -> list:
    return self._route(batches, logp, lambda m, bs, lp: m.step(params, bs, step, lp, opt_state))

  def allocate(self, batches: list, logp=None) -> list:
    return self._route(batches, logp, lambda m, bs, lp: m.allocate(bs, lp))

  @property
  def pending_setup(self) -> bool:
    return any(m.pending_setup for m in self.managers.values())

  @property
  def pending_fits(self) -> bool:
    return any(m.pending_fits for m in self.managers.values())

  def finish_step(self, params, batches: list | None, step: int, logp=None, opt_state=None,
                  last: bool = False) -> dict[str, float]:
    """Each shape's finish_step on that shape's microbatches of the step; the seconds taken, summed per metric."""
    groups, total = self._groups(batches or []), {}
    for key, m in self.managers.items():
      idx = groups.get(key, [])
      if idx or m.pending_fits:
        took = m.finish_step(params, [batches[i] for i in idx], step,
                             None if logp is None else [logp[i] for i in idx], opt_state, last)
        for k, v in took.items():
          total[k] = total.get(k, 0.0) + v
    return total

  def observe(self, update_s_per_microbatch: float, clean: bool, grad_norms=None):
    for m in self.managers.values():
      m.observe(update_s_per_microbatch, clean, grad_norms)

  def state_json(self) -> dict:
    return {"shapes": {k: m.state_json() for k, m in self.managers.items()}}

  def load_state(self, state: dict):
    for key, st in state.get("shapes", {}).items():
      if st is not None:
        self.manager(key).load_state(st)
