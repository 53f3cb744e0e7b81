"""Risk calibration: measure each L unit's true error (of memory.risk_metric, memory/risk.py) on K minibatches,
each at the params (and optimizer state) its update saw, fit per-unit susceptibility to the run-time predictor,
report how well it predicts the error, and turn the error tolerance into the risk budget delta.

An L unit's decoded code is read by every part of backward that reads the tensor (a softmax or nonlinearity
derivative too), so its error reaches input gradients of earlier layers: units' errors are not orthogonal. The
risk of a set is therefore modelled as coherence * (sum of its units' errors), the triangle inequality scaled by a
coherence factor measured on random sets (linear in the set, so the exact solver can bound it), and validated
against the measured error of other random sets. Every measurement runs one compiled probe program (the gradient
with every unit read as exact + mix * (decoded - exact), mix chosen at run time), at the exact gradient's matmul
precision (PRECISION); the exact gradient is that program with a zero mix.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hilore_jax import model
from hilore_jax.memory import exposure, predictors, risk
from hilore_jax.memory.config import ExposureSwitches
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.model import codec
from hilore_jax.model import units as U
from hilore_jax.model.decoder import WEIGHT_READS, weight_read_leaves

# every gradient a risk is measured from (the exact one, the probes, the arms' plans) runs at this matmul precision:
# on GPUs "default" is TF32, whose rounding would put a floor under the int8 errors being measured, and a reference
# at another precision than the probes would count that floor as the units' error
PRECISION = "highest"
norm = risk.norm_of


def measuring():
  """The context every measured gradient runs in (PRECISION)."""
  return jax.default_matmul_precision(PRECISION)


def lowp_units(num_layers: int, kinds: Sequence[str] = ()) -> list[tuple[int, str]]:
  """(layer, kind) of every unit that can be L, of `kinds` only where given (memory.lowp_kinds; the probe's mix
  order within a layer is units.UNITS)."""
  return [(layer, kind) for layer in range(num_layers) for kind in U.LOWP_UNITS if not kinds or kind in kinds]


def token_errors(hooks: StepHooks, params, batch, units: Sequence[tuple[int, str]], group_size: int,
                 fmt: str = "int8") -> jax.Array:
  """[U, B, P-1+N] norm of each unit's L reconstruction error per token, at every position whose activations reach
  a completion log-prob (the prompt's but its last, then the completion's: StepHooks.unit_tensors), encoded as the
  L unit's code is (model/lowp.py: groups along the tensor's own last axis, decoded to its dtype)."""
  taps = hooks.unit_tensors(params, batch)
  out = []
  for layer, kind in units:
    x = taps[layer][kind]
    x_hat = codec.decode(*codec.encode(x, fmt, group_size), x.shape, x.dtype, fmt)
    d = (x_hat.astype(jnp.float32) - x.astype(jnp.float32)).reshape(*x.shape[:2], -1)
    out.append(jnp.linalg.norm(d, axis=-1))
  return jnp.stack(out)


def error_profile(hooks: StepHooks, params: Sequence, batches: Sequence, units, group_size: int,
                  fmt: str = "int8") -> tuple[np.ndarray, np.ndarray, list]:
  """(prompt profile [U, P-1], completion profile [U, N], each batch's token_errors): RMS L reconstruction error of
  each unit at each position, pooled over the batches, each forward at its own params (the run-time score's stand-in
  for the per-token errors only a forward pass would show)."""
  fn = jax.jit(lambda p, b: token_errors(hooks, p, b, units, group_size, fmt))
  per = [fn(p, b) for p, b in zip(params, batches)]
  mask = jnp.concatenate([exposure.position_mask(jnp.asarray(b.prompt_mask), jnp.asarray(b.mask))
                          for b in batches], axis=0)
  prof = np.asarray(exposure.position_profile(jnp.concatenate(per, axis=1), mask))
  P1 = batches[0].prompt_len - 1
  return prof[:, :P1], prof[:, P1:], per


def raw_exposure(hooks: StepHooks, params, batch, units, switches=ExposureSwitches(), group_size: int = 64,
                 fmt: str = "int8", logp=None, norm_=predictors.Normalisation(), grad_scale=1.0) -> jax.Array:
  """[U] the predictor's weights (switches.predictor) times a forward pass's own per-token errors at params, without
  susceptibility; the current log-probs are logp or, if None, the forward's."""
  lp = hooks.logprobs(params, batch) if logp is None else logp
  w = hooks.token_weights(None, batch, switches, lp)
  sw = dataclasses.replace(switches, susceptibility=False)
  err = token_errors(hooks, params, batch, units, group_size, fmt)
  c = predictors.weights(sw.predictor, w, lp)
  scale = exposure.normaliser(exposure.token_norm(c, sw.coherence), norm_.metric, grad_scale, norm_.max_grad_norm)
  return exposure.unit_exposure(exposure.sequence_weights(c, batch.prompt_mask, sw.prompt), err,
                                jnp.ones(len(units)), sw, scale)


def relative_error(g, exact) -> float:
  """||g - exact|| / ||exact|| over pytrees."""
  return risk.as_reference(exact).errors(g, ("relative",))["relative"]


def cosine(g, exact) -> float:
  dot = sum(jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))
            for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(exact)))
  return float(dot / jnp.maximum(norm(g) * norm(exact), 1e-30))


def exact_gradient(hooks: StepHooks, params, batch, fmt: str = "int8", group_size: int = 64, probe: bool = True):
  """The reference gradient at PRECISION: the probe program itself with a zero mix (every unit read exact), so a
  probe's difference from it is the L error alone, not the float noise between two compiled programs (fmt and
  group_size: the probes', which pick that program). probe False, or hooks without a probe: full checkpointing (no
  low-precision code anywhere, and the configuration that fits whenever training does), for references that only
  compiled plans, not probes, are compared with."""
  n = hooks.model_cfg.num_hidden_layers
  with measuring():
    if not probe or hooks.probe_gradient is None:
      return hooks.gradient(params, batch, model.uniform(n, model.FULL_REMAT))
    return hooks.probe_gradient(params, batch, probe_mix(n, [], []), fmt, group_size)


@dataclasses.dataclass(frozen=True)
class UpdateContext:
  """Where a calibration minibatch is measured: the params (and optimizer state) its update saw, and the current
  log-probs as run-time scoring reads them (None: the batch's old ones)."""

  params: Any
  opt_state: Any = None
  logp: Any = None


def reference(hooks: StepHooks, ctx: UpdateContext, batch, metric: str = "relative", fmt: str = "int8",
              group_size: int = 64, weight_errors: bool = False) -> risk.Reference:
  """The minibatch's exact gradient at ctx (exact_gradient, in the program of the probes at fmt and group_size) and
  what `metric` needs (the optimizer where the hooks give it). weight_errors (where the hooks give probe_errors):
  the gradient and every weight-read unit's error from one instrumented backward, for a calibration whose units are
  all weight-read ones (then no probe compares against this program's gradient)."""
  dg = None
  if weight_errors and hooks.probe_errors is not None:
    with measuring():
      g, dg = hooks.probe_errors(ctx.params, batch, fmt, group_size)
    dg = np.asarray(dg)
  else:
    g = exact_gradient(hooks, ctx.params, batch, fmt, group_size)
  # the params only serve the optimizer's update: without one a reference would pin a params copy per minibatch
  # (0.5 GB each for SmolLM2; a bench that reads them back from disk holds dozens of references)
  upd = hooks.optimizer_update is not None and ctx.opt_state is not None
  return risk.Reference(g, float(norm(g)), metric, hooks.max_grad_norm, hooks.optimizer_update, ctx.opt_state,
                        ctx.params if upd else None, dg)


def gradient_error(hooks: StepHooks, params, batch, policies, exact=None) -> float:
  """The reference's error (relative for a bare gradient) of the gradient under `policies`."""
  ref = risk.as_reference(exact_gradient(hooks, params, batch) if exact is None else exact)
  with measuring():
    return ref.error(hooks.gradient(params, batch, tuple(policies)))


def probe_mix(num_layers: int, units, chosen) -> np.ndarray:
  """[layers, len(UNITS)] mix that makes exactly the `chosen` indices into `units` L."""
  mix = np.zeros((num_layers, len(U.UNITS)), np.float32)
  for i in chosen:
    layer, kind = units[i]
    mix[layer, U.UNITS.index(kind)] = 1.0
  return mix


def additive(units, metrics: Sequence[str]) -> bool:
  """Whether a set's error of `metrics` follows from its units' errors alone (set_error_of): every unit a
  WEIGHT_READS one and no optimizer update among the metrics (Adam's update of a sum is not the sum)."""
  return decomposable(units) and "update" not in metrics


def set_error_of(unit_err, sets) -> np.ndarray:
  """[len(sets), ...] each set's error from its units' errors alone (unit_err [U, ...], relative or clipped, one
  reference). For WEIGHT_READS units only: each one's L error lands on its own projections' weight gradients and
  nowhere else, so a set's error vector is its units' side by side, and its norm the root sum of their squares."""
  e = np.asarray(unit_err, np.float64)
  return np.stack([np.sqrt(np.sum(np.square(e[list(s)]), axis=0)) if len(s) else np.zeros(e.shape[1:])
                   for s in sets])


def set_errors(hooks: StepHooks, params, batch, units, sets, group_size: int, fmt: str = "int8",
               exact=None, metrics: Sequence[str] | None = None, combine: bool = True) -> np.ndarray:
  """[len(sets)] error with exactly each set (indices into units) L, measured, of the reference's metric (exact: a
  risk.Reference, or a bare gradient for the relative error); with metrics, [len(sets), len(metrics)]. Sets of
  WEIGHT_READS units only (and combine) take one decomposed probe for all of them (set_error_of), not one each."""
  ref = risk.as_reference(exact_gradient(hooks, params, batch, fmt, group_size) if exact is None else exact)
  n = hooks.model_cfg.num_hidden_layers
  union = sorted({int(i) for s in sets for i in s})
  if combine and union and additive([units[i] for i in union], metrics or (ref.metric,)):
    per = decomposed_unit_errors(hooks, params, batch, [units[i] for i in union], group_size, fmt, ref, metrics)
    at = {u: j for j, u in enumerate(union)}
    return set_error_of(per, [[at[int(i)] for i in s] for s in sets])
  out = []
  with measuring():
    for s in sets:
      g = hooks.probe_gradient(params, batch, probe_mix(n, units, s), fmt, group_size)
      out.append(ref.error(g) if metrics is None else [ref.errors(g, metrics)[m] for m in metrics])
  return np.array(out)


def measure_unit_errors(hooks: StepHooks, params, batch, units, group_size: int, fmt: str = "int8", exact=None,
                        layers: Sequence[int] | None = None, metrics: Sequence[str] | None = None,
                        decompose: bool = False) -> np.ndarray:
  """[U] true error of each unit alone as L (one probe gradient each; set_errors' reference and metrics); with
  `layers`, only units there are measured and every other unit's error is interpolated over depth from its kind's
  (interpolate_layers). With decompose, the WEIGHT_READS units are measured at every layer by one probe between
  them (decomposed_unit_errors), the others as above."""
  ref = risk.as_reference(exact_gradient(hooks, params, batch, fmt, group_size) if exact is None else exact)
  split = [i for i, (_, kind) in enumerate(units) if decompose and kind in WEIGHT_READS]
  chosen = [i for i, (layer, _) in enumerate(units) if i not in split and (layers is None or layer in layers)]
  width = 1 if metrics is None else len(metrics)
  measured = {}
  if chosen:
    errs = set_errors(hooks, params, batch, units, [[i] for i in chosen], group_size, fmt, ref, metrics,
                      combine=False)  # one probe per unit, as asked (decompose: the shortcut)
    measured.update(zip(chosen, errs.reshape(len(chosen), width)))
  if split:
    errs = decomposed_unit_errors(hooks, params, batch, [units[i] for i in split], group_size, fmt, ref, metrics)
    measured.update(zip(split, errs.reshape(len(split), width)))
  if len(measured) == len(units):
    out = np.stack([measured[i] for i in range(len(units))])
  else:
    out = np.stack([interpolate_layers(units, {tuple(units[i]): e[j] for i, e in measured.items()})
                    for j in range(width)], 1)
  return out[:, 0] if metrics is None else out


def decomposable(units) -> bool:
  """Whether every (layer, kind) of units is read by its projections' weight gradients alone (WEIGHT_READS)."""
  return all(kind in WEIGHT_READS for _, kind in units)


@functools.partial(jax.jit, static_argnums=2)
def _leaf_norms(g_all, exact, leaves):
  """Per layer and WEIGHT_READS kind, ||g_all - exact|| over that kind's leaves (decoder.weight_read_leaves, in
  WEIGHT_READS order): [layers, kinds]."""
  sq = lambda a, b: jnp.sum(jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)))
  rows = []
  for ga, ge in zip(g_all["layers"], exact["layers"]):
    rows.append(jnp.stack([jnp.sqrt(sum((sq(ga[b][n], ge[b][n]) for b, n in paths), jnp.float32(0)))
                           for paths in leaves]))
  return jnp.stack(rows)


def decomposed_unit_errors(hooks: StepHooks, params, batch, units, group_size: int, fmt: str = "int8", exact=None,
                           metrics: Sequence[str] | None = None) -> np.ndarray:
  """[U] each unit's error alone as L, as measure_unit_errors measures it with one probe gradient per unit, from a
  single probe with every unit L: each is a WEIGHT_READS unit, whose error reaches its own projections' weight
  gradients and nothing else, so that probe's difference from the reference on those weights is the unit's own
  (float rounding aside). The update metric needs the optimizer on each unit's gradient (one update per unit,
  no backward); relative and clipped read the norms alone."""
  if not decomposable(units):
    bad = sorted({k for _, k in units if k not in WEIGHT_READS})
    raise ValueError(f"units {bad} are read by more than their projections' weight gradients: measure them with "
                     f"one probe each (measure_unit_errors)")
  ref = risk.as_reference(exact_gradient(hooks, params, batch, fmt, group_size) if exact is None else exact)
  n = hooks.model_cfg.num_hidden_layers
  kinds = list(WEIGHT_READS)
  metrics_ = (ref.metric,) if metrics is None else tuple(metrics)
  if ref.weight_errors is not None and "update" not in metrics_:  # the reference's own backward measured them
    dg_LK = ref.weight_errors
  else:
    with measuring():
      g_all = hooks.probe_gradient(params, batch, probe_mix(n, units, range(len(units))), fmt, group_size)
      leaves = weight_read_leaves(hooks.model_cfg)
      dg_LK = np.asarray(_leaf_norms(g_all, ref.grad, tuple(leaves[k] for k in kinds)))
  out = []
  for layer, kind in units:
    dg = float(dg_LK[layer, kinds.index(kind)])
    row = {"relative": float(risk.relative(dg, ref.grad_norm)),
           "clipped": float(risk.clipped(dg, ref.grad_norm, ref.max_grad_norm))}
    if "update" in metrics_:
      g_u = jax.tree_util.tree_map(lambda x: x, ref.grad)  # a new tree with the exact leaves, but this unit's
      for blk, m in weight_read_leaves(hooks.model_cfg)[kind]:
        g_u["layers"][layer] = {**g_u["layers"][layer], blk: {**g_u["layers"][layer][blk],
                                                              m: g_all["layers"][layer][blk][m]}}
      row["update"] = ref.errors(g_u, ("update",))["update"]
    out.append(row[metrics_[0]] if metrics is None else [row[m] for m in metrics_])
  return np.array(out)


def calibration_rows(batch, rows: int):
  """The first `rows` rows of a minibatch (every field's leading axis; minibatches are shuffled, so a random
  subset), or the whole minibatch for rows 0 or more than it has."""
  n = jax.tree_util.tree_leaves(batch)[0].shape[0]
  if rows and rows < n and getattr(batch, "prompt_index", None) is not None:  # a shared prompt's table indexes
    batch = batch.replace(prompt_table=None, prompt_table_mask=None, prompt_index=None)  # all rows: unshare first
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


def lowp_policies(num_layers: int, chosen: Sequence[tuple[int, str]], group_size: int,
                  fmt: str = "int8") -> tuple[model.LayerPolicy, ...]:
  """Every activation kept except `chosen` units, which are L (nothing is recomputed)."""
  pols = list(model.uniform(num_layers, model.NO_REMAT))
  for layer in range(num_layers):
    lowp = tuple(k for l, k in chosen if l == layer)
    if lowp:
      pols[layer] = model.LayerPolicy(remat=False, lowp=lowp, formats=(fmt,) * len(lowp), group_size=group_size)
  return tuple(pols)
