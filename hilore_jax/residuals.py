"""What backward keeps: parse jax.ad_checkpoint.print_saved_residuals (public in jax 0.10 and 0.11)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re

import jax


@dataclasses.dataclass(frozen=True)
class Residual:
  dtype: str  # short dtype, e.g. 'f32', 'bf16', 'i8'
  shape: tuple[int, ...]
  source: str  # e.g. "named 'mlp_gate' from ...", "from the argument p"

  @property
  def name(self) -> str | None:
    m = re.search(r"named '([^']+)'", self.source)
    return m.group(1) if m else None


def saved_residuals(fn, *args, **kwargs) -> list[Residual]:
  """Residuals that reverse-mode AD of fn(*args) keeps for the backward pass."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, *args, **kwargs)
  out = []
  for line in buf.getvalue().splitlines():
    m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line.strip())
    if m:
      shape = tuple(int(s) for s in m.group(2).split(",") if s)
      out.append(Residual(m.group(1), shape, m.group(3)))
  return out


def count_named(residuals: list[Residual], name: str) -> int:
  return sum(r.name == name for r in residuals)
