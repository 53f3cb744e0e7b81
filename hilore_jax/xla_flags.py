"""The one place that sets XLA flags the memory figures depend on, before any JAX backend starts.

XLA:CPU removes the optimization barriers that order recomputation, and its default concurrency-optimized
scheduler then hoists recomputed tensors into the forward pass, so compiled memory stops tracking the remat
policy. The sequential memory-minimizing scheduler keeps it honest. Importing hilore_jax sets the flag, so the
CLI, tests and notebooks measure memory under the same schedule.
"""

from __future__ import annotations

import logging
import os
import sys

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def configure() -> bool:
  """Add the CPU scheduler flag to XLA_FLAGS unless set; False (with a warning) if a backend already started."""
  flags = os.environ.get("XLA_FLAGS", "")
  if CPU_SCHEDULER_FLAG.split("=")[0] in flags:
    return True
  os.environ["XLA_FLAGS"] = (flags + " " + CPU_SCHEDULER_FLAG).strip()
  bridge = sys.modules.get("jax._src.xla_bridge")
  if bridge is not None and getattr(bridge, "_backends", None):
    logging.getLogger(__name__).warning(
        "a JAX backend started before hilore_jax was imported: %s is not in effect, so CPU memory figures will "
        "not track remat; import hilore_jax first", CPU_SCHEDULER_FLAG)
    return False
  return True
