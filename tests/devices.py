"""Forced CPU devices for multi-device tests, set before JAX's backend starts (imports nothing itself)."""

import os


def force_cpu_devices(n: int):
  """N CPU devices for this process; importing hilore_jax then adds its patient collective timeouts (runtime.py)."""
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  os.environ["JAX_CPU_ENABLE_ASYNC_DISPATCH"] = "false"  # N fake devices on 2 cores can deadlock otherwise


def start_worker() -> tuple[int, str, str, str]:
  """A mesh test's subprocess start (argv: devices, mesh data, mesh fsdp, output path): its devices forced before
  JAX starts, then the test session's compilation cache; returns the four arguments."""
  import sys

  n_dev, data, fsdp, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
  force_cpu_devices(n_dev)
  import jax

  from hilore_jax import runtime

  runtime.enable_compilation_cache()  # the test session's HILORE_CACHE
  assert jax.device_count() == n_dev
  return n_dev, data, fsdp, out
