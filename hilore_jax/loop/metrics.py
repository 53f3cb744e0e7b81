"""Per-step metrics: JSON lines, optional TensorBoard, and the reward curve."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os

import numpy as np

from hilore_jax.errors import DataError

log = logging.getLogger(__name__)

UPDATE_KEYS = ("loss", "grad_norm", "clipfrac", "kl", "entropy", "abs_log_ratio")
# reported only by updates that run the predicted-KL step control (optimizer.kl_control.target > 0)
KL_CONTROL_KEYS = ("kl_control/predicted", "kl_control/scale", "kl_control/realized")


def reduce_updates(rows: list[dict]) -> dict:
  """One step's optimizer updates -> the step's row: means of the per-update metrics (zeros if none ran); the
  KL control's, when the updates report them, also per update in order (`<key>_per_update`, for kl_report)."""
  out = {k: float(np.mean([r[k] for r in rows])) if rows else 0.0 for k in UPDATE_KEYS}
  for k in KL_CONTROL_KEYS:
    if rows and k in rows[0]:
      out[k] = float(np.mean([r[k] for r in rows]))
      out[f"{k}_per_update"] = [float(r[k]) for r in rows]
  return out


def token_counts(computed: int, real: int, unshared: int, passes: int = 1) -> dict:
  """A step's tokens/*: the positions its gradient passes compute (prompt tables, packed buffers and padding
  included), those holding a real token, those without sharing or packing (rows x (P + N)), and fill = real /
  computed."""
  return {"tokens/computed": computed * passes, "tokens/real": real * passes, "tokens/unshared": unshared * passes,
          "tokens/fill": real / computed if computed else 0.0}


def _reducer(key: str):
  if key.startswith("alloc/frac"):
    return lambda xs: float(np.mean(xs))  # the step's allocation fractions, averaged over its minibatches
  if key == "alloc/bucket":
    return lambda xs: xs[-1]
  if key.startswith("time/"):
    return lambda xs: float(np.sum(xs))
  return max  # bytes, gaps and predicted errors at their worst


def reduce_allocations(rows: list[dict]) -> dict:
  """A step's per-minibatch allocation metrics (alloc/*, memory/*, time/schedule_s) -> one value per key, over the
  rows that report it (with a plan per microbatch shape, a shape met first this step is still warming up while
  another plans)."""
  keys = list(dict.fromkeys(k for r in rows for k in r))
  return {k: _reducer(k)([r[k] for r in rows if k in r]) for k in keys}


def _write_atomic(path: str, text: str):
  """Replace path's content in one rename, so a kill leaves the old file or the new one, never half of it."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def write_json(path: str, obj):
  _write_atomic(path, json.dumps(obj, indent=2))


def _restart_jsonl(path: str, resume_step: int | None):
  """Empty the file for a new run; on resume keep only rows up to the resumed step (row N is written after step N
  completes and before its checkpoint: later rows are from steps that will run again)."""
  if resume_step is None:
    open(path, "w").close()
  elif os.path.exists(path):
    rows = [r for r in read_metrics(path) if r.get("step", -1) <= resume_step]
    _write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


class MetricsWriter:
  """Appends one JSON object per step to OUT/metrics.jsonl (and sample completions to OUT/samples.jsonl); on resume
  drops rows past the resumed step."""

  def __init__(self, out_dir: str, resume_step: int | None = None, tensorboard: bool = False, enabled: bool = True):
    self.path = os.path.join(out_dir, "metrics.jsonl")
    self.samples_path = os.path.join(out_dir, "samples.jsonl")
    self.enabled, self.tb = enabled, None
    if not enabled:  # a secondary process of a multi-process run: the first one writes
      return
    os.makedirs(out_dir, exist_ok=True)
    _restart_jsonl(self.path, resume_step)
    _restart_jsonl(self.samples_path, resume_step)
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError as e:
        raise ImportError("logging.tensorboard=true needs tensorboardX: pip install tensorboardX") from e
      self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))

  def write(self, row: dict):
    if not self.enabled:
      return
    clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in row.items()}
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:  # one write call per row: a kill leaves whole rows (read_metrics still tolerates a torn last one)
      os.write(fd, (json.dumps(clean) + "\n").encode())
    finally:
      os.close(fd)
    if self.tb is not None:
      for k, v in row.items():
        if isinstance(v, (int, float)) and k != "step":
          self.tb.add_scalar(k, v, row["step"])

  def write_samples(self, step: int, rows: list[dict]):
    """Decoded prompt/completion pairs of one step, one JSON object each."""
    if not self.enabled:
      return
    with open(self.samples_path, "a") as f:
      for r in rows:
        f.write(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n")

  def close(self):
    if self.tb is not None:
      self.tb.close()


def read_metrics(path: str) -> list[dict]:
  """The rows of a metrics.jsonl; a torn last line (a run killed mid-write) is dropped with a warning."""
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  rows = []
  for lineno, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except ValueError as e:
      if lineno < len(lines):  # a complete line (newline-terminated) that does not parse: not a torn write
        raise DataError(f"{path}:{lineno}: not a JSON row ({e})") from None
      log.warning("%s:%d: dropped a torn last row (the run was killed while writing it)", path, lineno)
  return rows


def plot_run(out_dir: str, steps: int, eval_before: dict, eval_after: dict | None) -> dict:
  """OUT/reward.png from OUT/metrics.jsonl with the greedy eval before and after; {"reward_png": path} or {}."""
  mpath, png = os.path.join(out_dir, "metrics.jsonl"), os.path.join(out_dir, "reward.png")
  if not os.path.exists(mpath):
    return {}
  extra = {}
  if eval_before:
    extra["greedy eval before"] = (0, eval_before["eval/accuracy"])
  if eval_after:
    extra["greedy eval after"] = (steps, eval_after["eval/accuracy"])
  plot_rewards(mpath, png, extra=extra)
  out = {"reward_png": png}
  if plot_lengths(mpath, os.path.join(out_dir, "lengths.png")):
    out["lengths_png"] = os.path.join(out_dir, "lengths.png")
  return out


LENGTHS = ("completion_len/p50", "completion_len/p90", "completion_len/max")


def completion_lengths(roll) -> dict:
  """A rollout's completion length p50 / p90 / max and the share the cap cut (rollout.Rollout)."""
  lens = roll.lengths
  cut = roll.cut_at_cap if roll.cut_at_cap is not None else lens >= roll.tokens.shape[1]
  p50, p90 = np.percentile(lens, [50, 90]) if len(lens) else (0.0, 0.0)
  return {LENGTHS[0]: float(p50), LENGTHS[1]: float(p90), LENGTHS[2]: float(lens.max(initial=0)),
          "completion_len/truncated_frac": float(np.mean(cut)) if len(lens) else 0.0}


def plot_lengths(metrics_path: str, out_png: str) -> bool:
  """Completion length p50 / p90 / max per step and the share truncated at the cap; False (nothing written) if the
  metrics carry no lengths."""
  rows = [r for r in read_metrics(metrics_path) if LENGTHS[0] in r]
  if not rows:
    return False
  steps = [r["step"] for r in rows]
  with figure(out_png, (7, 4), dpi=110) as (fig, ax):
    for k in LENGTHS:
      ax.plot(steps, [r[k] for r in rows], label=k.split("/")[1])
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("completion tokens")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(steps, [r.get("completion_len/truncated_frac", 0.0) for r in rows], "k:", label="truncated share")
    right.set_ylabel("truncated share")
    right.set_ylim(-0.02, 1.02)
    lines = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="upper left", fontsize=8)
    ax.set_title("completion lengths")
  return True


@contextlib.contextmanager
def figure(path: str, figsize: tuple[float, float] = (7, 4), dpi: int = 120):
  """A matplotlib figure and axes (the Agg backend: no display needed), laid out, saved to path and closed."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=figsize)
  try:
    yield fig, ax
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
  finally:
    plt.close(fig)


def plot_rewards(metrics_path: str, out_png: str, title: str = "GRPO reward", smooth: int = 10,
                 extra: dict | None = None):
  """Reward per step with a moving average; eval accuracies (if given) as markers."""
  rows = [r for r in read_metrics(metrics_path) if "reward/mean" in r]
  steps = [r["step"] for r in rows]
  reward = [r["reward/mean"] for r in rows]
  with figure(out_png, (7, 4), dpi=110) as (fig, ax):
    ax.plot(steps, reward, alpha=0.35, label="reward/mean")
    if len(reward) >= smooth:
      avg = [sum(reward[i - smooth + 1:i + 1]) / smooth for i in range(smooth - 1, len(reward))]
      ax.plot(steps[smooth - 1:], avg, label=f"moving average ({smooth})")
    for label, (x, y) in (extra or {}).items():
      ax.scatter([x], [y], marker="o", zorder=3, label=label)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title)
