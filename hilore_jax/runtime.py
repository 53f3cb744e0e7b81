"""Process set-up in one place: the XLA flags memory figures depend on, cache directories, the compilation
cache and JAX's multi-process runtime.

XLA:CPU removes the optimization barriers that order recomputation, and its default concurrency-optimized
scheduler then hoists recomputed tensors into the forward pass, so compiled memory stops tracking the remat
policy; the sequential memory-minimizing scheduler keeps it honest. Importing hilore_jax sets the flag, so the
CLI, tests and notebooks measure memory under the same schedule.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def configure_xla_flags() -> bool:
  """Add the CPU scheduler flag to XLA_FLAGS unless set; False (with a warning) if a backend already started."""
  flags = os.environ.get("XLA_FLAGS", "")
  if CPU_SCHEDULER_FLAG.split("=")[0] in flags:
    return True
  os.environ["XLA_FLAGS"] = (flags + " " + CPU_SCHEDULER_FLAG).strip()
  bridge = sys.modules.get("jax._src.xla_bridge")
  if bridge is not None and getattr(bridge, "_backends", None):
    log.warning("a JAX backend started before hilore_jax was imported: %s is not in effect, so CPU memory "
                "figures will not track remat; import hilore_jax first", CPU_SCHEDULER_FLAG)
    return False
  return True


def cache_root() -> str:
  """hilore-jax's cache directory ($HILORE_CACHE or ~/.cache/hilore_jax)."""
  return os.environ.get("HILORE_CACHE", os.path.expanduser("~/.cache/hilore_jax"))


def cache_dir(name: str) -> str:
  """A named subdirectory of the cache root (profiles, xla, tokenizers)."""
  return os.path.join(cache_root(), name)


def enable_compilation_cache(directory: str | None = None):
  """JAX's on-disk compilation cache, so a restarted run reuses compiled steps."""
  import jax

  jax.config.update("jax_compilation_cache_dir", directory or cache_dir("xla"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None):
  """jax.distributed.initialize: arguments left None are read from the cluster environment (SLURM, TPU, ...)."""
  import jax

  jax.distributed.initialize(coordinator_address, num_processes, process_id)
