"""LoGRA: Adam(W) on low-rank gradient sketches (GaLore-style) as an optax GradientTransformation.

Which leaves are sketched:
- `batch_axes(path)` (default: none) names leading axes that are a batch of matrices, e.g. a stacked layer axis:
  each matrix of the batch then gets its own projection.
- A leaf with >= 2 (non-batch) dims is viewed as a matrix [prod(shape[:k]), prod(shape[k:])], k the split that
  makes it most nearly square (ties: smallest k). For the model this gives wq_DNH -> [D, N*H], wk_DKH -> [D, K*H],
  wo_NHD -> [N*H, D], wgate_DF -> [D, F], wdown_FD -> [F, D]; any other pytree works by shape alone.
- The matrix is oriented so its smaller side M comes first ([M, N], M <= N); P [M, r] projects that side.
- Dense Adam(W) instead for: leaves with < 2 dims (norms, biases); leaves named in `dense_names` (embeddings,
  lm head: rows are tokens, a shared subspace does not fit them); matrices with M < rank (no rank-r basis) or
  M < min_dim. M == rank is sketched: P is then an orthogonal basis (no memory saved; the exactness check).

Sketched update: every `refresh_every` updates (counting from the first) P is refit from the current gradient G
with a randomized range finder (Gaussian test matrix with `oversample` extra columns, `power_iters` power
iterations, QR, then the top-r left singular vectors of the small sketch). R = P^T G [r, N]; Adam's moments live
in that r x N space; the weight's update is -lr * (scale * P @ adam(R) + weight_decay * W), decay as optax.adamw.

Moments on refresh are carried into the new basis with C = P_new^T P_old [r, r]: mu <- C mu (exact: the full-space
first moment's component in the new span) and nu <- (C*C) nu (the per-coordinate variance if the old coordinates
are uncorrelated). Both are exact when C is a signed permutation, so with r == M this is Adam(W) in the basis of
the gradient's singular vectors. Adam is elementwise, so that equals optax.adamw only when those vectors are
coordinate axes; for other gradients it is Adam in rotated coordinates, as GaLore.

State: float32 moments and P, a step count and the range finder's raw uint32 PRNG key (plain arrays: orbax
StandardSave and a host numpy round trip resume exactly). Per-refresh keys are fold_in(key, count) then leaf index.
init reads leaf shapes and names, so it works under jax.eval_shape but not with optax.tree_map_params' placeholder:
`state_shardings` derives the state's shardings from its own structure instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

DENSE_NAMES = ("embed_VD", "lm_head_DV")


class LograState(NamedTuple):
  """Adam moments (params-shaped for dense leaves, [r, N] for sketched ones) and P [M, r] (None when dense)."""

  count: jax.Array  # int32 [], updates done
  key: jax.Array  # uint32 [2], the range finder's key
  mu: Any
  nu: Any
  proj: Any


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """How one leaf is treated: its leading batch axes, its matrix split, whether it is transposed to [M, N], and its
  rank (0: dense). Sketched state carries one leading batch dimension Lb (1 when the leaf has no batch axes)."""

  shape: tuple[int, ...]
  split: int = 0
  transpose: bool = False
  rank: int = 0
  batch: int = 0  # leading batch axes (a stacked layer axis)

  @property
  def sketched(self) -> bool:
    return self.rank > 0

  @property
  def lb(self) -> int:
    return math.prod(self.shape[:self.batch])

  @property
  def mn(self) -> tuple[int, int]:
    inner = self.shape[self.batch:]
    rows, cols = math.prod(inner[:self.split]), math.prod(inner[self.split:])
    return (cols, rows) if self.transpose else (rows, cols)


def matrix_split(shape: tuple[int, ...]) -> int:
  """The k in 1..ndim-1 making [prod(shape[:k]), prod(shape[k:])] most nearly square (ties: smallest k)."""
  def skew(k):
    rows, cols = math.prod(shape[:k]), math.prod(shape[k:])
    return max(rows, cols) / max(min(rows, cols), 1)
  return min(range(1, len(shape)), key=skew)


def leaf_name(path) -> str:
  """The leaf's last dict key or attribute name ('' for sequence indices)."""
  last = path[-1] if path else None
  return str(getattr(last, "key", getattr(last, "name", "")))


def no_batch(path) -> int:
  """No leading batch axes (params["layers"] is a list of per-layer dicts)."""
  del path
  return 0


def leaf_plan(path, shape, rank: int, min_dim: int = 0, dense_names=DENSE_NAMES, batch_axes=no_batch) -> LeafPlan:
  """The module docstring's rule for one leaf."""
  shape = tuple(shape)
  batch = batch_axes(path)
  inner = shape[batch:]
  if len(inner) < 2 or leaf_name(path) in dense_names:
    return LeafPlan(shape)
  split = matrix_split(inner)
  rows, cols = math.prod(inner[:split]), math.prod(inner[split:])
  m = min(rows, cols)
  if m < rank or m < min_dim:
    return LeafPlan(shape)
  return LeafPlan(shape, split, rows > cols, rank, batch)


def to_matrix(x, plan: LeafPlan) -> jax.Array:
  """Leaf -> [Lb, M, N] float32 with M <= N."""
  rows = math.prod(plan.shape[plan.batch:][:plan.split])
  x = x.astype(jnp.float32).reshape(plan.lb, rows, -1)
  return x.swapaxes(1, 2) if plan.transpose else x


def from_matrix(x_LMN, plan: LeafPlan) -> jax.Array:
  return (x_LMN.swapaxes(1, 2) if plan.transpose else x_LMN).reshape(plan.shape)


def range_finder(g_MN, rank: int, key, oversample: int = 8, power_iters: int = 2) -> jax.Array:
  """Orthonormal P [M, rank] spanning g's top-rank left singular vectors (randomized SVD, Halko et al.)."""
  M, N = g_MN.shape
  width = min(rank + oversample, M)
  q = jnp.linalg.qr(g_MN @ jax.random.normal(key, (N, width), jnp.float32))[0]
  for _ in range(power_iters):  # re-orthonormalised each half step so small singular values survive float32
    q = jnp.linalg.qr(g_MN @ jnp.linalg.qr(g_MN.T @ q)[0])[0]
  u = jnp.linalg.svd(q.T @ g_MN, full_matrices=False)[0]
  return q @ u[:, :rank]


def logra(learning_rate: float | optax.Schedule, rank: int, refresh_every: int, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 0.0, scale: float = 1.0, seed: int = 0, oversample: int = 8,
          power_iters: int = 2, min_dim: int = 0, dense_names: tuple[str, ...] = DENSE_NAMES,
          batch_axes=no_batch) -> optax.GradientTransformation:
  """AdamW whose matrix moments live in a rank-`rank` subspace refit every `refresh_every` updates."""
  if rank < 1 or refresh_every < 1:
    raise ValueError(f"logra needs rank >= 1 and refresh_every >= 1, got rank={rank}, refresh_every={refresh_every}")

  def plans(tree):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [leaf_plan(path, x.shape, rank, min_dim, dense_names, batch_axes) for path, x in leaves], treedef

  def init(params):
    ps, treedef = plans(params)
    mom = [jnp.zeros((p.lb, p.rank, p.mn[1]) if p.sketched else p.shape, jnp.float32) for p in ps]
    proj = [jnp.zeros((p.lb, p.mn[0], p.rank), jnp.float32) if p.sketched else None for p in ps]
    unflat = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
    return LograState(jnp.zeros([], jnp.int32), jax.random.PRNGKey(seed), unflat(mom), unflat(list(mom)),
                      unflat(proj))

  def update(grads, state, params=None):
    if weight_decay and params is None:
      raise ValueError("logra with weight_decay needs params in update()")
    ps, treedef = plans(grads)
    gs = treedef.flatten_up_to(grads)
    mats = [to_matrix(g, p) if p.sketched else None for g, p in zip(gs, ps)]
    old = tuple(treedef.flatten_up_to(t) for t in (state.proj, state.mu, state.nu))
    step_key = jax.random.fold_in(state.key, state.count)

    def refresh(old):
      out = tuple(list(t) for t in old)
      for i, (p, g_LMN) in enumerate(zip(ps, mats)):
        if p.sketched:
          keys = jax.random.split(jax.random.fold_in(step_key, i), p.lb)
          new_P = jax.vmap(lambda g, k, p=p: range_finder(g, p.rank, k, oversample, power_iters))(g_LMN, keys)
          c_LRR = jnp.einsum("lmr,lms->lrs", new_P, old[0][i])
          out[0][i] = new_P
          out[1][i] = jnp.einsum("lrs,lsn->lrn", c_LRR, old[1][i])
          out[2][i] = jnp.einsum("lrs,lsn->lrn", c_LRR * c_LRR, old[2][i])
      return out

    proj, mu, nu = jax.lax.cond(state.count % refresh_every == 0, refresh, lambda old: old, old)
    t = (state.count + 1).astype(jnp.float32)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    ws = treedef.flatten_up_to(params) if params is not None else [None] * len(gs)
    outs = []
    for i, (p, g, w) in enumerate(zip(ps, gs, ws)):
      r = jnp.einsum("lmr,lmn->lrn", proj[i], mats[i]) if p.sketched else g.astype(jnp.float32)
      mu[i] = (1 - b1) * r + b1 * mu[i]
      nu[i] = (1 - b2) * (r * r) + b2 * nu[i]
      u = (mu[i] / (1 - b1 ** t)) / (jnp.sqrt(nu[i] / (1 - b2 ** t)) + eps)
      if p.sketched:
        u = scale * from_matrix(jnp.einsum("lmr,lrn->lmn", proj[i], u), p)
      if weight_decay:
        u = u + weight_decay * w.astype(jnp.float32)
      outs.append((-lr * u).astype(g.dtype))
    unflat = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
    return unflat(outs), LograState(state.count + 1, state.key, unflat(mu), unflat(nu), unflat(proj))

  return optax.GradientTransformation(init, update)


def find_state(opt_state) -> LograState:
  """The LograState inside a (possibly chained) optax state."""
  found = [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda s: isinstance(s, LograState))
           if isinstance(s, LograState)]
  if len(found) != 1:
    raise ValueError(f"expected one LograState in the optimizer state, found {len(found)}")
  return found[0]


def _nbytes(x) -> int:
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def _sketched_leaves(state: LograState):
  """(mu, nu, P-or-None) per leaf; arrays or ShapeDtypeStructs (jax.eval_shape of init)."""
  treedef = jax.tree_util.tree_structure(state.mu)
  return zip(jax.tree_util.tree_leaves(state.mu), jax.tree_util.tree_leaves(state.nu),
             treedef.flatten_up_to(state.proj))


def state_bytes(state) -> dict[str, int]:
  """Optimizer-state bytes of the sketched leaves (moments + P), of Adam's moments for them, and of dense leaves."""
  state = find_state(state)
  out = {"logra/sketched_bytes": 0, "logra/sketched_adam_bytes": 0, "logra/dense_bytes": 0}
  for m, v, p in _sketched_leaves(state):
    if p is None:
      out["logra/dense_bytes"] += _nbytes(m) + _nbytes(v)
    else:
      out["logra/sketched_bytes"] += _nbytes(m) + _nbytes(v) + _nbytes(p)
      out["logra/sketched_adam_bytes"] += 2 * p.shape[0] * p.shape[1] * m.shape[2] * jnp.dtype(m.dtype).itemsize
  return out


def sketch_bytes(state, itemsize: int = 4) -> dict[str, int]:
  """Bytes a sampler receives per update if sent as sketches, vs the dense update.

  Per sketched leaf: the r x N factor every update (`logra/factor_bytes`) plus P [M, r] on refresh updates
  (`logra/sketch_bytes`); dense leaves whole in both. Weight decay is a scalar per leaf (W *= 1 - lr * wd).
  """
  state = find_state(state)
  factor = refresh = dense = 0
  for m, _, p in _sketched_leaves(state):
    full = math.prod(m.shape) if p is None else p.shape[0] * p.shape[1] * m.shape[2]
    factor += itemsize * (full if p is None else math.prod(m.shape))
    refresh += itemsize * (full if p is None else math.prod(m.shape) + math.prod(p.shape))
    dense += itemsize * full
  return {"logra/factor_bytes": factor, "logra/sketch_bytes": refresh, "logra/update_bytes": dense}


def state_shardings(state: LograState, param_shardings, replicated) -> LograState:
  """Shardings of a LograState (or its eval_shape): a dense leaf's moments take its param's sharding; the sketched
  state ([Lb, r, N] moments and P [M, r], about r/M of Adam's) and the scalars are replicated on every device."""
  treedef = jax.tree_util.tree_structure(state.mu)
  proj = treedef.flatten_up_to(state.proj)
  moments = treedef.unflatten([s if p is None else replicated
                               for s, p in zip(treedef.flatten_up_to(param_shardings), proj)])
  return LograState(replicated, replicated, moments, moments,
                    treedef.unflatten([None if p is None else replicated for p in proj]))
