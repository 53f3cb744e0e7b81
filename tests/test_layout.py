"""The package's architecture as rules on its import graph (an ast walk), checked in CI."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "hilore_jax"
CONFIG_MAY_IMPORT = {"hilore_jax.errors", "hilore_jax.grpo", "hilore_jax.model.config", "hilore_jax.model.codec"}


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _type_checking(node) -> bool:
  return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
  """Package modules a module imports (`from a import b` is a.b when that is a module), outside TYPE_CHECKING."""
  out = set()
  stack = [tree]
  while stack:
    node = stack.pop()
    if _type_checking(node):
      continue
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.split(".")[0] == PKG)
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PKG:
      for a in node.names:
        out.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module)
    stack.extend(ast.iter_child_nodes(node))
  return out


def import_graph() -> dict[str, set[str]]:
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, PKG)) for f in fs if f.endswith(".py")]
  modules = {_module_name(f) for f in files}
  graph = {}
  for f in files:
    with open(f) as fh:
      graph[_module_name(f)] = _imports(ast.parse(fh.read()), modules) - {_module_name(f)}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected set of more than one module (Tarjan)."""
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
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in list(graph):
    if v not in index:
      visit(v)
  return out


def violations(graph: dict[str, set[str]]) -> list[str]:
  """Broken rules, one line each."""
  out = []
  for mod, deps in sorted(graph.items()):
    for dep in sorted(deps):
      if mod.startswith("hilore_jax.model") and not dep.startswith("hilore_jax.model"):
        out.append(f"{mod} -> {dep}: model/ imports nothing from the package outside itself")
      if mod == "hilore_jax.grpo":
        out.append(f"{mod} -> {dep}: grpo.py imports nothing from the package")
      if mod == "hilore_jax.config" and dep not in CONFIG_MAY_IMPORT:
        out.append(f"{mod} -> {dep}: config.py imports only leaf types and constants")
      if mod.startswith("hilore_jax.memory") and (dep in ("hilore_jax.trainer", "hilore_jax.train_step",
                                                          "hilore_jax.engine") or dep.startswith("hilore_jax.bench")):
        out.append(f"{mod} -> {dep}: memory/ reaches the trainer only through StepHooks, and never the bench")
      if dep == "hilore_jax.trainer" and not mod.startswith(("hilore_jax.bench", "train")):
        out.append(f"{mod} -> {dep}: only bench/ and train/ import the trainer")
  out += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
  return out


def test_the_package_keeps_its_import_rules():
  graph = import_graph()
  assert {"hilore_jax.model.decoder", "hilore_jax.memory.manager", "hilore_jax.bench.run"} <= set(graph)
  assert violations(graph) == []


@pytest.mark.parametrize("edge,rule", [
    (("hilore_jax.model.decoder", "hilore_jax.grpo"), "model/ imports nothing"),
    (("hilore_jax.grpo", "hilore_jax.model"), "grpo.py imports nothing"),
    (("hilore_jax.config", "hilore_jax.tasks"), "config.py imports only leaf"),
    (("hilore_jax.memory.calibration", "hilore_jax.train_step"), "memory/ reaches the trainer only"),
    (("hilore_jax.memory.manager", "hilore_jax.bench.report"), "memory/ reaches the trainer only"),
    (("hilore_jax.evaluation", "hilore_jax.trainer"), "only bench/ and train/ import the trainer"),
])
def test_each_rule_catches_a_synthetic_break(edge, rule):
  graph = import_graph()
  broken = {**graph, edge[0]: graph.get(edge[0], set()) | {edge[1]}}
  assert any(rule in v for v in violations(broken)), edge


def test_a_cycle_is_caught():
  graph = {"hilore_jax.a": {"hilore_jax.b"}, "hilore_jax.b": {"hilore_jax.c"}, "hilore_jax.c": {"hilore_jax.a"},
           "hilore_jax.d": {"hilore_jax.a"}}
  assert violations(graph) == ["import cycle: hilore_jax.a -> hilore_jax.b -> hilore_jax.c"]


def test_modules_stay_short_or_say_why():
  for d, _, fs in os.walk(os.path.join(ROOT, PKG)):
    for f in fs:
      if f.endswith(".py"):
        with open(os.path.join(d, f)) as fh:
          text = fh.read()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 320:
          assert "on purpose" in doc, f"{f}: {text.count(chr(10))} lines and no reason in its docstring"
