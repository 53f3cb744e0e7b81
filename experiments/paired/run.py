"""Two settings of one run, timed on the same rollouts: the update (and, optionally, the sampler's layout) of arm B
against arm A, paired per rollout and repetition, with bootstrap CIs of the ratio B / A.

The arms are the config plus each arm's overrides (e.g. `train.share_prompt=false` against `true`, a token budget
against rows padded to the cap). Both arms start every update from the same state (a copy of the same parameters
and optimizer state), see the same rollouts (sampled once, by arm A's policy at its start) and build the same
minibatches (the update's shuffle is keyed by the rollout's index); each arm's first update of every rollout
compiles (another mix of lengths may need another shape) and is not timed (`timed_compiles` counts any left); the
order of the arms alternates between repetitions so that a drift of the machine's speed falls on both. With
`floor`, a third arm is arm A compiled a second time (its own trainer): A again / A is the noise floor, what two
compilations of one setting differ by, against which B / A is read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import cli
from hilore_jax import stats
from hilore_jax.rl import rollout

log = logging.getLogger(__name__)
# what each arm's first (compiling) update did: its work, and a planned method's plan (units kept H and L, whether
# the guard or a fallback ran GC's program instead)
COUNTS = ("rows_updated", "tokens/computed", "tokens/real", "tokens/fill", "tokens/unshared",
          "budget/microbatches", "budget/packed_frac", "compile/count", "alloc/frac_H", "alloc/frac_L",
          "alloc/frac_R", "memory/compiled_bytes")


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  overrides: tuple[str, ...]


def _copy(tree):
  return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def _trainer(config_path: str | None, overrides: list[str], out_dir: str):
  from hilore_jax.loop.trainer import Trainer

  cfg = cli.load_config(config_path, [*overrides, f"out_dir={out_dir}", "logging.progress=false",
                                      "logging.plot=false"])
  t = Trainer(cfg)
  if cfg.grpo.beta > 0 and not cfg.lora.enabled:  # a LoRA run's reference is its own frozen base
    t.ref_params = _copy(t.state["params"])
  return t


def _timed_sampler(t, examples, G: int, key, shared: bool) -> float:
  """Seconds of one rollout of examples, each prompt prefilled once (shared) or once per row (np.repeat)."""
  c = t.config
  if not shared:
    examples, G = [e for e in examples for _ in range(G)], 1
  t0 = time.perf_counter()
  rollout.sample_completions(t.model_cfg, t.state["params"], t.prompter, examples, G, c.rollout.max_prompt_len,
                             c.rollout.sampling(), key, t.task.reward)
  return time.perf_counter() - t0


def run(config_path: str | None, base: list[str], a: Arm, b: Arm, rollouts: int, reps: int, out_dir: str,
        sampler: bool = False, floor: bool = False) -> dict:
  """The paired figures of arm b against arm a (see the module's docstring); written to out_dir/paired.json."""
  os.makedirs(out_dir, exist_ok=True)
  again = Arm(f"{a.name}_again", a.overrides) if floor else None
  timed = (a, b) if again is None else (a, b, again)
  arms = {arm.name: _trainer(config_path, [*base, *arm.overrides], os.path.join(out_dir, arm.name))
          for arm in timed}
  ta = arms[a.name]
  start = _copy(ta.state)
  for arm in timed[1:]:
    arms[arm.name].state, arms[arm.name].ref_params = _copy(start), ta.ref_params
  rolls = []
  for r in range(rollouts):
    t0 = time.perf_counter()
    rolls.append(ta.next_rollout())
    lens = rolls[-1].mask.sum(1)
    log.info("rollout %d: %.1f s, completion length p50 %d max %d", r, time.perf_counter() - t0,
             np.median(lens), lens.max())
  out: dict = {"config": config_path, "base": base, "a": dataclasses.asdict(a), "b": dataclasses.asdict(b),
               "rollouts": rollouts, "reps": reps, "update_s": {arm.name: [] for arm in timed}, "rows": {},
               # the regime the times are of: each rollout's completion lengths (a token budget pays below the cap)
               "completion_len": [lengths(r.mask) for r in rolls]}
  compiles = {}
  for arm in timed:  # compile (not timed): every rollout, since another mix of lengths may need another shape
    t = arms[arm.name]
    for r, roll in enumerate(rolls):
      t.state = _copy(start)
      row = t.update(roll, r)
      if r == 0 and not row["updates"]:
        raise ValueError(f"arm {arm.name} made no update on rollout 0 (every group's rewards equal and "
                         "grpo.filter_zero_std on?): there is nothing to time")
      if r == 0:
        out["rows"][arm.name] = {k: v for k, v in row.items() if k in COUNTS}
    compiles[arm.name] = t.stepper.compile_count
  for rep in range(reps):
    order = timed if rep % 2 == 0 else timed[::-1]
    for r, roll in enumerate(rolls):
      for arm in order:
        t = arms[arm.name]
        t.state = _copy(start)
        row = t.update(roll, r)
        out["update_s"][arm.name].append(row["time/update_s"])
        log.info("rep %d rollout %d %s: update %.2f s", rep, r, arm.name, row["time/update_s"])
  # a program compiled inside a timed update would count its compile as update time
  out["timed_compiles"] = {n: arms[n].stepper.compile_count - c for n, c in compiles.items()}
  if any(out["timed_compiles"].values()):
    log.warning("programs compiled during timed updates: %s", out["timed_compiles"])
  ratio = np.asarray(out["update_s"][b.name]) / np.asarray(out["update_s"][a.name])
  out["update_ratio"] = {**stats.summary(ratio), "median_a_s": float(np.median(out["update_s"][a.name])),
                         "median_b_s": float(np.median(out["update_s"][b.name]))}
  if again is not None:
    out["floor_ratio"] = stats.summary(np.asarray(out["update_s"][again.name]) / np.asarray(out["update_s"][a.name]))
  if sampler:  # the sampler's layout: each group's prompt prefilled once against once per row, same keys
    examples = ta.task.train_batch(0, ta.config.rollout.num_prompts)
    G = ta.config.rollout.num_generations
    times = {"repeated": [], "shared": []}
    for shared in (False, True):  # compile
      _timed_sampler(ta, examples, G, jax.random.PRNGKey(0), shared)
    for rep in range(max(reps, 2) * rollouts):
      for shared in ((False, True) if rep % 2 == 0 else (True, False)):
        key = jax.random.PRNGKey(rep + 1)
        times["shared" if shared else "repeated"].append(_timed_sampler(ta, examples, G, key, shared))
    out["sampler_s"] = times
    out["sampler_ratio"] = stats.summary(np.asarray(times["shared"]) / np.asarray(times["repeated"]))
  with open(os.path.join(out_dir, "paired.json"), "w") as f:
    json.dump(out, f, indent=2)
  return out


def lengths(mask_BN) -> dict:
  """p50 / p90 / max completion tokens of a rollout and its cap (the mask's columns)."""
  n = np.asarray(mask_BN).sum(1)
  return {"p50": float(np.median(n)), "p90": float(np.quantile(n, 0.9)), "max": int(n.max()),
          "cap": int(np.asarray(mask_BN).shape[1])}


def table(out: dict) -> str:
  """The paired figures as text."""
  a, b = out["a"]["name"], out["b"]["name"]
  u = out["update_ratio"]
  lines = [f"update seconds, median: {a} {u['median_a_s']:.2f}, {b} {u['median_b_s']:.2f}",
           f"update {b} / {a}: {u['mean']:.3f} [{u['ci_low']:.3f}, {u['ci_high']:.3f}] (95% bootstrap CI, "
           f"n = {u['n']} pairs: {out['rollouts']} rollouts x {out['reps']} reps)"]
  for i, c in enumerate(out.get("completion_len", [])):
    lines.append(f"rollout {i}: completion length p50 {c['p50']:g}, p90 {c['p90']:g}, max {c['max']} of {c['cap']}")
  if "floor_ratio" in out:
    f = out["floor_ratio"]
    lines.append(f"noise floor, {a} compiled again / {a}: {f['mean']:.3f} [{f['ci_low']:.3f}, {f['ci_high']:.3f}]")
  for name in (a, b):
    if out["rows"].get(name):
      lines.append(f"{name}: " + ", ".join(f"{k} {v:g}" for k, v in out["rows"][name].items()))
  if "sampler_ratio" in out:
    s = out["sampler_ratio"]
    lines.append(f"sampler, prompt prefilled once per group / once per row: {s['mean']:.3f} "
                 f"[{s['ci_low']:.3f}, {s['ci_high']:.3f}] (n = {s['n']}; medians "
                 f"{np.median(out['sampler_s']['shared']):.2f} s vs {np.median(out['sampler_s']['repeated']):.2f} s)")
  return "\n".join(lines)
