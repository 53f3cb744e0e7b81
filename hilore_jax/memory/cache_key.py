"""Where a run's memory set-up is cached between runs (memory.cache): the key of everything that decides what set-up
measures and fits, and the store under it (memory/store.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import jax

from hilore_jax import runtime
from hilore_jax.memory import store as stores

if TYPE_CHECKING:
  from hilore_jax.config import Config

# config sections that change nothing the memory manager measures or fits at set-up
NOT_IN_KEY = ("out_dir", "logging", "eval", "checkpoint")


def key_parts(c: Config) -> dict:
  """What the key hashes: the config (less output, logging, evaluation and checkpoint settings, and the step count
  unless the risk is the optimizer update's), the model's files, the library's code, JAX's version, its devices and
  XLA flags."""
  d = {k: v for k, v in c.to_dict().items() if k not in NOT_IN_KEY}
  d["train"] = {k: v for k, v in d["train"].items() if k not in ("resume", "steps") or
                (k == "steps" and c.memory.risk_metric == "update")}
  # how the run starts and checks the plans does not change what set-up measures
  d["memory"] = {k: v for k, v in d["memory"].items() if k not in ("cache", "warmup", "verify_steps")}
  model_dir = c.model.path
  if model_dir:
    d["model_files"] = stores.files_digest([os.path.join(model_dir, f) for f in os.listdir(model_dir)
                                            if os.path.isfile(os.path.join(model_dir, f))])
    d["model"] = {k: v for k, v in d["model"].items() if k != "path"}  # the files say which model it is
  # the whole package: a change in memory/ or model/ may measure other errors or compile other peaks
  d["code"] = stores.source_digest(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  devs = jax.devices()
  d["jax"] = [jax.__version__, devs[0].platform, devs[0].device_kind, len(devs), jax.process_count(),
              os.environ.get("XLA_FLAGS", "")]
  return d


def run_store(c: Config) -> stores.JsonStore | None:
  """The store of this recipe's memory set-up (None with memory.cache off), keyed by key_parts."""
  if not c.memory.cache:
    return None
  return stores.JsonStore(runtime.cache_dir("memory"), stores.digest(key_parts(c)))
