"""The capacity grid's table from its pieces: every row of DIR/<shape>/pieces/*.json (scripts/capacity_grid.sh), one
per (shape, devices, attention, method, budget), in the grid's order, as train.capacity's markdown (docs/capacity.md).
Prints which pieces of the default grid are still missing, so a table made mid-grid says what it lacks.

  python scripts/capacity_table.py docs/data/capacity_grid"""

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.getcwd())  # the checkout it runs from, as `python -m` would

from hilore_jax.capacity import report  # noqa: E402
from hilore_jax.capacity.measure import with_legacy  # noqa: E402

SHAPES = ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b")  # scripts/capacity_grid.sh's order
METHODS = ("nogc", "hilore", "optimal_hr", "sac", "gc_int8")
DEVICES, ATTENTION = (1, 8), ("blockwise", "xla")


def shape_order(shape: str) -> int:
  return SHAPES.index(shape) if shape in SHAPES else len(SHAPES)


def merged(root: str) -> dict:
  """All pieces' rows (the first of duplicates: GC's series is in every piece) and the settings they share."""
  rows, seen, settings = [], set(), None
  for path in sorted(glob.glob(os.path.join(root, "*", "pieces", "*.json"))):
    with open(path) as f:
      piece = json.load(f)
    recorded = with_legacy(piece["settings"])  # a field added since a piece was written: the value it ran at
    if settings is not None and recorded != settings:
      raise ValueError(f"{path}: its settings differ from the other pieces' ({recorded} vs {settings})")
    settings = recorded
    for r in piece["rows"]:
      key = (r["shape"], r["devices"], r["attention"], r["method"], r["budget_ratio"], r["budget_gib"])
      if key not in seen:
        seen.add(key)
        rows.append(r)
  if settings is None:
    raise ValueError(f"no pieces under {root}/*/pieces/")
  rank = lambda r: (shape_order(r["shape"]), r["devices"], r["attention"], r["method"] not in ("gc", "nogc"),
                    r["method"] != "gc", r["method"], r["budget_ratio"] or 0.0, r["budget_gib"])
  return {"settings": settings, "rows": sorted(rows, key=rank)}


def missing(root: str) -> list[str]:
  """The default grid's pieces (shape x devices x attention x method) with no file yet."""
  return [f"{s} x{d} {a} {m}" for d in DEVICES for s in SHAPES for a in ATTENTION for m in METHODS
          if not os.path.exists(os.path.join(root, s, "pieces", f"{d}-{a}-{m}.json"))]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("root")
  args = ap.parse_args()
  print(report.markdown(merged(args.root)))
  left = missing(args.root)
  print(f"pieces missing ({len(left)}): " + (", ".join(left) if left else "none"))


if __name__ == "__main__":
  main()
