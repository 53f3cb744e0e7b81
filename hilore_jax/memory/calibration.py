"""Risk calibration: measure each L unit's true gradient error on K batches, fit per-unit susceptibility to the
exposure score, report how well scores predict the error, and turn the gradient-error tolerance into the risk
budget delta.

An L unit's decoded code is read by every part of backward that reads the tensor (a softmax or nonlinearity
derivative too), so its error reaches input gradients of earlier layers: units' errors are not orthogonal. The
risk of a set is therefore modelled as coherence * (sum of its units' errors), the triangle inequality scaled by a
coherence factor measured on random sets (linear in the set, so the exact solver can bound it), and validated
against the measured error of other random sets. Every measurement runs one compiled probe program (the gradient
with every unit read as exact + mix * (decoded - exact), mix chosen at run time).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model
from hilore_jax.memory import exposure
from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.model import codec
from hilore_jax.model import units as U


def lowp_units(num_layers: int) -> list[tuple[int, str]]:
  """(layer, kind) of every unit that can be L (the probe's mix order within a layer is units.UNITS)."""
  return [(layer, kind) for layer in range(num_layers) for kind in U.LOWP_UNITS]


def token_errors(hooks: StepHooks, params, batch, units: Sequence[tuple[int, str]], group_size: int,
                 fmt: str = "int8") -> jax.Array:
  """[U, B, N] norm of each unit's L reconstruction error per token, at the positions whose log-probs count."""
  taps = hooks.unit_tensors(params, batch)
  out = []
  for layer, kind in units:
    x = taps[layer][kind]
    x = x.reshape(*x.shape[:2], -1).astype(jnp.float32)
    x_hat = codec.decode(*codec.encode(x, fmt, group_size), x.shape, jnp.float32, fmt)
    out.append(jnp.linalg.norm(x_hat - x, axis=-1))
  return jnp.stack(out)


def raw_exposure(hooks: StepHooks, params, batch, units, switches=ExposureSwitches(), group_size: int = 64,
                 fmt: str = "int8") -> jax.Array:
  """[U] exposure without susceptibility, from the forward quantities of this batch."""
  w = hooks.token_weights(params, batch, switches)
  err = token_errors(hooks, params, batch, units, group_size, fmt)
  return exposure.unit_exposure(w, err, jnp.ones(len(units)), dataclasses.replace(switches, susceptibility=False))


def error_profile(hooks: StepHooks, params, batches: Sequence, units, group_size: int,
                  fmt: str = "int8") -> np.ndarray:
  """[U, T] RMS L reconstruction error of each unit at each completion position, pooled over the batches (the
  run-time score's stand-in for the per-token errors only a forward pass would show)."""
  fn = jax.jit(lambda p, b: token_errors(hooks, p, b, units, group_size, fmt))
  err = jnp.concatenate([fn(params, b) for b in batches], axis=1)
  mask = jnp.concatenate([jnp.asarray(b.mask) for b in batches], axis=0)
  return np.asarray(exposure.position_profile(err, mask))


def runtime_raw(hooks: StepHooks, batch, profile_UT, switches=ExposureSwitches(), logp=None) -> jax.Array:
  """[U] the run-time exposure score without susceptibility, from what the batch carries (no forward pass) and the
  current log-probs where known."""
  w = hooks.token_weights(None, batch, switches, logp)
  profile_UT = jnp.asarray(profile_UT, jnp.float32)
  return exposure.runtime_scores(w, profile_UT, jnp.ones(profile_UT.shape[0]),
                                 dataclasses.replace(switches, susceptibility=False))


def norm(tree) -> jax.Array:
  """Euclidean norm of a pytree, leaf by leaf (no flattened copy of the model)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree)))


@jax.jit
def _relative_error(g, exact) -> jax.Array:
  diff = jax.tree_util.tree_map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), g, exact)
  return norm(diff) / jnp.maximum(norm(exact), 1e-30)


def relative_error(g, exact) -> float:
  """||g - exact|| / ||exact|| over pytrees (one compiled program per tree structure: calibration measures
  thousands, and op-by-op dispatch over every leaf cost more than the gradients)."""
  return float(_relative_error(g, exact))


def cosine(g, exact) -> float:
  dot = sum(jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))
            for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(exact)))
  return float(dot / jnp.maximum(norm(g) * norm(exact), 1e-30))


def exact_gradient(hooks: StepHooks, params, batch):
  """The reference gradient: full checkpointing (no low-precision code anywhere, and the configuration that fits
  whenever training does) with float32 matmuls at full precision (on H100/H200 "default" means TF32)."""
  with jax.default_matmul_precision("highest"):
    return hooks.gradient(params, batch, model.uniform(hooks.model_cfg.num_hidden_layers, model.FULL_REMAT))


def gradient_error(hooks: StepHooks, params, batch, policies, exact=None) -> float:
  """||g - g_exact|| / ||g_exact|| with g under `policies` and g_exact the reference (exact_gradient)."""
  exact = exact_gradient(hooks, params, batch) if exact is None else exact
  return relative_error(hooks.gradient(params, batch, tuple(policies)), exact)


def probe_mix(num_layers: int, units, chosen) -> np.ndarray:
  """[layers, len(UNITS)] mix that makes exactly the `chosen` indices into `units` L."""
  mix = np.zeros((num_layers, len(U.UNITS)), np.float32)
  for i in chosen:
    layer, kind = units[i]
    mix[layer, U.UNITS.index(kind)] = 1.0
  return mix


def set_errors(hooks: StepHooks, params, batch, units, sets, group_size: int, fmt: str = "int8",
               exact=None) -> np.ndarray:
  """[len(sets)] relative gradient error with exactly each set (indices into units) L, measured."""
  exact = exact_gradient(hooks, params, batch) if exact is None else exact
  n = hooks.model_cfg.num_hidden_layers
  return np.array([relative_error(hooks.probe_gradient(params, batch, probe_mix(n, units, s), fmt, group_size),
                                  exact) for s in sets])


def measure_unit_errors(hooks: StepHooks, params, batch, units, group_size: int,
                        fmt: str = "int8", exact=None, layers: Sequence[int] | None = None) -> np.ndarray:
  """[U] true relative gradient error ||g_u - g|| / ||g|| when only unit u is L (one probe gradient each); with
  `layers`, only units there are measured and every other unit's error is interpolated over depth from its kind's
  (interpolate_layers)."""
  chosen = [i for i, (layer, _) in enumerate(units) if layers is None or layer in layers]
  measured = set_errors(hooks, params, batch, units, [[i] for i in chosen], group_size, fmt, exact)
  if layers is None:
    return measured
  return interpolate_layers(units, {tuple(units[i]): e for i, e in zip(chosen, measured)})


def calibration_rows(batch, rows: int):
  """The first `rows` rows of a minibatch (every field's leading axis; minibatches are shuffled, so a random
  subset), or the whole minibatch for rows 0 or more than it has."""
  n = jax.tree_util.tree_leaves(batch)[0].shape[0]
  return batch if not rows or rows >= n else jax.tree_util.tree_map(lambda x: x[:rows], batch)


def probed_layers(num_layers: int, count: int) -> list[int] | None:
  """count layers spread evenly over depth, first and last included; None (every layer) for count 0 or >= depth."""
  if not count or count >= num_layers:
    return None
  return sorted({int(round(x)) for x in np.linspace(0, num_layers - 1, count)})


def interpolate_layers(units, measured: dict[tuple[int, str], float]) -> np.ndarray:
  """[U] each unit's error: measured where it was, else interpolated over layer index from its kind's measured
  layers, linearly in log error (errors across depth differ by factors, not offsets)."""
  out = []
  for layer, kind in units:
    if (layer, kind) in measured:
      out.append(measured[(layer, kind)])
      continue
    known = sorted((l, e) for (l, k), e in measured.items() if k == kind)
    xs = [l for l, _ in known]
    logs = np.log(np.maximum([e for _, e in known], 1e-30))
    out.append(float(np.exp(np.interp(layer, xs, logs))))
  return np.asarray(out)


def random_sets(n_units: int, count: int, rng: np.random.Generator) -> list[list[int]]:
  """`count` random L sets of sizes spread over 2 .. n_units (what allocations choose lies in between)."""
  sizes = np.linspace(2, n_units, count).round().astype(int)
  return [sorted(rng.choice(n_units, size=int(k), replace=False).tolist()) for k in sizes]


def fit_coherence(unit_err_KU: np.ndarray, sets, set_err_KS: np.ndarray) -> float:
  """The coherence factor: the largest measured / (sum of unit errors) over calibration sets and batches, so the
  linear risk model covers every set it was fitted on (1: errors add up fully, 1/sqrt(n): orthogonal)."""
  unit_err_KU, set_err_KS = np.atleast_2d(unit_err_KU), np.atleast_2d(set_err_KS)
  ratios = [set_err_KS[k, j] / max(unit_err_KU[k, s].sum(), 1e-30) for k in range(len(unit_err_KU))
            for j, s in enumerate(sets)]
  return float(max(ratios)) if ratios else 1.0


def set_fit(unit_err_U: np.ndarray, sets, measured_S: np.ndarray, coherence: float) -> dict[str, float]:
  """How well the linear (coherence * sum) and the orthogonal (root sum of squares) models predict measured set
  errors: Spearman rho, median |predicted / measured - 1|, share covered (predicted >= measured)."""
  from scipy.stats import spearmanr

  out = {"sets": len(sets)}
  measured_S = np.asarray(measured_S, float)
  for name, pred in (("linear", np.array([coherence * unit_err_U[s].sum() for s in sets])),
                     ("orthogonal", np.array([np.sqrt((unit_err_U[s] ** 2).sum()) for s in sets]))):
    rel = pred / np.maximum(measured_S, 1e-30) - 1
    out[f"{name}_spearman"] = float(spearmanr(pred, measured_S).statistic) if len(sets) > 2 else float("nan")
    out[f"{name}_median_abs_rel_err"] = float(np.median(np.abs(rel)))
    out[f"{name}_covered"] = float(np.mean(pred >= measured_S * (1 - 1e-6)))
  return out


def fit_susceptibility(raw_KU: np.ndarray, err_KU: np.ndarray) -> np.ndarray:
  """[U] per-unit median over calibration batches of measured error per unit of raw exposure."""
  raw_KU, err_KU = np.atleast_2d(raw_KU), np.atleast_2d(err_KU)
  ratio = np.where(raw_KU > 0, err_KU / np.where(raw_KU > 0, raw_KU, 1.0), np.nan)
  s = np.nanmedian(np.where(np.isnan(ratio).all(0, keepdims=True), 0.0, ratio), axis=0)
  return np.nan_to_num(s)


def predicted_errors(raw_U: np.ndarray, susceptibility_U: np.ndarray) -> np.ndarray:
  """Predicted relative gradient error of each unit alone as L."""
  return np.asarray(raw_U) * np.asarray(susceptibility_U)


def risk_metrics(score: np.ndarray, err: np.ndarray, top: float = 0.1) -> dict[str, float]:
  """Spearman rho, recall of the measured top-`top` units among the score's top, and AUROC for them."""
  from scipy.stats import rankdata, spearmanr

  score, err = np.asarray(score, float), np.asarray(err, float)
  k = max(1, int(round(top * len(err))))
  true_top = set(np.argsort(-err)[:k])
  pred_top = set(np.argsort(-score, kind="stable")[:k])
  labels = np.zeros(len(err), bool)
  labels[list(true_top)] = True
  ranks = rankdata(score)
  n_pos, n_neg = labels.sum(), (~labels).sum()
  auroc = float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)) if n_neg else float("nan")
  rho = spearmanr(score, err).statistic if np.ptp(score) > 0 else float("nan")
  return {"spearman": float(rho), f"top{int(top * 100)}_recall": len(true_top & pred_top) / k, "auroc": auroc}


def lowp_policies(num_layers: int, chosen: Sequence[tuple[int, str]], group_size: int,
                  fmt: str = "int8") -> tuple[model.LayerPolicy, ...]:
  """Every activation kept except `chosen` units, which are L (nothing is recomputed)."""
  pols = list(model.uniform(num_layers, model.NO_REMAT))
  for layer in range(num_layers):
    lowp = tuple(k for l, k in chosen if l == layer)
    if lowp:
      pols[layer] = model.LayerPolicy(remat=False, lowp=lowp, formats=(fmt,) * len(lowp), group_size=group_size)
  return tuple(pols)


def calibrate_delta(hooks: StepHooks, params, batches: Sequence, units, risk: np.ndarray, tolerance: float,
                    group_size: int, fmt: str = "int8", max_halvings: int = 8, exact=None) -> tuple[float, float]:
  """Largest risk budget delta (from the tolerance, halving) whose lowest-risk L set (risk: each unit's predicted
  error, coherence included) measures under the tolerance on every calibration batch. Returns (delta, its
  measured error)."""
  risk = np.asarray(risk, float)
  exact = exact or [None] * len(batches)
  delta = tolerance
  for _ in range(max_halvings + 1):
    chosen, total = [], 0.0
    for i in np.argsort(risk, kind="stable"):
      if total + risk[i] > delta:
        break
      chosen.append(int(i))
      total += risk[i]
    if not chosen:
      return delta, 0.0
    err = max(float(set_errors(hooks, params, b, units, [chosen], group_size, fmt, ex)[0])
              for b, ex in zip(batches, exact))
    if err <= tolerance:
      return delta, err
    delta /= 2
  return 0.0, 0.0


# ----------------------------------------------------------------------------- risk report

ABLATIONS = ("ratio_clip", "update_mask", "kl", "activation", "susceptibility")


def risk_report(hooks: StepHooks, params, cal_batches: Sequence, eval_batches: Sequence, units,
                group_size: int, fmt: str = "int8", err_cal=None, err_ev=None) -> dict[str, dict[str, float]]:
  """How well each score predicts the measured per-unit error on held-out batches (pooled over batches and units,
  so mostly fixed per-unit differences; bench/exposure.py reports the within-unit figures):
  the full exposure score, each component switched off, and simple baselines. Scores are fit on cal_batches
  (err_cal / err_ev: their per-unit errors if already measured)."""
  measure = lambda bs: np.stack([measure_unit_errors(hooks, params, b, units, group_size, fmt) for b in bs])
  err_cal = measure(cal_batches) if err_cal is None else np.asarray(err_cal)
  err_ev = measure(eval_batches) if err_ev is None else np.asarray(err_ev)
  # the run-time score (what allocations use: no forward pass), its ablations, and the same score with the
  # forward's own per-token errors in place of the calibrated profile (not available at run time)
  prof = error_profile(hooks, params, cal_batches, units, group_size, fmt)
  run_fn = jax.jit(lambda b, sw: runtime_raw(hooks, b, prof, sw), static_argnums=1)
  fwd_fn = jax.jit(lambda p, b, sw: raw_exposure(hooks, p, b, units, sw, group_size, fmt), static_argnums=2)
  rows = {}
  variants = {"run-time score": (run_fn, ExposureSwitches())}
  variants.update({f"without {a}": (run_fn, ExposureSwitches(**{a: False})) for a in ABLATIONS})
  variants["with the forward's per-token errors"] = (lambda b, sw: fwd_fn(params, b, sw), ExposureSwitches())
  for name, (fn, sw) in variants.items():
    raw_cal = np.stack([np.asarray(fn(b, sw)) for b in cal_batches])
    raw_ev = np.stack([np.asarray(fn(b, sw)) for b in eval_batches])
    sus = fit_susceptibility(raw_cal, err_cal) if sw.susceptibility else np.ones(len(units))
    rows[name] = risk_metrics((raw_ev * sus).ravel(), err_ev.ravel())
  # baselines: the unit's reconstruction error alone; its calibrated mean error (type/layer, batch-independent);
  # the batch's total |advantage| (the same for every unit of a batch)
  recon = jax.jit(lambda p, b: jnp.sqrt(jnp.sum(token_errors(hooks, p, b, units, group_size, fmt) ** 2,
                                                 axis=(1, 2))))
  rows["baseline: reconstruction error only"] = risk_metrics(
      np.stack([np.asarray(recon(params, b)) for b in eval_batches]).ravel(), err_ev.ravel())
  rows["baseline: static type/layer"] = risk_metrics(np.tile(err_cal.mean(0), len(eval_batches)), err_ev.ravel())
  rows["baseline: advantage only"] = risk_metrics(
      np.repeat([np.abs(np.asarray(b.adv)).sum() for b in eval_batches], len(units)), err_ev.ravel())
  return rows


def risk_table(rows: dict[str, dict[str, float]]) -> str:
  """The risk report as a markdown table."""
  lines = ["| score | Spearman rho | top-10% recall | AUROC |", "|---|---:|---:|---:|"]
  for name, m in rows.items():
    lines.append(f"| {name} | {m['spearman']:.3f} | {m['top10_recall']:.3f} | {m['auroc']:.3f} |")
  return "\n".join(lines)
