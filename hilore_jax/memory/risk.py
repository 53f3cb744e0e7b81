"""The risk of L units: the error their decoded codes put into what the update carries (memory.risk_metric).

relative  ||g_L - g|| / ||g||: the gradient's relative error (the first definition, kept as a column).
clipped   ||g_L - g|| / max(||g||, c), c the optimizer's global-norm clip (optimizer.max_grad_norm): the error left
          after clipping, against the largest update the clip lets through. On GRPO minibatches ||g|| spans orders of
          magnitude (collapsed tokens make the k3 KL gradient large, zero-mean group advantages cancel), and the
          relative error divides away exactly the magnitude that the clip then bounds.
update    ||u(g_L) - u(g)|| / ||u(g)||, u one optimizer update (its clipping and AdamW) from the same optimizer state
          and params: the error the parameters receive.

g is the exact gradient of the same minibatch (calibration.exact_gradient); c = 0 (no clipping) makes clipped the
relative error. From a fresh AdamW state (the first update) u is about -lr sign(g): an L error that flips no sign
has no update error, so that metric needs a warmed-up optimizer state to say anything.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax.memory.config import RISK_METRICS

TINY = 1e-30
# what each metric is, for reports (exposure.json's error_definition)
DEFINITIONS = {
    "relative": "||g_L - g|| / ||g||: the gradient's relative error, g the minibatch's exact gradient",
    "clipped": "||g_L - g|| / max(||g||, c), c = optimizer.max_grad_norm: the gradient error after global-norm "
               "clipping, against the largest update the clip lets through",
    "update": "||u(g_L) - u(g)|| / ||u(g)||, u one optimizer update (clip + AdamW) from the same state: the error the "
              "parameters receive"}


def tree_norm(tree) -> jax.Array:
  """Euclidean norm of a pytree, leaf by leaf (no flattened copy of the model)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree)))


def _diff(a, b):
  return jax.tree_util.tree_map(lambda x, y: x.astype(jnp.float32) - y.astype(jnp.float32), a, b)


def relative(dg_norm, g_norm):
  """||dg|| / ||g||."""
  return dg_norm / np.maximum(g_norm, TINY)


def clipped(dg_norm, g_norm, max_grad_norm: float):
  """||dg|| / max(||g||, c): the error after global-norm clipping at c, for ||g_L|| close to ||g||."""
  return dg_norm / np.maximum(np.maximum(g_norm, max_grad_norm), TINY)


def clip_scale(g_hat, max_grad_norm: float):
  """min(1, g_hat / c): the share of a unit's relative error its clipped error keeps on a minibatch whose gradient
  norm is g_hat (||dg|| / max(||g||, c) = relative error x min(1, ||g|| / c)); 1 without a clip."""
  g = np.maximum(np.asarray(g_hat, float), 0.0)
  return np.ones_like(g) if not max_grad_norm else np.minimum(1.0, g / max_grad_norm)


def static_clip(static_U, g_hat, max_grad_norm: float) -> np.ndarray:
  """Clip-scaled static risk: each unit's static calibrated risk (its p90 over calibration) times clip_scale of the
  minibatch's forward-only gradient-norm estimate g_hat (the exposure normaliser's grad_scale x token norm);
  [U] for a scalar g_hat, [M, U] for g_hat [M]."""
  return np.multiply.outer(clip_scale(g_hat, max_grad_norm), np.asarray(static_U, float))


norm_of = jax.jit(tree_norm)  # one compiled program per tree structure, not one dispatch per leaf


@jax.jit
def _norms(g, exact) -> tuple[jax.Array, jax.Array]:
  # one compiled program per tree structure: calibration measures thousands, and op-by-op dispatch over every leaf
  # cost more than the gradients
  return tree_norm(_diff(g, exact)), tree_norm(exact)


@functools.lru_cache(maxsize=8)
def _update_norms(update: Callable):
  def fn(g, exact, opt_state, params):
    u = update(exact, opt_state, params)[0]
    return tree_norm(_diff(update(g, opt_state, params)[0], u)), tree_norm(u)
  return jax.jit(fn)


def update_error(g, exact, update: Callable, opt_state, params) -> float:
  """||u(g) - u(exact)|| / ||u(exact)|| for one optax update (grads, state, params) -> (updates, state)."""
  du, u = _update_norms(update)(g, exact, opt_state, params)
  return float(relative(float(du), float(u)))


@dataclasses.dataclass(frozen=True, eq=False)
class Reference:
  """A minibatch's exact gradient and what each metric needs to score another gradient against it."""

  grad: Any
  grad_norm: float
  metric: str = "relative"
  max_grad_norm: float = 0.0
  update: Callable | None = None  # the optimizer's update function (optax)
  opt_state: Any = None
  params: Any = None
  # [layers, len(WEIGHT_READS)] each weight-read unit's ||dg_u|| from the program that computed grad
  # (StepHooks.probe_errors), or None: measured by a probe where asked (calibration.decomposed_unit_errors)
  weight_errors: Any = None

  def __post_init__(self):
    if self.metric not in RISK_METRICS:
      raise ValueError(f"risk metric must be one of {list(RISK_METRICS)}, got {self.metric!r}")
    if self.metric == "update" and not self.has_update:
      raise ValueError("risk metric 'update' needs the optimizer (StepHooks.optimizer_update) and its state")

  @property
  def has_update(self) -> bool:
    return self.update is not None and self.opt_state is not None

  def available(self) -> tuple[str, ...]:
    return RISK_METRICS if self.has_update else RISK_METRICS[:2]

  def errors(self, g, metrics: Sequence[str] | None = None) -> dict[str, float]:
    """Every requested metric (default: every available one) of gradient g, from one difference."""
    metrics = self.available() if metrics is None else metrics
    dg, gn = (float(x) for x in _norms(g, self.grad))
    out = {"relative": float(relative(dg, gn)), "clipped": float(clipped(dg, gn, self.max_grad_norm))}
    if "update" in metrics:
      out["update"] = update_error(g, self.grad, self.update, self.opt_state, self.params)
    return {k: out[k] for k in metrics}

  def error(self, g) -> float:
    return self.errors(g, (self.metric,))[self.metric]


def as_reference(exact) -> Reference:
  """A Reference as is; a bare gradient tree as the relative error's reference."""
  if isinstance(exact, Reference):
    return exact
  return Reference(exact, float(norm_of(exact)))


# ----------------------------------------------------------------------------- the spread of ||g||


def log_spread(norms) -> float:
  """log10 of the 90th over the 10th percentile of the positive gradient norms (nan with fewer than two)."""
  x = np.asarray([n for n in norms if n > 0], float)
  if len(x) < 2:
    return float("nan")
  lo, hi = np.quantile(x, [0.1, 0.9])
  return float(np.log10(hi / lo))


def spread_removed(norms, norms_bounded) -> dict[str, float]:
  """How much of ||g||'s spread over minibatches a bounded loss (grpo.kl_clamp) removes: the log10 p90 / p10 spread
  and the max / min ratio of each, and the share of the log spread removed."""
  a, b = log_spread(norms), log_spread(norms_bounded)
  ratio = lambda x: float(np.max(x) / max(np.min([n for n in x if n > 0] or [TINY]), TINY))
  return {"log10_spread_p10_p90": a, "log10_spread_p10_p90_bounded": b,
          "max_over_min": ratio(norms), "max_over_min_bounded": ratio(norms_bounded),
          "spread_removed_share": float(1 - b / a) if a > 0 else float("nan")}
