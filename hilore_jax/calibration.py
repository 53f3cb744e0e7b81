"""Risk calibration: measure each L unit's true gradient error, fit the exposure score to it, report how well
the score predicts it, and turn the gradient-error tolerance into the risk budget delta."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import exposure, grpo, model, train_step
from hilore_jax.exposure import ExposureSwitches
from hilore_jax.model_config import ModelConfig


def lowp_units(cfg: ModelConfig) -> list[tuple[int, str]]:
  """(layer, kind) of every unit that can be L."""
  return [(layer, kind) for layer in range(cfg.num_hidden_layers) for kind in model.LOWP_UNITS]


def activation_magnitudes(cfg: ModelConfig, params, batch: dict, units: Sequence[tuple[int, str]]) -> jax.Array:
  """[U, B, N] per-token RMS of each unit at the positions that predict completion tokens."""
  ids, mask = train_step.sequence_inputs(batch)
  P, N = batch["prompt_ids"].shape[1], batch["tokens"].shape[1]
  taps: list[dict] = []
  model.hidden_states(cfg, params, ids, mask, taps=taps)
  return jnp.stack([taps[layer][kind][:, P - 1:P + N - 1] for layer, kind in units])


def raw_exposure(spec: train_step.StepSpec, params, batch: dict, units, switches=ExposureSwitches()) -> jax.Array:
  """[U] exposure without susceptibility, from the forward quantities of this batch."""
  logp, _ = train_step.completion_logprobs(spec.model_cfg, params, batch, None, spec.logprob_chunk)
  old = batch.get("old_logp", logp)
  ref = batch.get("ref_logp", logp)
  w = exposure.token_weights(logp, old, ref, batch["adv"], batch["mask"], spec.loss_cfg, switches)
  act = activation_magnitudes(spec.model_cfg, params, batch, units)
  return exposure.unit_exposure(w, act, jnp.ones(len(units)), dataclasses.replace(switches, susceptibility=False))


def single_unit_policies(cfg: ModelConfig, layer: int, kind: str, group_size: int) -> tuple[model.LayerPolicy, ...]:
  pols = list(model.uniform_policies(cfg, model.NO_REMAT))
  pols[layer] = model.LayerPolicy(remat=True, lowp=(kind,), group_size=group_size)
  return tuple(pols)


# one jitted gradient for the module: specs are static, so repeated specs (the exact gradient) compile once
_grad = jax.jit(lambda p, b, s: train_step.grads_and_stats(p, b, s)[0], static_argnums=2)


def _exact_spec(spec: train_step.StepSpec) -> train_step.StepSpec:
  return dataclasses.replace(spec, policies=model.uniform_policies(spec.model_cfg, model.NO_REMAT))


def _flat(tree) -> jax.Array:
  return jnp.concatenate([x.ravel().astype(jnp.float32) for x in jax.tree_util.tree_leaves(tree)])


def gradient_error(spec: train_step.StepSpec, params, batch: dict, policies, exact=None) -> float:
  """||g - g_exact|| / ||g_exact|| with g under `policies`, g_exact with every activation kept (H)."""
  if exact is None:
    exact = _flat(_grad(params, batch, _exact_spec(spec)))
  g = _flat(_grad(params, batch, dataclasses.replace(spec, policies=tuple(policies))))
  return float(jnp.linalg.norm(g - exact) / jnp.maximum(jnp.linalg.norm(exact), 1e-30))


def measure_unit_errors(spec: train_step.StepSpec, params, batch: dict, units, group_size: int) -> np.ndarray:
  """[U] true relative gradient error when only that unit is int8."""
  exact = _flat(_grad(params, batch, _exact_spec(spec)))
  return np.array([gradient_error(spec, params, batch, single_unit_policies(spec.model_cfg, l, k, group_size), exact)
                   for l, k in units])


def fit_susceptibility(raw: np.ndarray, err: np.ndarray, kinds: Sequence[str]) -> dict[str, float]:
  """Per kind, the median ratio of measured error to raw exposure (error per unit of exposure)."""
  out = {}
  for kind in sorted(set(kinds)):
    idx = [i for i, k in enumerate(kinds) if k == kind and raw[i] > 0]
    out[kind] = float(np.median(err[idx] / raw[idx])) if idx else 0.0
  return out


def risk_metrics(score: np.ndarray, err: np.ndarray, top: float = 0.1) -> dict[str, float]:
  """Spearman rho, recall of the measured top-`top` units among the score's top, and AUROC for them."""
  from scipy.stats import rankdata, spearmanr

  score, err = np.asarray(score, float), np.asarray(err, float)
  k = max(1, int(round(top * len(err))))
  true_top = set(np.argsort(-err)[:k])
  pred_top = set(np.argsort(-score)[:k])
  labels = np.zeros(len(err), bool)
  labels[list(true_top)] = True
  ranks = rankdata(score)
  n_pos, n_neg = labels.sum(), (~labels).sum()
  auroc = float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)) if n_neg else float("nan")
  rho = spearmanr(score, err).statistic if np.ptp(score) > 0 else float("nan")
  return {"spearman": float(rho), f"top{int(top * 100)}_recall": len(true_top & pred_top) / k, "auroc": auroc}


@dataclasses.dataclass
class Calibration:
  """What calibration learned: per-kind susceptibility and the risk budget delta for the tolerance."""

  susceptibility: dict[str, float]
  delta: float
  tolerance: float
  measured_error_at_delta: float


def risk_scores(raw: np.ndarray, kinds: Sequence[str], susceptibility: dict[str, float]) -> np.ndarray:
  """Predicted relative gradient error of each unit alone as L."""
  return np.array([susceptibility.get(k, 0.0) * r for r, k in zip(raw, kinds)])


def calibrate_delta(spec: train_step.StepSpec, params, batch: dict, units, risk: np.ndarray, tolerance: float,
                    group_size: int, max_halvings: int = 8) -> tuple[float, float]:
  """Largest delta (starting at the tolerance, halving) whose lowest-risk L set measures under the tolerance.

  Returns (delta, measured error of that L set). Lower-risk units are added first, as the allocator would.
  """
  delta = tolerance
  for _ in range(max_halvings + 1):
    order = np.argsort(risk)
    chosen, total = [], 0.0
    for i in order:
      if total + risk[i] > delta:
        break
      chosen.append(units[i])
      total += risk[i]
    pols = list(model.uniform_policies(spec.model_cfg, model.NO_REMAT))
    for layer in range(spec.model_cfg.num_hidden_layers):
      lowp = tuple(k for l, k in chosen if l == layer)
      if lowp:
        pols[layer] = model.LayerPolicy(remat=True, lowp=lowp, group_size=group_size)
    err = gradient_error(spec, params, batch, pols) if chosen else 0.0
    if err <= tolerance:
      return delta, err
    delta /= 2
  return 0.0, 0.0
