"""The exposure benchmark's optional timed side (bench_exposure.timing): every distinct plan's gradient program
timed in interleaved rounds, each arm's time its plans' sum over the held-out minibatches, paired with GC's in the
same round, and each arm's compiled peak."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from hilore_jax import model
from hilore_jax import stats


def _time_grad(step, params, batch, calls: int = 3) -> float:
  ts = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(step.grad(params, batch))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def time_plans(trainer, spec, per_arm: dict, rec, reps: int, seed: int) -> dict[str, dict]:
  """{arm: measured tokens/s, paired gain over GC with its CI, the rounds' times, the compiled peak}, every plan
  timed on one record's params and batch."""
  L = spec.model_cfg.num_hidden_layers
  gc_pols = model.uniform(L, model.FULL_REMAT)
  distinct = list(dict.fromkeys([gc_pols] + [e["policies"] for es in per_arm.values() for e in es]))
  steps = {p: trainer.stepper.get(dataclasses.replace(spec, policies=p), rec.batch, count=False) for p in distinct}
  for p in distinct:
    _time_grad(steps[p], rec.params, rec.batch, 1)  # warm
  rounds, order = [], np.random.default_rng(seed)
  for _ in range(reps):
    t = {}
    for k in order.permutation(len(distinct)):
      t[distinct[k]] = _time_grad(steps[distinct[k]], rec.params, rec.batch)
    rounds.append(t)
  b = rec.batch
  out = {}
  for a, es in per_arm.items():
    times = np.array([sum(t[e["policies"]] for e in es) for t in rounds])
    gain = stats.summary(stats.paired_gain_pct(times, np.array([t[gc_pols] * len(es) for t in rounds])))
    out[a] = {"tokens_per_s": b.rows * (b.prompt_len + b.completion_len) * len(es) / float(np.median(times)),
              "gain_vs_gc_pct": gain["mean"], "gain_ci_low": gain["ci_low"], "gain_ci_high": gain["ci_high"],
              "round_times_s": times.tolist(), "peak_bytes": int(max(steps[e["policies"]].peak_bytes for e in es))}
  return out
