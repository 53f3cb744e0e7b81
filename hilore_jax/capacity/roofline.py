"""A roofline projection of the actor update's step time on one device, from counts, not timings: a projection,
labelled so wherever it is shown.

The model, per plan: each compiled program (the gradient program, then the optimizer's update program) takes
max(matmul FLOPs / peak FLOP/s, bytes accessed / HBM bandwidth), and the programs run one after the other; the L
units' codec adds its traffic at HBM bandwidth on top (encode reads the tensor and writes codes + scales, decode
reads them and writes the tensor). Assumptions, all optimistic or neutral between plans: compute and memory traffic
overlap perfectly within a program; the matmuls run at the dense peak (every FLOP counted is a matmul FLOP: the
elementwise work is memory traffic); no launch or host overhead; bytes accessed are XLA's count on the compiling
backend, whose fusion decides them (CPU's fuses differently from a GPU's); the codec term may count what XLA
already counted for the encode and decode ops it did not fuse away, so it is an upper bound on their cost.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Device:
  name: str
  peak_flops: float  # dense matmul FLOP/s at the model's compute dtype
  hbm_bytes_per_s: float
  source: str


# NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): BF16 Tensor Core 1,979 TFLOPS with structured
# sparsity, so 989 TFLOP/s dense; HBM3e 4.8 TB/s. The one place these figures live.
H200 = Device("H200 SXM (datasheet: dense BF16, HBM3e)", 989e12, 4.8e12, "NVIDIA H200 datasheet")


@dataclasses.dataclass(frozen=True)
class Counts:
  """What the projection reads of one plan's compiled step."""

  matmul_flops: float  # the gradient program's matmul FLOPs, recompute included (capacity/flops.py)
  grad_bytes: float  # XLA's bytes accessed of the gradient program, every layer and loop iteration counted
  update_bytes: float  # the same for the update program (optimizer; no matmuls)
  codec_bytes: float  # encode + decode traffic of the plan's L units (codec_bytes)


def codec_bytes(units: Iterable[tuple[int, int]]) -> float:
  """Traffic of the L units given as (tensor bytes, code + scale bytes): each is read and its code written once
  (encode), the code read and the tensor written once (decode)."""
  return float(sum(2 * (tensor + code) for tensor, code in units))


def program_s(flops: float, bytes_accessed: float, device: Device = H200) -> float:
  """One program's roofline time: the slower of its compute and its memory traffic."""
  return max(flops / device.peak_flops, bytes_accessed / device.hbm_bytes_per_s)


def project(c: Counts, device: Device = H200) -> dict:
  """Projected seconds of one step: gradient program + update program + codec traffic; `bound` says which roof
  the gradient program sits under."""
  grad_s = program_s(c.matmul_flops, c.grad_bytes, device)
  update_s = program_s(0.0, c.update_bytes, device)
  codec_s = c.codec_bytes / device.hbm_bytes_per_s
  compute_s = c.matmul_flops / device.peak_flops
  return {"step_s": grad_s + update_s + codec_s, "grad_s": grad_s, "update_s": update_s, "codec_s": codec_s,
          "bound": "compute" if compute_s >= c.grad_bytes / device.hbm_bytes_per_s else "memory"}


def add_gains(rows: list[dict], key: str = "projected_step_s") -> list[dict]:
  """Each row's projected throughput gain over GC's projection and over optimal_hr's at its budget, in percent
  (base time / time - 1, as the measured gains)."""
  gc = next((r[key] for r in rows if r["method"] == "gc" and r.get(key)), None)
  hr = {r["budget_ratio"]: r[key] for r in rows if r["method"] == "optimal_hr" and r.get(key)}
  for r in rows:
    s = r.get(key)
    r["projected_gain_vs_gc_pct"] = 100 * (gc / s - 1) if s and gc else None
    base = hr.get(r["budget_ratio"])
    r["projected_gain_vs_optimal_hr_pct"] = 100 * (base / s - 1) if s and base else None
  return rows
