"""L units: the op that reads a tensor in backward keeps it only as a low-precision code (a custom-VJP residual),
and its backward runs on the decoded tensor everywhere it needs it (nonlinearity, norm or softmax derivative and
weight gradients), so neither an exact copy nor a recompute of the tensor's producer is needed.

Each read spec (`Keep`) says how one input of such an op is kept: exact (a plain residual that the layer's remat
policy saves or recomputes under its checkpoint name) or as a code. A probe keeps both and mixes them in backward
by a run-time weight, so calibration measures any set of L units with one compiled program.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from hilore_jax.model import codec

# the attention math itself lives with the kernels; this module adds only what backward reads from codes
from hilore_jax.model.attention import attention_context as context
from hilore_jax.model.attention import attention_probs as probs
from hilore_jax.model.attention import attention_scores as scores
from hilore_jax.model.units import ATTN_PROBS, UNITS, code_names


class Keep(NamedTuple):
  """How an L input is kept: its unit name, codec format, group size, last-axis size and dtype; probe: also exact."""

  unit: str
  fmt: str
  group_size: int
  size: int
  dtype: str
  probe: bool = False


def keep_of(unit: str, x: jax.Array, fmt: str, group_size: int, probe: bool = False) -> Keep:
  return Keep(unit, fmt, group_size, x.shape[-1], jnp.dtype(x.dtype).name, probe)


def _encode(x, k: Keep):
  codes, scale = codec.encode(x, k.fmt, k.group_size)
  cname, sname = code_names(k.unit)
  # named so a save_only_these_names policy keeps exactly these (and not the float x) for backward
  return (checkpoint_name(codes, cname), checkpoint_name(scale, sname)) + ((x,) if k.probe else ())


def _decoded(res, k: Keep):
  return codec.decode(res[0], res[1], res[0].shape[:-2] + (k.size,), jnp.dtype(k.dtype), k.fmt)


def _decode(res, k: Keep, mix):
  x_hat = _decoded(res, k)
  if k.probe:  # mix 0: the exact tensor, 1: its decoded code
    x = res[2]
    x_hat = x + _mix_of(mix).astype(x.dtype) * (x_hat - x)
  return x_hat


def _mix_of(mix):
  """A probe's mix weight: the mix itself, or the first of (mix, error channel) (probe_errors)."""
  return mix[0] if isinstance(mix, tuple) else mix


def _fwd_res(args, keeps):
  return tuple(a if k is None else _encode(a, k) for a, k in zip(args, keeps))


def _bwd_args(res, keeps, mixes):
  return tuple(r if k is None else _decode(r, k, m) for r, k, m in zip(res, keeps, mixes))


def _zero_mixes(mixes):
  return tuple(None if m is None else jax.tree_util.tree_map(jnp.zeros_like, m) for m in mixes)


def _error_channels(fn, res, keeps, mixes, args, ct) -> tuple:
  """The mixes' cotangents: zero, but where a probe's mix is (mix, channel), the channel's cotangent is what the
  other arguments' cotangents would be were this input its L error alone (decoded - exact, at any mix): for a
  projection, the error its code puts into the weight gradients, e^T ct (fn is linear in it); under LoRA, x A's
  (model/lora.py), into the A gradients."""
  out = []
  for i, (r, k, m) in enumerate(zip(res, keeps, mixes)):
    if not isinstance(m, tuple):
      out.append(None if m is None else jnp.zeros_like(m))
      continue
    e = _decoded(r, k) - r[2]
    _, vjp = jax.vjp(fn, *args[:i], e, *args[i + 1:])
    cts = vjp(ct)
    out.append((jnp.zeros_like(m[0]), tuple(c.astype(w.dtype) for c, w in zip(cts[:i] + cts[i + 1:], m[1]))))
  return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def apply(fn: Callable, keeps: tuple, args: tuple, mixes: tuple):
  """fn(*args) exactly; backward is fn's VJP at the args as kept (`keeps[i]` None: exact, else a Keep)."""
  return fn(*args)


def _apply_fwd(fn, keeps, args, mixes):
  return fn(*args), (_fwd_res(args, keeps), mixes)


def _apply_bwd(fn, keeps, res, ct):
  res, mixes = res
  args = _bwd_args(res, keeps, mixes)
  _, vjp = jax.vjp(fn, *args)
  return tuple(vjp(ct)), _error_channels(fn, res, keeps, mixes, args, ct)


apply.defvjp(_apply_fwd, _apply_bwd)


def project(x, weights: tuple, specs: tuple[str, ...], keep: Keep, mix=None):
  """(einsum(spec_i, x, w_i) for each weight) with x read in backward (weight gradients) from its code.

  One unit may feed several projections (q/k/v, gate/up): it is quantized once.
  """
  fn = lambda x, *ws: tuple(jnp.einsum(s, x, w.astype(x.dtype)) for s, w in zip(specs, ws))
  return apply(fn, (keep,) + (None,) * len(weights), (x,) + tuple(weights), (mix,) + (None,) * len(weights))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention(q, k, v, mask_BTS, keeps: tuple, mixes: tuple):
  """Attention context of q [B,T,N,H], k, v [B,S,K,H] whose backward reads q, k, v and the probabilities as kept
  (keeps for q, k, v, probs: None exact, else a Keep); exact probabilities are named so a remat policy keeps (H)
  or recomputes (R) them."""
  return context(probs(q, k, mask_BTS), v)


def _attention_fwd(q, k, v, mask_BTS, keeps, mixes):
  p = probs(q, k, mask_BTS)
  ctx = context(p, v)
  kp = keeps[3]
  res = _fwd_res((q, k, v), keeps[:3]) + (checkpoint_name(p, ATTN_PROBS) if kp is None else _encode(p, kp),)
  return ctx, (res, mask_BTS, mixes)


def _attention_bwd(keeps, res, dctx):
  res, mask_BTS, mixes = res
  q, k, v, p = _bwd_args(res, keeps, mixes)
  _, pv_vjp = jax.vjp(context, p, v)
  dprobs, dv = pv_vjp(dctx)
  p32, dp32 = p.astype(jnp.float32), dprobs.astype(jnp.float32)
  dscores = p32 * (dp32 - jnp.sum(dp32 * p32, axis=-1, keepdims=True))  # softmax derivative at the kept probs
  _, s_vjp = jax.vjp(scores, q, k)
  dq, dk = s_vjp(jnp.where(mask_BTS[:, None, None], dscores, 0.0))
  zero_mask = np.zeros(mask_BTS.shape, jax.dtypes.float0)  # the mask is boolean: no cotangent
  return dq, dk, dv, zero_mask, _zero_mixes(mixes)


attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- the decoder's L reads


def keeper(policy, probe):
  """(unit, its tensor's last-axis size, dtype) -> (Keep or None, probe mix or None) for one layer: from the
  layer's LayerPolicy, or for every unit from probe=(format, group size, mix [len(UNITS)])."""
  def keep(unit: str, size: int, dtype):
    if probe is not None:
      fmt, group_size, mix_U = probe
      k = Keep(unit, fmt, group_size, size, jnp.dtype(dtype).name, True)
      if isinstance(mix_U, dict):  # {"mix": [len(UNITS)], "channels": {unit: zeros like its weights}}
        m = mix_U["mix"][UNITS.index(unit)]
        return k, ((m, mix_U["channels"][unit]) if unit in mix_U["channels"] else m)
      return k, mix_U[UNITS.index(unit)]
    if policy is not None and unit in policy.lowp:
      return Keep(unit, policy.format_of(unit), policy.group_size, size, jnp.dtype(dtype).name), None
    return None, None
  return keep


def projections(proj: Callable, x, km: tuple, ws: tuple, bs: tuple, specs: tuple):
  """proj(x, w_i, b_i, spec_i) for each weight; through `project` when x is L (km: its keep and mix)."""
  keep, mix = km
  if keep is None:
    return tuple(proj(x, w, b, s) for w, b, s in zip(ws, bs, specs))
  ys = project(x, ws, specs, keep, mix)
  return tuple(y if b is None else y + b.astype(y.dtype) for y, b in zip(ys, bs))


def norm(rms_norm: Callable, x_BTD, w_D, eps: float, km: tuple):
  """rms_norm(x, w, eps), its backward reading x from the code when x is L."""
  if km[0] is None:
    return rms_norm(x_BTD, w_D, eps)
  return apply(lambda x, w: rms_norm(x, w, eps), (km[0], None), (x_BTD, w_D), (km[1], None))
