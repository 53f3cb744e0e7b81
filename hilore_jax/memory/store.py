"""The memory manager's state on disk between runs: what calibration measured and which plans fitted the budget,
keyed by everything that decides them (model, weights, config, shapes, code, JAX and its backend), so a second run
of the same recipe allocates from its first step without profiling, calibrating or probe compiles."""

from __future__ import annotations

import hashlib
import json
import logging
import os

log = logging.getLogger(__name__)


def digest(parts: dict) -> str:
  """A short stable hash of a JSON-serialisable dict (key order does not matter)."""
  text = json.dumps(parts, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:20]


def files_digest(paths: list[str]) -> str:
  """A hash of files' names, sizes and modification times (a changed weight file is a new key; its bytes are not
  read, so keying a 1 GB checkpoint costs nothing)."""
  stats = []
  for p in sorted(paths):
    st = os.stat(p)
    stats.append((os.path.basename(p), st.st_size, st.st_mtime_ns))
  return digest({"files": stats})


def source_digest(package_dir: str) -> str:
  """A hash of the library's Python sources: another version of the code may compile other peaks or measure other
  errors, so its cached state is not reused."""
  h = hashlib.sha256()
  for root, dirs, files in os.walk(package_dir):
    dirs.sort()
    for f in sorted(files):
      if f.endswith(".py"):
        with open(os.path.join(root, f), "rb") as fh:
          h.update(f.encode() + fh.read())
  return h.hexdigest()[:20]


class JsonStore:
  """One JSON file per key in a directory (the manager's set-up, the op profile); writes are atomic (a kill leaves
  the old file or the new one), and an unreadable file is reported and ignored (it is a cache: it is measured
  again)."""

  def __init__(self, directory: str, key: str, what: str = "memory set-up"):
    self.directory, self.key, self.what = directory, key, what
    self.path = os.path.join(directory, f"{key}.json")

  def load(self) -> dict | None:
    if not os.path.exists(self.path):
      return None
    try:
      with open(self.path) as f:
        return json.load(f)
    except (OSError, ValueError) as e:
      log.warning("the cached %s %s is unreadable (%s): measuring again", self.what, self.path, e)
      return None

  def save(self, obj: dict):
    try:
      os.makedirs(self.directory, exist_ok=True)
      tmp = f"{self.path}.tmp{os.getpid()}"
      with open(tmp, "w") as f:
        json.dump(obj, f)
      os.replace(tmp, self.path)
    except OSError as e:  # a read-only or full cache directory costs the next run its measurement, not this run
      log.warning("could not write the cached %s %s (%s)", self.what, self.path, e)
