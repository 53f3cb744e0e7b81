"""Memory methods behind `memory.policy`: each turns the same measured unit costs and budget into per-layer
policies. HiLoRe and faithful JAX re-creations ("-style") of the baselines it is compared against."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hilore_jax import model
from hilore_jax.config import MEMORY_POLICIES
from hilore_jax.errors import OffloadUnsupported
from hilore_jax.memory import allocator, costmodel
from hilore_jax.memory.allocator import H, L, O, R
from hilore_jax.memory.profile import Unit
from hilore_jax.model import codec
from hilore_jax.model import units as U

METHODS = MEMORY_POLICIES
CALIBRATED = ("greedy_bits", "adacc_style", "hilore")  # methods that need measured per-unit errors
# relative rounding step of each format against int8's (absmax/127): int4 absmax/7; bf16 ~2^-9 of the value
FORMAT_STEP = {"int4": 127 / 7, "int8": 1.0, "fp8_e4m3": 1.0, "bf16": 0.5}


@dataclasses.dataclass(frozen=True)
class Plan:
  """A method's decision: per-unit choices (layer-major, units.KINDS order), formats of L units, predictions."""

  choice: tuple[str, ...]
  formats: tuple[str | None, ...]
  bytes: int  # predicted activation bytes kept on top of full checkpointing
  time_s: float  # predicted rerun + codec seconds per microbatch
  risk: float  # predicted squared relative gradient error

  def fractions(self) -> dict[str, float]:
    n = max(len(self.choice), 1)
    return {f"frac_{c}": self.choice.count(c) / n for c in (H, L, R, O)}


def layers_of(unit_list: Sequence[Unit]) -> list[list[int]]:
  """Indices into unit_list, grouped by layer (in layer order)."""
  out: dict[int, list[int]] = {}
  for i, u in enumerate(unit_list):
    out.setdefault(u.layer, []).append(i)
  return [out[k] for k in sorted(out)]


def require_offload(what: str):
  """OffloadUnsupported unless this backend has a pinned_host memory kind (the one place it is raised)."""
  if not model.offload_supported():
    import jax

    raise OffloadUnsupported(f"{what} is unsupported on the {jax.default_backend()} backend: it needs a device with "
                             "its own memory and a pinned_host memory kind (GPU/TPU); use H, L or R here")


def policies(plan: Plan, unit_list: Sequence[Unit], num_layers: int, group_size: int,
             method: str = "") -> tuple[model.LayerPolicy, ...]:
  """Per-layer LayerPolicy for a plan (none: no remat at all)."""
  if method == "none":
    return (model.NO_REMAT,) * num_layers
  if O in plan.choice:
    require_offload(f"offloading {sorted({u.kind for u, c in zip(unit_list, plan.choice) if c == O})} (O)")
  save = [[] for _ in range(num_layers)]
  lowp = [[] for _ in range(num_layers)]
  fmts = [[] for _ in range(num_layers)]
  off = [[] for _ in range(num_layers)]
  for u, c, f in zip(unit_list, plan.choice, plan.formats):
    if c == H:
      save[u.layer].append(u.kind)
    elif c == L:
      lowp[u.layer].append(u.kind)
      fmts[u.layer].append(f)
    elif c == O:
      off[u.layer].append(u.kind)
  return tuple(model.LayerPolicy(remat=True, save=tuple(s), lowp=tuple(l), formats=tuple(f), offload=tuple(o),
                                 group_size=group_size) for s, l, f, o in zip(save, lowp, fmts, off))


def evaluate(choice: Sequence[str], unit_list: Sequence[Unit], op_s: dict,
             risk_of: dict | None = None) -> tuple[int, float, float]:
  """(bytes, seconds, risk) of a per-unit choice under the dataflow cost model."""
  b = t = r = 0.0
  risk_of = risk_of or {}
  for idx in layers_of(unit_list):
    layer_units = [unit_list[i] for i in idx]
    ch = {unit_list[i].kind: choice[i] for i in idx}
    b += costmodel.choice_bytes(ch, layer_units)
    t += costmodel.choice_time(ch, op_s, layer_units)
    r += sum(risk_of.get((unit_list[i].layer, unit_list[i].kind), 0.0) for i in idx if choice[i] == L)
  return int(b), float(t), float(r)


def _plan(choice, unit_list, op_s, risk_of=None, fmt="int8") -> Plan:
  b, t, r = evaluate(choice, unit_list, op_s, risk_of)
  return Plan(tuple(choice), tuple(fmt if c == L else None for c in choice), b, t, r)


def layer_groups(unit_list, op_s, risk_of: dict, allow_l: bool, allow_o: bool) -> list[list[allocator.Option]]:
  """Per layer, the Pareto options of the dataflow cost model with L risks from risk_of[(layer, kind)]."""
  groups = []
  for idx in layers_of(unit_list):
    layer_units = [unit_list[i] for i in idx]
    cands = costmodel.candidates(layer_units, op_s, allow_l, allow_o)
    groups.append(costmodel.layer_options(cands, {u.kind: risk_of.get((u.layer, u.kind), 0.0) for u in layer_units}))
  return groups


def plan(method: str, unit_list: Sequence[Unit], op_s: dict, extra_bytes: int, *, risk_of: dict | None = None,
         delta: float = 0.0, fmt: str = "int8", allow_o: bool = False, sensitivity: dict | None = None,
         group_size: int = 64, solver: str = "greedy") -> Plan:
  """The method's plan for `extra_bytes` of activation memory on top of full checkpointing.

  risk_of: predicted squared error of each (layer, kind) as L (hilore: at this bucket's exposure; adacc_style:
  static). sensitivity: measured int8 error per (layer, kind) (greedy_bits). solver: greedy or exact (hilore).
  """
  if method not in METHODS:
    raise ValueError(f"unknown memory.policy {method!r}; choose one of {list(METHODS)}")
  n = len(unit_list)
  if method == "none":
    return _plan((H,) * n, unit_list, op_s)
  if method == "gc":
    return _plan((R,) * n, unit_list, op_s)
  if method == "sac":
    # a 0/1 knapsack of matmul outputs valued by their own op's time, as PyTorch's SAC optimizer does (it does not
    # know which other tensors backward will still have to recompute)
    idx = [i for i, u in enumerate(unit_list) if u.kind in U.MATMUL_UNITS]
    costs = [allocator.UnitCost(str(i), unit_list[i].bytes_h, None, unit_list[i].recompute_s) for i in idx]
    picked = allocator.exact(allocator.per_unit(costs), extra_bytes, 0.0).choice
    choice = [R] * n
    for i, c in zip(idx, picked):
      choice[i] = c
    return _plan(choice, unit_list, op_s)
  if method == "optimal_hr":
    groups = layer_groups(unit_list, op_s, {}, allow_l=False, allow_o=allow_o)
    return _plan(allocator.exact(groups, extra_bytes, 0.0).choice, unit_list, op_s)
  if method == "uniform_int8":
    # every unit that can be compressed is, in every layer that fits; the rest is recomputed
    choice, used = [R] * n, 0
    for idx in layers_of(unit_list):
      lowp = [i for i in idx if unit_list[i].bytes_l is not None]
      need = sum(unit_list[i].bytes_l for i in lowp)
      if used + need <= extra_bytes:
        used += need
        for i in lowp:
          choice[i] = L
    return _plan(choice, unit_list, op_s, fmt="int8")
  if method == "greedy_bits":
    return _greedy_bits(unit_list, op_s, extra_bytes, sensitivity or {},
                        lambda u, f: codec.code_bytes(u.shape, group_size, f))
  risk_of = risk_of or {}
  groups = layer_groups(unit_list, op_s, risk_of, allow_l=True, allow_o=allow_o)
  if method == "adacc_style":
    return _plan(allocator.exact(groups, extra_bytes, delta).choice, unit_list, op_s, risk_of, fmt)
  solve = allocator.exact if solver == "exact" else allocator.greedy
  return _plan(solve(groups, extra_bytes, delta).choice, unit_list, op_s, risk_of, fmt)


def _greedy_bits(unit_list, op_s, extra_bytes, sensitivity, code_bytes) -> Plan:
  """GACT-style: every compressible unit gets a bit width in {4, 8, 16}, starting at 4 and upgrading the unit with
  the largest drop in predicted gradient variance per extra byte while memory lasts; the rest is recomputed.
  Layers whose 4-bit codes do not fit stay fully recomputed."""
  ladder = ("int4", "int8", "bf16")
  idx = [i for i, u in enumerate(unit_list) if u.bytes_l is not None]
  fmt = {i: None for i in idx}
  used = 0
  for idx in layers_of(unit_list):
    ids = [i for i in idx if unit_list[i].bytes_l is not None]
    need = sum(code_bytes(unit_list[i], "int4") for i in ids)
    if used + need <= extra_bytes:
      used += need
      fmt.update({i: "int4" for i in ids})
  var = lambda i, f: (sensitivity.get((unit_list[i].layer, unit_list[i].kind), 1.0) * FORMAT_STEP[f]) ** 2
  while True:
    best, best_gain = None, 0.0
    for i, f in fmt.items():
      if f is None or f == ladder[-1]:
        continue
      nf = ladder[ladder.index(f) + 1]
      extra = code_bytes(unit_list[i], nf) - code_bytes(unit_list[i], f)
      if used + extra > extra_bytes:
        continue
      gain = (var(i, f) - var(i, nf)) / max(extra, 1)
      if gain > best_gain:
        best, best_gain = (i, nf, extra), gain
    if best is None:
      break
    i, nf, extra = best
    fmt[i], used = nf, used + extra
  choice = [L if fmt.get(i) else R for i in range(len(unit_list))]
  formats = [fmt.get(i) for i in range(len(unit_list))]
  _, t, _ = evaluate(choice, unit_list, op_s)
  risk = float(sum(var(i, f) for i, f in fmt.items() if f))
  return Plan(tuple(choice), tuple(formats), int(used), t, risk)
