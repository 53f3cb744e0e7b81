"""Mesh and the one table of PartitionSpecs (FSDP over 'fsdp', batch over 'data' x 'fsdp')."""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hilore_jax.errors import ConfigError

log = logging.getLogger(__name__)

DATA, FSDP = "data", "fsdp"
BATCH = P((DATA, FSDP))  # leading (batch) dim split over every device
REPLICATED = P()

# Param leaf name -> spec; shape letters in the names say which dim FSDP splits.
PARAM_RULES = {
    "embed_VD": P(FSDP, None),
    "lm_head_DV": P(FSDP, None),
    "wq_DNH": P(FSDP, None, None),
    "wk_DKH": P(FSDP, None, None),
    "wv_DKH": P(FSDP, None, None),
    "wo_NHD": P(None, None, FSDP),
    "wgate_DF": P(FSDP, None),
    "wup_DF": P(FSDP, None),
    "wdown_FD": P(None, FSDP),
}


def make_mesh(data: int = -1, fsdp: int = 1) -> Mesh:
  """A ('data', 'fsdp') mesh over all devices; data=-1 takes what fsdp leaves."""
  n = jax.device_count()
  if n % fsdp:
    raise ConfigError(f"mesh.fsdp={fsdp} does not divide the {n} devices")
  data = n // fsdp if data == -1 else data
  if data * fsdp != n:
    raise ConfigError(f"mesh data*fsdp = {data}*{fsdp} must equal the device count {n}")
  # Auto axes: GSPMD propagates shardings through the model (jax >= 0.10 defaults to Explicit)
  return jax.make_mesh((data, fsdp), (DATA, FSDP), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def param_spec(path, leaf, fsdp_size: int) -> P:
  """Spec of one param; a dim that fsdp does not divide is replicated instead."""
  name = getattr(path[-1], "key", None)
  spec = PARAM_RULES.get(name, REPLICATED)
  if spec and leaf.ndim == len(spec) + 1:  # the train layout's stacked layers: a leading layer axis
    spec = P(None, *spec)
  for dim, axis in enumerate(spec):
    if axis == FSDP and leaf.shape[dim] % fsdp_size:
      log.info("replicating %s %s: dim %d not divisible by fsdp=%d", name, leaf.shape, dim, fsdp_size)
      return REPLICATED
  return spec


def param_shardings(mesh: Mesh, params_shape) -> dict:
  fsdp = mesh.shape[FSDP]
  return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, param_spec(p, x, fsdp)), params_shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, BATCH)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, REPLICATED)


def num_batch_shards(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in (DATA, FSDP)]))


def gather_to_host(tree):
  """Numpy copies of a tree's global arrays; across processes a collective every process must join."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)
