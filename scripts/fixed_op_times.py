"""Run an entry point with the memory manager's op profile fixed at 1 ms an op (free codecs), so its plans do not
depend on how fast this machine runs the ops: for comparing plans between commits.

  python scripts/fixed_op_times.py experiments.bench.main --config configs/bench_cpu.yaml --out DIR bench.reps=1 ..."""

import os
import runpy
import sys

sys.path.insert(0, os.getcwd())  # the checkout it runs from, as `python -m` would

from hilore_jax.memory import profile  # noqa: E402
from hilore_jax.model import decoder  # noqa: E402

TIMES = {"ops": {op: 1e-3 for op in decoder.OPS}, "codec": {}, "offload": {}}
profile.profile_ops = lambda *a, **k: TIMES
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
