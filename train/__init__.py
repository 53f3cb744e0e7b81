"""Thin entry points. On CPU, XLA's default scheduler undoes remat, so memory figures need it off."""

import os

_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
