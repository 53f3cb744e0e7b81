"""The repository's import graph, an ast walk of the library, train/ and the lab, and the house it draws: rooms,
the arrows between them and their floors. tests/test_layout.py holds the rules on modules, tests/test_house.py those
on rooms. `python tests/layout_util.py` prints the house (docs/design.md#the-house keeps the table)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "hilore_jax"
LAB = "experiments"  # the lab: benchmarks and studies, beside the package and not installed with it
PACKAGES = (PKG, "train", LAB)  # the walked modules: the library, the user's entry points, the lab
# the package's wings, a room each; its root modules are a room each: one concern per flat module, on floors of
# their own (errors.py under every wing, config.py above the wings whose sections it composes, cli.py above it),
# so one room of them would draw a circle (memory/ -> errors.py, config.py -> memory/) the modules do not have
ROOM_WINGS = ("model", "memory", "rl", "tasks", "optim", "loop", "capacity")


def module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def type_checking(node) -> bool:
  return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(tree: ast.AST, modules: set[str]) -> set[str]:
  """Modules a module imports, outside TYPE_CHECKING: modules of the library, train/ and the lab by name (`from a
  import b` is a.b when that is a module), anywhere; others by their top-level name, at module level only (an import
  inside a function runs only when it is called)."""
  out = set()
  stack = [(tree, False)]
  while stack:
    node, nested = stack.pop()
    if type_checking(node):
      continue
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] in PACKAGES:
          out.add(a.name)
        elif not nested:
          out.add(a.name.split(".")[0])
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.split(".")[0] not in PACKAGES:
        if not nested:
          out.add(node.module.split(".")[0])
        continue
      for a in node.names:
        out.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module)
    inner = nested or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    stack.extend((child, inner) for child in ast.iter_child_nodes(node))
  return out


def import_graph(external: bool = False) -> dict[str, set[str]]:
  """Module of the library, train/ or the lab -> the modules of those it imports (with external=True, also
  third-party top-level names): a fresh copy, the walk itself done once per process."""
  return {m: set(deps) if external else {d for d in deps if ours(d)} for m, deps in _walk().items()}


@functools.cache
def _walk() -> dict[str, frozenset[str]]:
  paths = files(*PACKAGES)
  modules = {module_name(f) for f in paths}
  graph = {}
  for f in paths:
    with open(f) as fh:
      graph[module_name(f)] = frozenset(imports(ast.parse(fh.read()), modules) - {module_name(f)})
  return graph


def files(*packages: str) -> list[str]:
  """The .py files under the given top-level folders."""
  return [os.path.join(d, f) for p in packages for d, _, fs in os.walk(os.path.join(ROOT, p)) for f in fs
          if f.endswith(".py")]


def findings(paths: list[str], check) -> list[str]:
  """check(repository-relative path, source) over every file, its findings concatenated."""
  out = []
  for path in paths:
    with open(path) as fh:
      out += check(os.path.relpath(path, ROOT), fh.read())
  return out


def ours(mod: str) -> bool:
  return mod.split(".")[0] in PACKAGES


def closure(graph: dict[str, set[str]], mod: str) -> set[str]:
  """Everything mod imports, directly or through package modules."""
  seen, stack = set(), [mod]
  while stack:
    for dep in graph.get(stack.pop(), ()):
      if dep not in seen:
        seen.add(dep)
        stack.append(dep)
  return seen


def components(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected sets of the graph (Tarjan), each after every set it reaches."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected set of more than one node."""
  return [c for c in components(graph) if len(c) > 1]


def room(mod: str) -> str:
  """The room of a module: a wing of the package, one of its root modules, train/, or a study's folder of the lab
  (the lab's package file, a docstring, sits with what the studies share)."""
  parts = mod.split(".")
  if parts[0] == PKG:
    if len(parts) == 1:
      return f"{PKG}/__init__.py"
    return f"{PKG}/{parts[1]}/" if parts[1] in ROOM_WINGS else f"{PKG}/{parts[1]}.py"
  if parts[0] == LAB:
    return f"{LAB}/{parts[1] if len(parts) > 1 else 'common'}/"
  return f"{parts[0]}/"


@dataclasses.dataclass(frozen=True)
class House:
  """Rooms, arrows (room -> room it imports -> how many module imports), each room's floor (0: imports no other
  room; else one above the highest room it imports, a circle's rooms sharing one floor), the circles and the arrows
  that do not go down a floor."""
  arrows: dict[str, dict[str, int]]
  floors: dict[str, int]
  circles: list[list[str]]
  back_up: list[tuple[str, str]]

  @property
  def rooms(self) -> list[str]:
    return sorted(self.floors, key=lambda r: (-self.floors[r], r))

  def rows(self) -> list[tuple[int, str, str]]:
    """(floor, room, the rooms it imports), top floor first: the table docs/design.md keeps."""
    return [(self.floors[r], r, ", ".join(sorted(self.arrows[r], key=lambda d: (-self.floors[d], d))))
            for r in self.rooms]

  def summary(self) -> str:
    n = sum(len(a) for a in self.arrows.values())
    return (f"{len(self.floors)} rooms, {max(self.floors.values()) + 1} floors, {n} arrows, "
            f"{len(self.back_up)} arrows back up, {len(self.circles)} circles")


def house(graph: dict[str, set[str]]) -> House:
  """The house of a module graph (of our modules only: import_graph())."""
  arrows = {room(m): {} for m in graph}
  for mod, deps in graph.items():
    for dep in deps:
      a, b = room(mod), room(dep)
      arrows.setdefault(b, {})
      if a != b:
        arrows[a][b] = arrows[a].get(b, 0) + 1
  links = {r: set(a) for r, a in arrows.items()}
  floors = {}
  for comp in components(links):  # each after every set it reaches: their floors are known
    below = [floors[d] for r in comp for d in links[r] if d not in comp]
    floors.update({r: 1 + max(below, default=-1) for r in comp})
  back_up = sorted((a, b) for a in arrows for b in arrows[a] if floors[b] >= floors[a])
  return House(arrows, floors, cycles(links), back_up)


if __name__ == "__main__":
  h = house(import_graph())
  print(h.summary())
  for floor, r, deps in h.rows():
    print(f"{floor:2d}  {r:32s} -> {deps}")
