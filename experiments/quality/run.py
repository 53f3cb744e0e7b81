"""Paired training quality: the same seeds trained under several arms (each a set of config overrides); per arm
greedy accuracy, pass@k, completion lengths, a joint accuracy-and-token-efficiency score and reward curves, and
per-seed differences against the first arm with bootstrap confidence intervals.

Joint score of arm a on seed s: J = accuracy(a, s) * L(base, s) / L(a, s), with L the mean greedy completion length
(tokens, stop token included) on the evaluation problems: accuracy per completion token, in units of the base arm's
tokens on the same seed. J equals the accuracy for the base arm; an arm that is as accurate with 10% fewer tokens
scores 1.11x its accuracy, and one that is 10% more accurate with 10% more tokens scores the base's accuracy.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from hilore_jax import config as config_lib
from hilore_jax.loop import metrics
from hilore_jax.stats import summary
from hilore_jax.config import Config
from hilore_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Arm:
  """A named variant of the run: dotted overrides on top of the config."""

  name: str
  overrides: tuple[str, ...]

  @classmethod
  def parse(cls, text: str) -> "Arm":
    """'name:key=value,key=value' (no overrides: 'name:')."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
      raise ConfigError(f"--arm {text!r} must look like name:key.path=value,key.path=value")
    return cls(name, tuple(o for o in rest.split(",") if o))


DEFAULT_ARMS = (Arm("gc", ("memory.policy=gc",)), Arm("hilore", ("memory.policy=hilore",)))


def arm_config(cfg: Config, arm: Arm, seed: int, run_dir: str) -> Config:
  """The arm's config for one seed (evaluation before and after, no HF export)."""
  overrides = [*arm.overrides, f"seed={seed}", f"out_dir={run_dir}", "eval.at_start=true", "eval.at_end=true",
               "checkpoint.export_hf=false"]
  return config_lib.from_dict(cfg.to_dict(), overrides)


def _read(run_dir: str, pass_k: int, tail: int) -> dict:
  with open(os.path.join(run_dir, "summary.json")) as f:
    s = json.load(f)
  rows = metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
  lens = [r["completion_len/mean"] for r in rows[-tail:]]
  return {"accuracy": s["eval_after"]["eval/accuracy"], "accuracy_before": s["eval_before"]["eval/accuracy"],
          "pass_k": s["eval_after"].get(f"eval/pass@{pass_k}"), "completion_len": float(np.mean(lens)),
          # runs evaluated before eval/completion_len existed: the sampled length of the last training steps
          "greedy_len": s["eval_after"].get("eval/completion_len", float(np.mean(lens))),
          "rewards": [r["reward/mean"] for r in rows]}


def joint_scores(runs: dict[str, list[dict]], base: str) -> dict[str, list[float]]:
  """Per arm and seed, accuracy * L(base) / L(arm) with L the mean greedy completion length (module docstring)."""
  return {name: [r["accuracy"] * b["greedy_len"] / max(r["greedy_len"], 1e-9) for r, b in zip(rs, runs[base])]
          for name, rs in runs.items()}


def run(cfg: Config, seeds: int, out_dir: str, arms=DEFAULT_ARMS, progress=print) -> dict:
  """Train every (seed, arm) pair (a finished pair in out_dir is reused) and write quality.json/.md/.png."""
  from hilore_jax.loop.trainer import Trainer

  os.makedirs(out_dir, exist_ok=True)
  runs: dict[str, list[dict]] = {a.name: [] for a in arms}
  tail = max(1, cfg.train.steps // 10)
  for s in range(seeds):
    for arm in arms:
      run_dir = os.path.join(out_dir, f"{arm.name}_seed{s}")
      if not os.path.exists(os.path.join(run_dir, "summary.json")):
        progress(f"quality: training {arm.name} with seed {cfg.seed + s}")
        Trainer(arm_config(cfg, arm, cfg.seed + s, run_dir)).train()
      runs[arm.name].append(_read(run_dir, cfg.eval.pass_k, tail))
  base = arms[0].name
  result = {"arms": [dataclasses.asdict(a) for a in arms], "seeds": seeds, "base": base, "per_arm": {}, "paired": {}}
  joint = joint_scores(runs, base)
  for arm in arms:
    r = runs[arm.name]
    for x, j in zip(r, joint[arm.name]):
      x["joint"] = j
    result["per_arm"][arm.name] = {k: summary([x[k] for x in r]) for k in
                                   ("accuracy", "pass_k", "completion_len", "greedy_len", "joint")
                                   if r[0][k] is not None}
    result["per_arm"][arm.name]["per_seed_accuracy"] = [x["accuracy"] for x in r]
    result["per_arm"][arm.name]["per_seed_joint"] = joint[arm.name]
    if arm.name != base:
      result["paired"][arm.name] = {f"{k}_pp": summary([100 * (a[k] - b[k]) for a, b in zip(r, runs[base])])
                                    for k in ("accuracy", "pass_k", "joint") if r[0][k] is not None}
  with open(os.path.join(out_dir, "quality.json"), "w") as f:
    json.dump(result, f, indent=2)
  with open(os.path.join(out_dir, "quality.md"), "w") as f:
    f.write(report(result, cfg.eval.pass_k) + "\n")
  plot(runs, os.path.join(out_dir, "quality.png"))
  return result


def report(result: dict, pass_k: int) -> str:
  """The quality table: per arm means with 95% CIs, and paired differences against the base arm."""
  base, n = result["base"], result["seeds"]
  lines = [f"# Paired training quality, {n} seeds (base: {base})", "",
           f"| arm | greedy accuracy | pass@{pass_k} | completion length | greedy length | joint score | "
           f"accuracy vs {base} (pp) | pass@{pass_k} vs {base} (pp) | joint vs {base} (pp) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  ci = lambda s, scale=100, unit="%": (f"{scale * s['mean']:.1f}{unit} [{scale * s['ci_low']:.1f}, "
                                      f"{scale * s['ci_high']:.1f}]")
  for name, s in result["per_arm"].items():
    d = result["paired"].get(name) or {}
    diffs = [ci(d[k], 1, "") if k in d else "—" for k in ("accuracy_pp", "pass_k_pp", "joint_pp")]
    pk = ci(s["pass_k"]) if "pass_k" in s else "—"
    greedy = f"{s['greedy_len']['mean']:.2f}" if "greedy_len" in s else "—"
    joint = ci(s["joint"]) if "joint" in s else "—"
    lines.append(f"| {name} | {ci(s['accuracy'])} | {pk} | {s['completion_len']['mean']:.2f} | {greedy} | {joint} | "
                 + " | ".join(diffs) + " |")
  lines += ["", "Brackets: 95% bootstrap confidence intervals over seeds (of the mean, or of the mean paired "
            "difference). Completion length: sampled (T=1) tokens per completion over the last 10% of training "
            "steps; greedy length: tokens per greedy completion on the evaluation problems. Joint score: greedy "
            f"accuracy x (base's greedy length / arm's greedy length), paired per seed; equal to the accuracy for "
            f"{base}."]
  return "\n".join(lines)


def plot(runs: dict, path: str):
  with metrics.figure(path, (7, 4)) as (fig, ax):
    for i, (name, rs) in enumerate(runs.items()):
      curves = np.array([r["rewards"] for r in rs])
      steps = np.arange(1, curves.shape[1] + 1)
      ax.plot(steps, curves.mean(0), color=f"C{i}", label=f"{name} (mean of {len(curves)} seeds)")
      ax.fill_between(steps, curves.min(0), curves.max(0), color=f"C{i}", alpha=0.15)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.legend()
    ax.grid(alpha=0.3)
