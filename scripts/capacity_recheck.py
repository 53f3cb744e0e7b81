"""Recompile a capacity grid's boundary points at this checkout and compare their bytes with its cache: for each row
of DIR/<shape>/pieces/<devices>-<attention>-*.json of the given methods, the longest completion that fits and the next
grid step. Prints one JSON line per point (old and new device bytes, and whether each fits the row's budget), so a
commit that may move the step's bytes (a kernel, a plan) shows which rows still stand.

  python scripts/capacity_recheck.py runs/capacity_grid --shapes smollm2-135m,qwen2.5-0.5b --methods gc,hilore@1.0 \
    --attention blockwise"""

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout it runs from, as `python -m` would

from hilore_jax.capacity import measure as C  # noqa: E402
from hilore_jax.capacity import run as capacity_run  # noqa: E402

GiB = 2**30


def boundary_rows(root: str, shape: str, devices: int, attention: str, methods: set[str]) -> list[dict]:
  """The pieces' rows of these methods ('gc', 'hilore@1.0'), one per (method, ratio, budget)."""
  rows, seen = [], set()
  for path in sorted(glob.glob(os.path.join(root, shape, "pieces", f"{devices}-{attention}-*.json"))):
    with open(path) as f:
      for r in json.load(f)["rows"]:
        name = r["method"] if r["budget_ratio"] is None else f"{r['method']}@{r['budget_ratio']}"
        key = (name, r["budget_gib"])
        if name in methods and key not in seen:
          seen.add(key)
          rows.append(r)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("root")
  ap.add_argument("--shapes", required=True)
  ap.add_argument("--methods", default="gc")
  ap.add_argument("--attention", default="blockwise")
  ap.add_argument("--devices", type=int, default=1)
  args = ap.parse_args()
  measurer = C.Measurer(C.Settings())
  for shape in args.shapes.split(","):
    with open(os.path.join(args.root, shape, "capacity_cache.json")) as f:
      cache = json.load(f)["points"]
    mcfg = C.load_shape(shape, measurer.settings).replace(attention=args.attention)
    for r in boundary_rows(args.root, shape, args.devices, args.attention, set(args.methods.split(","))):
      longest = r["longest_completion"]
      for t in (longest, longest + measurer.settings.grid):
        key = (f"{capacity_run.point_key(shape, r['method'], r['budget_ratio'], args.attention, args.devices)}"
               f"|T={t}")
        if t <= 0 or key not in cache:  # nothing fits, or the cap (no point past it was compiled)
          continue
        t0 = time.perf_counter()
        new = measurer.measure(mcfg, r["method"], r["budget_ratio"], args.devices, t)["device_bytes"]
        old, budget = cache[key]["device_bytes"], r["budget_gib"] * GiB
        print(json.dumps({"point": key, "budget_gib": r["budget_gib"], "old_bytes": old, "new_bytes": new,
                          "ratio": new / old, "fits_old": old <= budget, "fits_new": new <= budget,
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
  main()
