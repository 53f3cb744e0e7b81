"""Per-step metrics: JSON lines, optional TensorBoard, and the reward curve."""

from __future__ import annotations

import json
import math
import os

import numpy as np

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


def _reducer(key: str):
  if key.startswith("alloc/frac"):
    return lambda xs: float(np.mean(xs))  # the step's allocation fractions, averaged over its minibatches
  if key == "alloc/bucket":
    return lambda xs: xs[-1]
  if key.startswith("time/"):
    return lambda xs: float(np.sum(xs))
  return max  # bytes, gaps and predicted errors at their worst


def reduce_allocations(rows: list[dict]) -> dict:
  """A step's per-minibatch allocation metrics (alloc/*, memory/*, time/schedule_s) -> one value per key."""
  return {k: _reducer(k)([r[k] for r in rows]) for k in (rows[0] if rows else {})}


def _restart_jsonl(path: str, resume_step: int | None):
  """Empty the file for a new run; on resume keep only rows up to the resumed step."""
  if resume_step is None:
    open(path, "w").close()
  elif os.path.exists(path):
    rows = read_metrics(path)
    with open(path, "w") as f:
      for r in rows:
        if r.get("step", -1) <= resume_step:  # row N is written after step N completes
          f.write(json.dumps(r) + "\n")


class MetricsWriter:
  """Appends one JSON object per step to OUT/metrics.jsonl (and sample completions to OUT/samples.jsonl); on resume
  drops rows past the resumed step."""

  def __init__(self, out_dir: str, resume_step: int | None = None, tensorboard: bool = False):
    self.path = os.path.join(out_dir, "metrics.jsonl")
    self.samples_path = os.path.join(out_dir, "samples.jsonl")
    os.makedirs(out_dir, exist_ok=True)
    _restart_jsonl(self.path, resume_step)
    _restart_jsonl(self.samples_path, resume_step)
    self.tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError as e:
        raise ImportError("logging.tensorboard=true needs tensorboardX: pip install tensorboardX") from e
      self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))

  def write(self, row: dict):
    clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in row.items()}
    with open(self.path, "a") as f:
      f.write(json.dumps(clean) + "\n")
    if self.tb is not None:
      for k, v in row.items():
        if isinstance(v, (int, float)) and k != "step":
          self.tb.add_scalar(k, v, row["step"])

  def write_samples(self, step: int, rows: list[dict]):
    """Decoded prompt/completion pairs of one step, one JSON object each."""
    with open(self.samples_path, "a") as f:
      for r in rows:
        f.write(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n")

  def close(self):
    if self.tb is not None:
      self.tb.close()


def read_metrics(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_rewards(metrics_path: str, out_png: str, title: str = "GRPO reward", smooth: int = 10,
                 extra: dict | None = None):
  """Reward per step with a moving average; eval accuracies (if given) as markers."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in read_metrics(metrics_path) if "reward/mean" in r]
  steps = [r["step"] for r in rows]
  reward = [r["reward/mean"] for r in rows]
  fig, ax = plt.subplots(figsize=(7, 4))
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
  fig.tight_layout()
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
