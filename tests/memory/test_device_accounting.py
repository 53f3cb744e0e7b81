"""Per-device memory accounting on a 2 x 2 (data x fsdp) mesh of forced CPU devices."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_hilore_accounts_per_device_on_a_mesh(tmp_path):
  out = str(tmp_path / "acc.json")
  env = dict(os.environ)  # the session's HILORE_CACHE: its compiled programs
  proc = subprocess.run([sys.executable, os.path.join(HERE, "device_accounting_worker.py"), "4", "2", "2", out],
                        capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.load(open(out))
  # 12 rows over 4 batch shards: units (and so the profile) are one device's 3 rows, a quarter of the global bytes
  assert r["rows"] == 3
  assert r["unit_bytes"] * 4 == r["global_unit_bytes"]
  # the budget is per device (the GC step's per-device compiled peak), and so is the chosen step's peak
  assert r["compiled_bytes"] <= r["budget_bytes"]
  assert r["plan_bytes"] <= r["allowance"] < r["unit_bytes"]
  # the same allowance buys 4x fewer units when sized on the global batch: the per-device plan keeps more
  assert r["choice"] != r["global_choice"]
  assert r["choice"].count("H") > r["global_choice"].count("H") + 4
