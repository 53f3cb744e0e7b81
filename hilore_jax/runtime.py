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
import threading
import time

log = logging.getLogger(__name__)
STARTED_AT = time.time()  # when hilore_jax was first imported: a run's clock for "how long until the first step"

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
# XLA:CPU aborts a collective whose participants have not all arrived within 40 s: N forced CPU devices (or CPU
# processes) on a machine busy with other work can take that long, so collectives get ten minutes
CPU_COLLECTIVE_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=600",
                        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
                        "--xla_cpu_collective_timeout_seconds=600")


def configure_xla_flags(extra: tuple[str, ...] = ()) -> bool:
  """Add the CPU scheduler and collective-timeout flags, and `extra`, to XLA_FLAGS (each unless set); False (with a
  warning) if a backend already started, so they cannot take effect."""
  flags = os.environ.get("XLA_FLAGS", "")
  missing = [f for f in (CPU_SCHEDULER_FLAG, *CPU_COLLECTIVE_FLAGS, *extra) if f.split("=")[0] not in flags]
  if not missing:
    return True
  os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
  bridge = sys.modules.get("jax._src.xla_bridge")
  if bridge is not None and getattr(bridge, "_backends", None):
    log.warning("a JAX backend started before hilore_jax was imported: %s are not in effect, so CPU memory "
                "figures will not track remat; import hilore_jax first", " ".join(missing))
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


class CompileStats:
  """Every XLA compile of the process as JAX reports it (jax.monitoring): backend compiles and their seconds, and
  persistent-cache hits, whoever compiled (train steps, probes, the sampler, log-prob passes, the scorer)."""

  _BACKEND = "/jax/core/compile/backend_compile_duration"
  _HIT = "/jax/compilation_cache/cache_hits"
  _REQUEST = "/jax/compilation_cache/compile_requests_use_cache"

  def __init__(self):
    self.backend_count, self.backend_s, self.cache_hits, self.cache_requests = 0, 0.0, 0, 0
    self._lock = threading.Lock()

  def install(self) -> "CompileStats":
    import jax

    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def _on_duration(self, event: str, seconds: float, **_):
    if event == self._BACKEND:
      with self._lock:
        self.backend_count += 1
        self.backend_s += seconds

  def _on_event(self, event: str, **_):
    with self._lock:
      if event == self._HIT:
        self.cache_hits += 1
      elif event == self._REQUEST:
        self.cache_requests += 1

  @property
  def compiled(self) -> int:
    """Programs XLA compiled (JAX reports a program loaded from the persistent cache as a backend compile too)."""
    return self.backend_count - self.cache_hits

  def metrics(self) -> dict:
    """compile/* metrics so far: programs XLA compiled, the seconds of every compile or cache load, and programs
    served by the persistent cache."""
    return {"compile/xla_count": self.compiled, "compile/xla_s": self.backend_s, "compile/cache_hits": self.cache_hits}


def host_memory_mib() -> dict:
  """This process's resident memory now and at its peak, in MiB (Linux /proc; elsewhere the peak from getrusage)."""
  out = {}
  try:
    with open("/proc/self/status") as f:
      for line in f:
        key = {"VmRSS:": "memory/host_rss_mib", "VmHWM:": "memory/host_peak_mib"}.get(line.split(":")[0] + ":")
        if key:
          out[key] = int(line.split()[1]) / 1024.0
  except OSError:
    import resource

    out["memory/host_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
  return out


def release_host_memory():
  """Hand the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing): XLA:CPU's temporaries
  (the sampler's stacked weights, a checkpoint's host copies) are freed but stay resident in malloc's arenas, and
  they would count towards the next phase's peak."""
  global _libc
  if _libc is None:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
      _libc = ctypes.CDLL(name) if name else False
      _libc = _libc if _libc and hasattr(_libc, "malloc_trim") else False
    except OSError:
      _libc = False
  if _libc:
    _libc.malloc_trim(0)


_libc = None
_compile_stats: CompileStats | None = None


def compile_stats() -> CompileStats:
  """The process's CompileStats, installed on first use (JAX's listeners cannot be removed one by one)."""
  global _compile_stats
  if _compile_stats is None:
    _compile_stats = CompileStats().install()
  return _compile_stats


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None):
  """jax.distributed.initialize: arguments left None are read from the cluster environment (SLURM, TPU, ...)."""
  import jax

  jax.distributed.initialize(coordinator_address, num_processes, process_id)
