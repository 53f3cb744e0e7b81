"""Forced CPU devices for multi-device tests, set before JAX's backend starts (imports nothing itself)."""

import os


def force_cpu_devices(n: int):
  """N CPU devices for this process; importing hilore_jax then adds its patient collective timeouts (runtime.py)."""
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  os.environ["JAX_CPU_ENABLE_ASYNC_DISPATCH"] = "false"  # N fake devices on 2 cores can deadlock otherwise
