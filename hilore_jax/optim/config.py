"""The optimizer's settings (optimizer.*): AdamW or LoGRA, the schedule, clipping and predicted-KL step control."""

from __future__ import annotations

import dataclasses

from hilore_jax.errors import check_choice, check_positive, check_range

OPTIMIZERS = ("adamw", "logra")


@dataclasses.dataclass(frozen=True)
class LograConfig:
  """optimizer.logra.*: Adam(W) moments in a rank-`rank` subspace of each weight matrix (optim/logra.py)."""

  rank: int = 8  # r: columns of each matrix's projection P [M, r]; matrices with a smaller side < r stay dense
  refresh_every: int = 200  # updates between refits of P (GaLore's T); the first update fits it
  oversample: int = 8  # extra columns of the range finder's Gaussian test matrix
  power_iters: int = 2  # power iterations of the range finder
  min_dim: int = 0  # matrices whose smaller side is below this stay dense
  scale: float = 1.0  # the projected-back update is multiplied by this (GaLore's alpha)
  seed: int = 0  # the range finder's PRNG seed

  def __post_init__(self):
    check_positive("optimizer.logra.rank", self.rank)
    check_positive("optimizer.logra.refresh_every", self.refresh_every)
    check_positive("optimizer.logra.oversample", self.oversample, allow_zero=True)
    check_positive("optimizer.logra.power_iters", self.power_iters, allow_zero=True)
    check_positive("optimizer.logra.min_dim", self.min_dim, allow_zero=True)
    check_positive("optimizer.logra.scale", self.scale)
    check_positive("optimizer.logra.seed", self.seed, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
  """optimizer.kl_control.*: scale each update so its predicted per-token KL stays under `target` (kl_control.py)."""

  target: float = 0.0  # nats per completion token; 0: off (the update program is then exactly the plain one)
  chunk: int = 128  # sequence positions per logits chunk of the KL's forward and JVP

  def __post_init__(self):
    check_positive("optimizer.kl_control.target", self.target, allow_zero=True)
    check_positive("optimizer.kl_control.chunk", self.chunk)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  kind: str = "adamw"  # adamw | logra (AdamW on low-rank gradient sketches; settings under optimizer.logra)
  lr: float = 1e-5
  schedule: str = "constant"  # constant | cosine (after linear warmup)
  warmup_steps: int = 0
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0  # 0: no clipping
  logra: LograConfig = LograConfig()
  kl_control: KLControlConfig = KLControlConfig()  # with either kind

  def __post_init__(self):
    check_choice("optimizer.kind", self.kind, OPTIMIZERS)
    check_choice("optimizer.schedule", self.schedule, ("constant", "cosine"))
    check_positive("optimizer.lr", self.lr)
    check_positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)
    check_range("optimizer.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
    check_positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
    check_range("optimizer.b1", self.b1, 0.0, 1.0, high_open=True)
    check_range("optimizer.b2", self.b2, 0.0, 1.0, high_open=True)
    check_positive("optimizer.eps", self.eps)
    check_positive("optimizer.max_grad_norm", self.max_grad_norm, allow_zero=True)
