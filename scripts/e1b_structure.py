"""E1b's regime from the cost model alone (no gradient, no compile): on a fresh op profile, how many of the 4
weight-read kinds' units the fastest plan (risk unbounded, memory.plan_runs runs) puts L at E1b's fitted allowance
and at multiples of it, at the unshared upper-bound shape [8 rows, 96 + 128 positions], full fine-tuning and LoRA r16.

  python scripts/e1b_structure.py docs/data/exposure_e1b_structure.json     # a minute on a quiet 2-core CPU"""
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())  # the checkout it runs from, as `python -m` would

from hilore_jax import config as C  # noqa: E402
from hilore_jax.loop import engine  # noqa: E402
from hilore_jax.memory import methods, profile  # noqa: E402

ALLOWANCE = 156489587  # E1b's fitted allowance (docs/data/exposure_e1b.json, regime.allowance_bytes)
d = C.read_yaml("configs/exposure_e1b_smollm2.yaml")
d.pop("bench_exposure")
out = {}
for name, over in (("full", []), ("lora r16", ["lora.rank=16"])):
  cfg = C.from_dict(d, over)
  m, mc = engine.model_config(cfg), cfg.memory
  for rows, seq in ((8, 224),):
    prof = profile.profile_ops(m, rows, seq, mc.group_size, cache_dir=tempfile.mkdtemp(), formats=("int8",))
    units = profile.enumerate_units(m, rows, seq, mc.group_size, prof, "int8", list(mc.lowp_kinds))
    per = {}
    for f in (1, 2, 4, 8):
      a = int(f * ALLOWANCE)
      p = methods.plan("hilore", units, prof["ops"], a, risk_of={}, delta=math.inf, max_runs=mc.plan_runs)
      per[f] = sum(c == "L" for c in p.choice)
    ops = {k: round(v * 1e3, 3) for k, v in prof["ops"].items()}
    cod = {k: round(v["int8"] * 1e3, 3) for k, v in prof["codec"].items() if k in mc.lowp_kinds}
    out[name] = {"shape": [rows, seq], "l_units_at_allowance_x": per, "ops_ms": ops, "codec_ms": cod}
    print(name, rows, seq, "L units at allowance x1,2,4,8:", per, "\n ops ms", ops, "\n codec ms", cod, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
