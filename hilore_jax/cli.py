"""What every entry point shares: the config from a YAML file plus dotted overrides, logging, and one-line
messages for expected errors (a HiloreError never ends in a traceback)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

import yaml

from hilore_jax import config as config_lib
from hilore_jax.errors import ConfigError, HiloreError


def load_config(path: str | None, overrides: list[str] = ()) -> config_lib.Config:
  """YAML file (may be None) + dotted overrides -> validated Config."""
  d = {}
  if path:
    if not os.path.isfile(path):
      raise ConfigError(f"--config {path}: no such file")
    try:
      with open(path) as f:
        d = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
      raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(d, dict):
      raise ConfigError(f"{path}: the top level must be a mapping")
  return config_lib.from_dict(d, overrides)


def setup_logging(level: int = logging.INFO):
  logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "orbax", "matplotlib"):  # orbax logs every save step at INFO through absl
    logging.getLogger(noisy).setLevel(logging.WARNING)


def run(main: Callable[[], object]):
  """Run an entry point's body; an expected error exits with '<kind>: <message>' on one line."""
  try:
    return main()
  except HiloreError as e:
    sys.exit(f"{e.kind}: {e}")
