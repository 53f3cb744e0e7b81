"""What every entry point shares: its argument parser (--config, dotted overrides, the entry's own flags), the
config from a YAML file plus overrides, logging, and one-line messages for expected errors (a HiloreError never ends
in a traceback)."""

from __future__ import annotations

import argparse
import os
import logging
import sys
from typing import Any, Callable, Sequence

from hilore_jax import config as config_lib
from hilore_jax.errors import ConfigError, HiloreError


def load_config(path: str | None, overrides: list[str] = ()) -> config_lib.Config:
  """YAML file (may be None) + dotted overrides -> validated Config."""
  return config_lib.load(path, overrides)


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


Arg = tuple[tuple, dict]  # (positional, keyword) arguments of one ArgumentParser.add_argument call


def arg(*names, **kw) -> Arg:
  """One command-line argument of an entry point, as ArgumentParser.add_argument takes it."""
  return names, kw


def main(description: str, body: Callable[[argparse.Namespace], Any], argv: Sequence[str] | None = None, *,
         args: Sequence[Arg] = (), config: bool = True, level: int = logging.WARNING):
  """An entry point: parse `--config FILE` and dotted overrides (when `config`) and `args`, set up logging, run
  body(namespace) with one-line errors."""
  ap = argparse.ArgumentParser(description=description)
  if config:
    ap.add_argument("--config", help="YAML config file")
  for names, kw in args:
    ap.add_argument(*names, **kw)
  if config:
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 out_dir=/tmp/run")
  ns = ap.parse_args(argv)
  setup_logging(level)
  return run(lambda: body(ns))


def int_list(flag: str, text: str) -> list[int]:
  """'4,8,16' -> [4, 8, 16]; ConfigError naming the flag otherwise."""
  try:
    return [int(x) for x in text.split(",")]
  except ValueError:
    raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None


def progress(line: str):
  """A benchmark's progress line, printed as it happens (not held back by output buffering)."""
  print(line, flush=True)


def print_files(directory: str, *names: str):
  """Print report files a command wrote (its markdown tables), one after another."""
  for name in names:
    with open(os.path.join(directory, name)) as f:
      print(f.read())
