"""Memory methods behind `memory.policy`: each turns the same measured unit costs and budget into per-layer
policies. HiLoRe and faithful JAX re-creations ("-style") of the baselines it is compared against."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from hilore_jax import model
from hilore_jax.errors import OffloadUnsupported
from hilore_jax.memory import allocator, costmodel
from hilore_jax.memory.allocator import H, L, O, R
from hilore_jax.memory.config import MEMORY_POLICIES
from hilore_jax.memory.profile import Unit
from hilore_jax.model import codec
from hilore_jax.model import units as U



@dataclasses.dataclass(frozen=True)
class Method:
  """What the trainer and the manager know of a memory method, so that neither names one."""

  name: str
  fixed: model.LayerPolicy | None = None  # every layer's policy where the method plans nothing (no manager)
  calibrated: bool = False  # plans need measured per-unit errors
  solved: bool = False  # one exact solver over the layer graph's options
  # its options without L, whose own budget fit the method's plan must never be slower than (budget.no_slower_than)
  risk_free_subset: str | None = None
  exposure: bool = False  # scores each minibatch's exposure at run time: reallocated on every later pass


REGISTRY = {m.name: m for m in (
    Method("none", fixed=model.NO_REMAT), Method("gc", fixed=model.FULL_REMAT), Method("sac"),
    Method("optimal_hr", solved=True), Method("uniform_int8"), Method("uniform_int8_gc"),
    Method("greedy_bits", calibrated=True), Method("greedy_bits_gc", calibrated=True),
    Method("hilore_static", calibrated=True, solved=True, risk_free_subset="optimal_hr"),
    Method("hilore", calibrated=True, solved=True, risk_free_subset="optimal_hr", exposure=True))}
assert tuple(REGISTRY) == MEMORY_POLICIES, "every memory.policy has one record"
METHODS = MEMORY_POLICIES
CALIBRATED = tuple(n for n, m in REGISTRY.items() if m.calibrated)
SOLVED = tuple(n for n, m in REGISTRY.items() if m.solved)
RISK_FREE_SUBSET = {n: m.risk_free_subset for n, m in REGISTRY.items() if m.risk_free_subset}
# SAC-style named save policies (what jax.checkpoint_policies / PyTorch SAC users write by hand): the best of the
# grid that fits, applied to as many layers as fit (the rest fully recomputed)
SAC_GRID = {
    "attn_out": (U.ATTN_CTX,),
    "qkv": (U.Q, U.K, U.V),
    "qkv+attn_out": (U.Q, U.K, U.V, U.ATTN_CTX),
    "attention": (U.Q, U.K, U.V, U.ATTN_PROBS, U.ATTN_CTX),
    "mlp": (U.MLP_GATE, U.MLP_UP),
    "matmuls": U.MATMUL_UNITS,
    "all_but_probs": tuple(u for u in U.UNITS if u != U.ATTN_PROBS),
    "everything": U.UNITS,
}
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
  """Per-layer LayerPolicy for a plan (none: no remat at all). Every other plan runs each layer under a name
  policy, even where nothing is recomputed: without remat autodiff also keeps what the cost model does not count
  (norm statistics, normalised inputs, RoPE tables), 20-100% more than the plan's units on the tiny configs."""
  if method == "none":
    return (model.NO_REMAT,) * num_layers
  if O in plan.choice:
    require_offload(f"offloading {sorted({u.kind for u, c in zip(unit_list, plan.choice) if c == O})} (O)")
  per = [{"save": [], "lowp": [], "fmts": [], "off": []} for _ in range(num_layers)]
  for u, c, f in zip(unit_list, plan.choice, plan.formats):
    d = per[u.layer]
    if c == H and u.kind not in U.BOUNDARY:
      d["save"].append(u.kind)
    elif c == L:
      d["lowp"].append(u.kind)
      d["fmts"].append(f)
    elif c == O:
      d["off"].append(u.kind)
  return tuple(model.LayerPolicy(remat=True, save=tuple(d["save"]), lowp=tuple(d["lowp"]), formats=tuple(d["fmts"]),
                                 offload=tuple(d["off"]), group_size=group_size) for d in per)


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
  """Per layer, the Pareto options of the dataflow cost model with L risks from risk_of[(layer, kind)]; memoised:
  a bucket's budget fit, its greedy gap and its active-constraint check solve over the same options."""
  return _layer_groups(tuple(unit_list), tuple(sorted(op_s.items())), tuple(sorted((risk_of or {}).items())),
                       allow_l, allow_o)


@functools.lru_cache(maxsize=32)
def _layer_groups(unit_list: tuple, op_items: tuple, risk_items: tuple, allow_l: bool, allow_o: bool):
  op_s, risk_of, layers = dict(op_items), dict(risk_items), []
  for idx in layers_of(unit_list):
    layer_units = [unit_list[i] for i in idx]
    risk = {u.kind: risk_of.get((u.layer, u.kind), 0.0) for u in layer_units}
    cands = costmodel.candidates(layer_units, op_s, allow_l, allow_o)
    layers.append((cands, risk, costmodel.layer_options(cands, risk)))
  # a choice any layer keeps stays in every layer: a run of layers shares one choice, and one pruned from a layer
  # (dominated at that layer's risks) could not carry a run through it; where every layer keeps the same choices
  # (equal risks) nothing is added
  kept = {o.choice for *_, opts in layers for o in opts}
  groups = []
  for cands, risk, opts in layers:
    have = {o.choice: o for o in opts}
    groups.append(tuple(have.get(c.choice) or allocator.Option(c.choice, c.bytes, c.time_s,
                                                               float(sum(risk.get(k, 0.0) for k in c.lowp)))
                        for c in cands if c.choice in kept))
  return tuple(groups)  # shared by every caller: immutable


def plan(method: str, unit_list: Sequence[Unit], op_s: dict, extra_bytes: int, *, risk_of: dict | None = None,
         delta: float = 0.0, fmt: str = "int8", allow_o: bool = False, sensitivity: dict | None = None,
         group_size: int = 64, solver: str = "exact", mip_gap: float = 1e-4, max_runs: int = 0,
         mip_time_limit_s: float = 0.0) -> Plan:
  """The method's plan for `extra_bytes` of activation memory on top of full checkpointing.

  risk_of: predicted relative gradient error of each (layer, kind) as L (hilore: at this bucket's exposure;
  hilore_static: static), summed over a plan's L units against the budget delta. sensitivity: measured error per
  (layer, kind) (greedy_bits). solver: exact (the MILP, every solved method, to a proven relative gap mip_gap)
  or greedy (the run-time fast path); mip_time_limit_s > 0 bounds the MILP's seconds (allocator.exact). max_runs > 0:
  a solved method's plan has at most that many runs of consecutive layers with one policy (each compiles once, as a
  layer scan: allocator.exact's run constraint).
  """
  if method not in METHODS:
    raise ValueError(f"unknown memory.policy {method!r}; choose one of {list(METHODS)}")
  n = len(unit_list)
  if method == "none":
    return _plan((H,) * n, unit_list, op_s)
  if method == "gc":
    return _plan((R,) * n, unit_list, op_s)
  if method == "sac":
    return _sac(unit_list, op_s, extra_bytes)
  if method in ("uniform_int8", "uniform_int8_gc"):
    return _uniform(unit_list, op_s, extra_bytes, method.endswith("_gc"),
                    lambda u, f: _code_bytes(u, f, group_size), fmt)
  if method in ("greedy_bits", "greedy_bits_gc"):
    return _greedy_bits(unit_list, op_s, extra_bytes, sensitivity or {}, lambda u, f: _code_bytes(u, f, group_size),
                        method.endswith("_gc"))
  risk_of = {} if method == "optimal_hr" else (risk_of or {})
  groups = layer_groups(unit_list, op_s, risk_of, allow_l=method != "optimal_hr", allow_o=allow_o)
  found = (allocator.exact(groups, extra_bytes, delta, mip_gap, max_runs, mip_time_limit_s) if solver == "exact" else
           allocator.greedy(groups, extra_bytes, delta, max_runs))
  return _plan(found.choice, unit_list, op_s, risk_of, fmt)


def _code_bytes(u: Unit, f: str, group_size: int) -> int:
  """Bytes of u as a code in format f on top of full checkpointing (negative for the layer input it replaces)."""
  return codec.code_bytes(u.shape, group_size, f) - (u.bytes_h if u.kind in U.BOUNDARY else 0)


def _gc_choice(unit_list) -> list[str]:
  """Full checkpointing (the layer boundary's R: kept exactly as the checkpointed layer's argument)."""
  return [R] * len(unit_list)


def _sac(unit_list, op_s, extra_bytes) -> Plan:
  """The fastest (by the cost model) named save policy of SAC_GRID on the most layers that fit, the rest R."""
  best = _plan(_gc_choice(unit_list), unit_list, op_s)
  for names in SAC_GRID.values():
    choice = _gc_choice(unit_list)
    for idx in layers_of(unit_list):
      trial = list(choice)
      for i in idx:
        if unit_list[i].kind in names:
          trial[i] = H
      if evaluate(trial, unit_list, op_s)[0] > extra_bytes:
        break
      choice = trial
    cand = _plan(choice, unit_list, op_s)
    if cand.time_s < best.time_s:
      best = cand
  return best


def _uniform(unit_list, op_s, extra_bytes, with_gc: bool, code_bytes, fmt: str = "int8") -> Plan:
  """GACT/ALAM-style: every unit of a layer in one low-precision format (memory.lowp_format, int8 unless set;
  nothing recomputed there); with_gc: only in the layers that fit, the rest fully recomputed; without: every
  layer, whatever the budget (the budget fit then falls back to GC)."""
  choice, used = _gc_choice(unit_list), 0
  for idx in layers_of(unit_list):
    need = sum(code_bytes(unit_list[i], fmt) for i in idx)
    if with_gc and used + need > extra_bytes:
      continue
    used += need
    for i in idx:
      choice[i] = L
  return Plan(tuple(choice), tuple(fmt if c == L else None for c in choice), int(used),
              evaluate(choice, unit_list, op_s)[1], 0.0)


def _greedy_bits(unit_list, op_s, extra_bytes, sensitivity, code_bytes, with_gc: bool) -> Plan:
  """GACT-style: every unit gets a bit width in {4, 8, 16}, starting at 4 and upgrading the unit with the largest
  drop in predicted gradient variance per extra byte while memory lasts. with_gc: layers whose 4-bit codes do not
  fit stay fully recomputed; without: every layer starts at 4 bits, whatever the budget."""
  ladder = ("int4", "int8", "bf16")
  fmt: dict[int, str | None] = {i: None for i in range(len(unit_list))}
  used = 0
  for idx in layers_of(unit_list):
    need = sum(code_bytes(unit_list[i], "int4") for i in idx)
    if not with_gc or used + need <= extra_bytes:
      used += need
      fmt.update({i: "int4" for i in idx})
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
  choice = [L if fmt[i] else c for i, c in enumerate(_gc_choice(unit_list))]
  formats = [fmt[i] for i in range(len(unit_list))]
  _, t, _ = evaluate(choice, unit_list, op_s)
  risk = float(np.sqrt(sum(var(i, f) for i, f in fmt.items() if f)))
  return Plan(tuple(choice), tuple(formats), int(used), t, risk)


def active_constraint(method: str, unit_list, extra_bytes: int, chosen: Plan, plan_for, rtol: float = 1e-6) -> str:
  """Which budget binds the chosen plan: memory if more bytes would give a faster plan, risk if a looser risk
  budget would (solved methods); both, or none. plan_for(extra_bytes, delta=None): the method's plan (delta None:
  its own risk budget); rtol: how much faster counts (at least the solver's proven gap, or noise would decide)."""
  if method in ("none", "gc"):
    return "none"
  total = sum(max(u.bytes_h, u.bytes_l or 0) for u in unit_list)
  faster = lambda p: p.time_s < chosen.time_s * (1 - rtol) - 1e-12
  mem = faster(plan_for(max(total * 4, extra_bytes + 1)))
  risk = method in ("hilore_static", "hilore") and faster(plan_for(extra_bytes, float("inf")))
  return "both" if mem and risk else "memory" if mem else "risk" if risk else "none"
