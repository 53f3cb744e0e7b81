"""The optimised HLO of a compiled program, read for what runs as thunks on XLA:CPU: every instruction of the
entry computation and of the loops' bodies and conditions (not fusions' insides), with its category (a fusion
holding a dot or convolution is a matmul) and an estimate of the bytes one execution reads and writes."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

CATEGORIES = ("matmul", "elementwise", "copy", "custom_call", "loop", "other")
MATMUL_OPS = {"dot", "convolution"}
LOOP_OPS = {"while", "conditional", "call"}
# data movement: what a fusion of only these does is read and write memory
MOVE_OPS = {"copy", "transpose", "bitcast", "reshape", "broadcast", "slice", "dynamic-slice", "dynamic-update-slice",
            "concatenate", "pad", "reverse", "gather", "scatter", "iota", "copy-start", "copy-done"}
STRUCTURE_OPS = {"parameter", "constant", "get-tuple-element", "tuple"}
OTHER_OPS = {"sort", "rng", "rng-bit-generator", "rng-get-and-update-state", "all-reduce", "all-gather",
             "reduce-scatter", "all-to-all", "collective-permute", "infeed", "outfeed", "send", "recv", "after-all",
             "partition-id", "replica-id"}
ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
              "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "token": 0}
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class HloOp:
  """One instruction of the program's non-fused computations: what runs as a thunk."""

  name: str
  opcode: str
  category: str
  bytes: float  # an estimate of what one execution reads and writes, from the HLO shapes (_op_bytes)
  fused: tuple[str, ...] = ()  # opcodes inside a fusion (and the computations those call)


@dataclasses.dataclass(frozen=True)
class _Instr:
  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  root: bool


def _balanced(text: str, start: int) -> int:
  """Index just past the parenthesis that closes the one at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def _parse_instr(line: str) -> _Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  rest = m.group(3)
  end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  op = re.match(r"\s*([a-z][\w\-]*)\(", rest[end:])
  if end < 0 or not op:
    return None
  open_at = end + op.end() - 1
  close = _balanced(rest, open_at)
  return _Instr(m.group(2), rest[:end], op.group(1), tuple(re.findall(r"%([\w.\-]+)", rest[open_at:close])),
                rest[close:], bool(m.group(1)))


def parse_hlo(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
  """(computation name -> its instructions, the entry computation's name) of an HLO module's text."""
  comps: dict[str, list[_Instr]] = {}
  entry, current = None, None
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h:
      current = h.group(2)
      comps[current] = []
      entry = current if h.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      ins = _parse_instr(line)
      if ins is not None:
        comps[current].append(ins)
  return comps, entry


def shape_bytes(type_str: str) -> float:
  """Bytes of an HLO type (an array or a tuple of arrays)."""
  return float(sum(ITEM_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
                   for dt, dims in _ARRAY.findall(type_str)))


def _called(ins: _Instr) -> list[str]:
  return re.findall(r"(?:calls|to_apply|condition|body|true_computation|false_computation)=%([\w.\-]+)",
                    ins.attrs) + re.findall(r"%([\w.\-]+)", " ".join(re.findall(r"branch_computations=\{([^}]*)\}",
                                                                                  ins.attrs)))


def _opcodes(comps: dict, name: str, seen: set | None = None) -> set[str]:
  """Opcodes of a computation and of every computation it calls."""
  seen = set() if seen is None else seen
  if name in seen or name not in comps:
    return set()
  seen.add(name)
  out = set()
  for ins in comps[name]:
    out.add(ins.opcode)
    for c in _called(ins):
      out |= _opcodes(comps, c, seen)
  return out


def category(opcode: str, fused: set[str] = frozenset(), target: str = "") -> str:
  """matmul (a dot or convolution, alone or fused), elementwise (elementwise and reductions), copy (data movement
  alone), custom_call, loop (a while, conditional or call: its own control time) or other."""
  if opcode in LOOP_OPS:
    return "loop"
  ops = set(fused) if opcode == "fusion" else {opcode}
  if ops & MATMUL_OPS or (opcode == "custom-call" and re.search(r"matmul|gemm|dot|conv", target, re.I)):
    return "matmul"
  if opcode == "custom-call":
    return "custom_call"
  if opcode in OTHER_OPS or (ops & OTHER_OPS):
    return "other"
  return "copy" if ops - STRUCTURE_OPS <= MOVE_OPS else "elementwise"


def _strip(comp: list[_Instr], ins: _Instr) -> _Instr:
  """ins, looking through bitcasts and reshapes to what they view."""
  by = {i.name: i for i in comp}
  while ins.opcode in ("bitcast", "reshape") and ins.operands and ins.operands[0] in by:
    ins = by[ins.operands[0]]
  return ins


def _fusion_bytes(comp: list[_Instr], result: float) -> float:
  """A fusion's traffic: its result and each parameter, except that an in-place dynamic-update-slice moves only the
  update (read, then written) and a parameter read only through slices moves only the slices."""
  by = {i.name: i for i in comp}
  root = _strip(comp, next((i for i in comp if i.root), comp[-1]))
  if root.opcode == "dynamic-update-slice" and len(root.operands) > 1 and root.operands[1] in by:
    return 2 * shape_bytes(by[root.operands[1]].type)
  users = collections.defaultdict(list)
  for i in comp:
    for o in i.operands:
      users[o].append(i)
  total = result
  for p in (i for i in comp if i.opcode == "parameter"):
    us = users.get(p.name, [])
    sliced = us and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == p.name for u in us)
    total += sum(shape_bytes(u.type) for u in us) if sliced else shape_bytes(p.type)
  return total


def _op_bytes(ins: _Instr, types: dict[str, str], comps: dict) -> float:
  """Estimated bytes one execution of a thunk reads and writes (a loop: none of its own)."""
  result = shape_bytes(ins.type)
  if ins.opcode in LOOP_OPS:
    return 0.0
  if ins.opcode == "fusion":
    called = _called(ins)
    if called and comps.get(called[0]):
      return _fusion_bytes(comps[called[0]], result)
  if ins.opcode in ("copy", "transpose", "slice", "dynamic-slice"):
    return 2 * result
  if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
    return 2 * shape_bytes(types.get(ins.operands[1], ""))
  return result + sum(shape_bytes(types.get(o, "")) for o in ins.operands)


def hlo_ops(text: str) -> dict[str, HloOp]:
  """Every instruction of the computations that run as thunks (the entry and the loops' bodies and conditions,
  not fusions' insides), by name: opcode, category and estimated bytes."""
  comps, entry = parse_hlo(text)
  runnable, stack = set(), [entry] if entry else []
  while stack:  # the computations thunks run: the entry and whatever a loop, conditional or call reaches
    name = stack.pop()
    if name in runnable or name not in comps:
      continue
    runnable.add(name)
    stack.extend(c for ins in comps[name] if ins.opcode in LOOP_OPS for c in _called(ins))
  out = {}
  for name in runnable:
    types = {i.name: i.type for i in comps[name]}
    for ins in comps[name]:
      if ins.opcode in STRUCTURE_OPS or ins.opcode == "bitcast":
        continue  # no thunk of their own
      fused = set()
      if ins.opcode == "fusion":
        for c in _called(ins):
          fused |= _opcodes(comps, c)
      target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
      out[ins.name] = HloOp(ins.name, ins.opcode, category(ins.opcode, fused, target.group(1) if target else ""),
                            _op_bytes(ins, types, comps), tuple(sorted(fused)))
  return out
