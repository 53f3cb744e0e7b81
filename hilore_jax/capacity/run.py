"""The capacity grid: for every shape, attention kernel, device count, method and budget ratio, the longest completion
whose whole step fits each per-device budget (search.py over measure.py's compiled points), and the
growth of the step's bytes with the tokens per row. Every point is cached in DIR, so an interrupted or widened run
compiles only what is new; capacity.json, capacity.md and capacity.png are rewritten after every series."""

from __future__ import annotations

import json
import os

from hilore_jax.capacity import measure as C
from hilore_jax.capacity import report
from hilore_jax.capacity import search
from hilore_jax.errors import ConfigError

GiB = 2**30
GROWTH_TOKENS = (1024, 2048, 4096)  # total tokens per row (prompt included)


def point_key(shape: str, method: str, ratio, attention: str, devices: int) -> str:
  return f"{shape}|{method}|{ratio}|{attention}|{devices}"


def series(methods: list[str]) -> list[tuple[str, float | None]]:
  """(method, ratio) of every method's budget ratios, in the order asked."""
  out = []
  for m in methods:
    if m not in C.METHODS:
      raise ConfigError(f"unknown method {m!r}; choose from {', '.join(C.METHODS)}")
    out += [(m, r) for r in C.METHODS[m][1]]
  return out


class Grid:
  """The measurer and the point cache of one output directory."""

  def __init__(self, out_dir: str, settings: C.Settings = C.Settings(), progress=print, measurer=None):
    os.makedirs(out_dir, exist_ok=True)
    self.out_dir, self.settings, self.progress = out_dir, settings, progress
    self.measurer = measurer or C.Measurer(settings)
    self.cache = search.PointCache(os.path.join(out_dir, "capacity_cache.json"), settings.programs(),
                                   C.with_legacy)
    self.compiled = 0

  def point(self, shape: str, method: str, ratio, attention: str, devices: int, completion: int) -> dict:
    """A cached point, or one compiled now (and cached)."""
    key = f"{point_key(shape, method, ratio, attention, devices)}|T={completion}"
    rec = self.cache.get(key)
    if rec is None:
      mcfg = C.load_shape(shape, self.settings).replace(attention=attention)
      rec = self.measurer.measure(mcfg, method, ratio, devices, completion)
      self.cache.put(key, rec)
      self.compiled += 1
      self.progress(f"  {key}: device {rec['device_bytes'] / GiB:.2f} GiB, peak {rec['peak_bytes'] / GiB:.2f} GiB "
                    f"({rec['seconds']:.0f}s)")
    return rec

  def cap(self, shape: str) -> int:
    """The search's cap: --max-completion, else the shape's context less the prompt."""
    if self.settings.max_completion:
      return self.settings.max_completion
    return C.load_shape(shape, self.settings).max_position_embeddings - self.settings.prompt_len

  def longest(self, shape, method, ratio, attention, devices, budget_gib: float, start: int = 0) -> dict:
    """The series' longest completion within budget_gib; start: where to look first (default 1024 tokens per row)."""
    prefix = point_key(shape, method, ratio, attention, devices)
    s = self.settings
    start = start or 1024 - s.prompt_len
    found = search.longest(
        lambda t: self.point(shape, method, ratio, attention, devices, t)["device_bytes"], int(budget_gib * GiB),
        s.grid, self.cap(shape), max(s.grid, start // s.grid * s.grid), self.cache.series(prefix, "device_bytes"))
    return {"shape": shape, "method": method, "budget_ratio": ratio, "attention": attention, "devices": devices,
            "budget_gib": budget_gib, "longest_completion": found.longest, "capped": found.capped,
            "points_compiled": found.compiled}

  def growth(self, shape, method, ratio, attention, tokens=GROWTH_TOKENS) -> dict:
    recs = {t: self.point(shape, method, ratio, attention, 1, t - self.settings.prompt_len) for t in tokens}
    return {"shape": shape, "method": method, "budget_ratio": ratio, "attention": attention, "devices": 1,
            "rows": self.settings.rows, "prompt_len": self.settings.prompt_len,
            "peak_bytes": {str(t): r["peak_bytes"] for t, r in recs.items()},
            "device_bytes": {str(t): r["device_bytes"] for t, r in recs.items()}}


def run(out_dir: str, shapes: list[str], methods: list[str], budgets_gib: list[float], devices: list[int],
        attention: list[str], growth_methods: list[str], settings: C.Settings = C.Settings(), progress=print,
        measurer=None, growth_tokens=GROWTH_TOKENS) -> dict:
  """The growth rows (their points seed the one-device searches), then the grid; capacity.json/md/png after each."""
  grid = Grid(out_dir, settings, progress, measurer)
  result = {"settings": dict(vars(settings)), "rows": [], "growth": []}
  for sh in shapes:
    for a in attention:
      for m, r in series(growth_methods):
        progress(f"growth {sh} {m}@{r} {a}: {', '.join(map(str, growth_tokens))} tokens per row")
        result["growth"].append(grid.growth(sh, m, r, a, growth_tokens))
        write(out_dir, result)
  # GC first: a budgeted method spends at most ratio x GC's peak, so its search starts at GC's longest
  ordered = sorted(series(methods), key=lambda mr: mr[0] != "gc")
  plan = [(sh, m, r, a, d) for sh in shapes for a in attention for d in devices for m, r in ordered]
  gc_longest: dict[tuple, int] = {}
  for i, (sh, m, r, a, d) in enumerate(plan):
    progress(f"[{i + 1}/{len(plan)}] {sh} {m}@{r} {a} x{d} devices")
    for b in sorted(budgets_gib):
      row = grid.longest(sh, m, r, a, d, b, start=gc_longest.get((sh, a, d, b), 0) if r is not None else 0)
      if m == "gc":
        gc_longest[sh, a, d, b] = row["longest_completion"]
      result["rows"].append(row)
      progress(f"  {b:g} GiB: longest completion {row['longest_completion']}" + (" (the cap)" if row["capped"] else "")
               + f", {row['points_compiled']} new points")
    write(out_dir, result)
  progress(f"{grid.compiled} points compiled, {len(grid.cache.points)} cached in {out_dir}")
  return result


def write(out_dir: str, result: dict):
  """capacity.json, capacity.md and capacity.png (atomically: an interrupted run keeps the last)."""
  for name, text in (("capacity.json", json.dumps(result, indent=1)), ("capacity.md", report.markdown(result))):
    tmp = os.path.join(out_dir, f".{name}.tmp")
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, os.path.join(out_dir, name))
  report.plot(result, os.path.join(out_dir, "capacity.png"))
