"""One error hierarchy: every expected failure is a HiloreError the entry points print as one line."""

from __future__ import annotations

from typing import Iterable


class HiloreError(Exception):
  """Base class; `kind` prefixes the one-line message the entry points print."""

  kind = "error"


class ConfigError(HiloreError, ValueError):
  """A config key has a wrong type, an out-of-range value, or names a missing file."""

  kind = "config error"


class DataError(HiloreError, ValueError):
  """A data line (JSONL) is malformed."""

  kind = "data error"


class CheckpointError(HiloreError):
  """A checkpoint (orbax or Hugging Face) is missing, incomplete or does not match the model."""

  kind = "checkpoint error"


class MemoryPlanError(HiloreError):
  """The memory settings cannot be honoured."""

  kind = "memory error"


class InfeasibleBudget(MemoryPlanError, ValueError):
  """The memory budget is below what recomputing every unit needs."""


class OffloadUnsupported(MemoryPlanError, RuntimeError):
  """Offloading (O) was asked for on a backend without separate host memory."""


class TrainingDiverged(HiloreError, RuntimeError):
  """A non-finite loss or gradient; the last good checkpoint is left untouched."""

  kind = "training stopped"


class RunExists(HiloreError, FileExistsError):
  """out_dir already holds another run's checkpoints."""

  kind = "refusing to start"


def check_choice(key: str, value, choices: Iterable):
  """ConfigError unless value is one of choices."""
  choices = list(choices)
  if value not in choices:
    raise ConfigError(f"{key} must be one of {choices}, got {value!r}")


def check_positive(key: str, value, allow_zero: bool = False):
  """ConfigError unless value > 0 (or >= 0)."""
  if not (value > 0 or (allow_zero and value == 0)):  # written so that NaN fails too
    raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_range(key: str, value, low=None, high=None, low_open=False, high_open=False):
  """ConfigError unless low <= value <= high (strict on an open end)."""
  # negated comparisons, so that NaN is out of every range
  bad_low = low is not None and not (value > low if low_open else value >= low)
  bad_high = high is not None and not (value < high if high_open else value <= high)
  if bad_low or bad_high:
    lo = "" if low is None else f"{'(' if low_open else '['}{low}"
    hi = "" if high is None else f"{high}{')' if high_open else ']'}"
    raise ConfigError(f"{key} must be in {lo or '(-inf'}, {hi or 'inf)'}, got {value}")
