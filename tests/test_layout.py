"""The repository's architecture as rules on the import graph of the library, train/ and the lab (an ast walk,
tests/layout_util.py), and on what the lab may touch of the library, checked in CI. The rules on rooms, floors and
module length are in tests/test_house.py."""

import ast
import os

import pytest

from layout_util import LAB, PKG, ROOT, closure, cycles, files, findings, import_graph, ours

WINGS = ("model", "memory", "rl", "tasks", "optim")  # the wings with settings; loop/ and capacity/ have none
# the root config composes the wings' sections; a wing's config imports only leaf constants and checks
CONFIG_MAY_IMPORT = {"hilore_jax.errors", "hilore_jax.model.config"} | {f"hilore_jax.{w}.config" for w in WINGS}
WING_CONFIG_MAY_IMPORT = {"hilore_jax.errors", "hilore_jax.config", "hilore_jax.rl.grpo", "hilore_jax.model.codec",
                          "hilore_jax.model.units",
                          "hilore_jax.memory.config"}
ARRAY_LIBRARIES = ("jax", "jaxlib", "optax", "flax", "chex", "orbax")
# what the lab may import from memory/: the wing's public API (the package: MemoryManager, ManagerState, ...), the
# manager's interface for studies (probe), settings, types, and pure numerics; never the manager's machinery
# (manager, calibrate, buckets, drift, store, warmup, ...) directly
LAB_MEMORY_MODULES = {"hilore_jax.memory"} | {f"hilore_jax.memory.{m}" for m in (
    "probe", "config", "hooks", "state", "risk", "riskfit", "predictors", "gate", "calibration", "methods", "profile")}
# the loop and its compiled steps
TRAINER = ("hilore_jax.loop.trainer", "hilore_jax.loop.engine", "hilore_jax.loop.step_hooks")


def _in(mod: str, *wings: str) -> bool:
  return any(mod == f"{PKG}.{w}" or mod.startswith(f"{PKG}.{w}.") for w in wings)


def _lab(mod: str) -> bool:
  return mod == LAB or mod.startswith(f"{LAB}.")


def violations(graph: dict[str, set[str]]) -> list[str]:
  """Broken rules, one line each (graph may include third-party top-level names: import_graph(external=True))."""
  out = []
  for mod, deps in sorted(graph.items()):
    for dep in sorted(deps):
      internal = ours(dep)
      if _in(mod, "model") and internal and not _in(dep, "model"):
        out.append(f"{mod} -> {dep}: model/ imports nothing from the package outside itself")
      if mod == "hilore_jax.rl.grpo" and internal:
        out.append(f"{mod} -> {dep}: rl/grpo.py imports nothing from the package")
      if mod == "hilore_jax.config" and internal and dep not in CONFIG_MAY_IMPORT:
        out.append(f"{mod} -> {dep}: config.py only composes the wings' sections")
      if (mod.endswith(".config") and mod != "hilore_jax.config" and not _in(mod, "model") and internal
          and dep not in WING_CONFIG_MAY_IMPORT | {mod.rsplit(".", 1)[0]}):
        out.append(f"{mod} -> {dep}: a wing's config imports only leaf constants and checks")
      # memory/ reads the GRPO numerics (w_t) but reaches the trainer only through StepHooks
      numerics = dep == "hilore_jax.rl.grpo"
      if _in(mod, "memory") and (dep in TRAINER or _in(dep, "capacity") or _lab(dep)
                                 or (_in(dep, "rl") and not numerics)):
        out.append(f"{mod} -> {dep}: memory/ reaches the trainer only through StepHooks, and never the capacity "
                   "tool or the lab")
      if _in(mod, "rl") and (dep in TRAINER or _in(dep, "memory", "capacity") or _lab(dep)):
        out.append(f"{mod} -> {dep}: rl/ is the step's pure functions and data: no trainer, engine, memory, "
                   "capacity tool or lab")
      if _in(mod, "tasks") and internal and not (_in(dep, "tasks") or dep in ("hilore_jax.errors",
                                                                              "hilore_jax.runtime")):
        out.append(f"{mod} -> {dep}: tasks/ imports only itself, errors and runtime")
      if _in(mod, "tasks") and dep in ARRAY_LIBRARIES:
        out.append(f"{mod} -> {dep}: tasks/ imports no JAX (data code runs anywhere)")
      if _in(dep, "loop") and not (_in(mod, "loop", "capacity") or _lab(mod) or mod.split(".")[0] == "train"):
        out.append(f"{mod} -> {dep}: the loop sits on the wings: only loop/, capacity/, train/ and experiments/ "
                   "import it")
      if _lab(dep) and not _lab(mod):
        out.append(f"{mod} -> {dep}: neither the library nor train/ imports the lab (experiments/ is not installed)")
      if _lab(mod) and _in(dep, "memory") and dep not in LAB_MEMORY_MODULES:
        out.append(f"{mod} -> {dep}: the lab reaches the memory manager only through its public interface "
                   "(hilore_jax.memory, memory/probe.py) and the wing's settings, types and numerics")
      if dep == "hilore_jax.loop.trainer" and not (_lab(mod) or mod.split(".")[0] == "train"):
        out.append(f"{mod} -> {dep}: only experiments/ and train/ import the trainer")
  internal_graph = {m: {d for d in ds if ours(d)} for m, ds in graph.items()}
  out += [f"import cycle: {' -> '.join(c)}" for c in cycles(internal_graph)]
  return out


def private_reaches(path: str, source: str) -> list[str]:
  """Where a lab module reaches inside the library: an attribute `obj._name` of anything but its own self / cls,
  a `_name` imported from the library, or a class derived from a library class (an override reaches inside it)."""
  tree, out = ast.parse(source), []
  library_names = set()  # names the module binds to hilore_jax modules or their members
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PKG:
      library_names |= {a.asname or a.name for a in node.names}
      out += [f"{path}:{node.lineno}: imports {a.name}, a private name of {node.module}" for a in node.names
              if a.name.startswith("_")]
    elif isinstance(node, ast.Import):
      library_names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == PKG}
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
      out.append(f"{path}:{node.lineno}: {ast.unparse(node)} touches a private attribute")
    if isinstance(node, ast.ClassDef):
      for base in node.bases:
        root = base
        while isinstance(root, ast.Attribute):
          root = root.value
        if isinstance(root, ast.Name) and root.id in library_names:
          out.append(f"{path}:{node.lineno}: class {node.name} derives from the library's {ast.unparse(base)}")
  return out


def test_the_lab_reaches_no_private_state():
  paths = files(LAB)
  assert len(paths) > 20
  out = findings(paths, private_reaches)
  assert out == [], "the lab reaches the library only through public names (memory/probe.py for the manager):\n" + \
      "\n".join(out)


@pytest.mark.parametrize("source,found", [
    ("from hilore_jax.memory import MemoryManager\nmm = MemoryManager(1, 2)\nmm._keep_measured = True\n",
     "mm._keep_measured touches a private attribute"),
    ("def f(mm):\n  return mm._scorer.l1(1)\n", "mm._scorer touches a private attribute"),
    ("from hilore_jax.memory.manager import _helper\n", "imports _helper, a private name"),
    ("from hilore_jax.memory import MemoryManager\nclass Oracle(MemoryManager):\n  pass\n",
     "class Oracle derives from the library's MemoryManager"),
    ("from hilore_jax import memory\nclass Oracle(memory.MemoryManager):\n  pass\n",
     "class Oracle derives from the library's memory.MemoryManager"),
])
def test_the_private_state_rule_catches_a_synthetic_reach(source, found):
  assert any(found in v for v in private_reaches("experiments/x.py", source)), source


def test_the_private_state_rule_leaves_own_state_alone():
  source = ("import dataclasses\nclass Cache:\n  def __init__(self):\n    self._seen = {}\n"
            "  def get(self, k):\n    return self._seen.get(k), dataclasses.__name__\n")
  assert private_reaches("experiments/x.py", source) == []


def test_the_package_keeps_its_import_rules():
  graph = import_graph(external=True)
  assert {"hilore_jax.model.decoder", "hilore_jax.memory.manager", "hilore_jax.rl.train_step", "hilore_jax.tasks.task",
          "hilore_jax.optim.optimizer", "hilore_jax.loop.trainer", "hilore_jax.capacity.measure",
          "experiments.bench.run", "experiments.bench.main", "train.grpo", "train.capacity"} <= set(graph)
  assert "experiments.bench.run" in graph["experiments.bench.main"]  # a lazy import inside a function counts
  assert violations(graph) == []
  # tasks/ imports no JAX through the package either
  for mod in (m for m in graph if _in(m, "tasks")):
    assert not closure(graph, mod) & set(ARRAY_LIBRARIES), mod


@pytest.mark.parametrize("edge,rule", [
    (("hilore_jax.model.decoder", "hilore_jax.rl.grpo"), "model/ imports nothing"),
    (("hilore_jax.rl.grpo", "hilore_jax.model"), "rl/grpo.py imports nothing"),
    (("hilore_jax.config", "hilore_jax.tasks.task"), "config.py only composes"),
    (("hilore_jax.memory.config", "hilore_jax.memory.manager"), "a wing's config imports only leaf"),
    (("hilore_jax.memory.calibration", "hilore_jax.rl.train_step"), "memory/ reaches the trainer only"),
    (("experiments.exposure.run", "hilore_jax.memory.manager"), "the lab reaches the memory manager only through"),
    (("experiments.bench.run", "hilore_jax.memory.calibrate"), "the lab reaches the memory manager only through"),
    (("hilore_jax.memory.manager", "experiments.bench.report"), "memory/ reaches the trainer only"),
    (("hilore_jax.memory.manager", "hilore_jax.capacity.projection"), "memory/ reaches the trainer only"),
    (("hilore_jax.rl.rollout", "experiments.synthetic"), "rl/ is the step's pure functions"),
    (("hilore_jax.rl.train_step", "hilore_jax.memory.exposure"), "rl/ is the step's pure functions"),
    (("hilore_jax.tasks.prompts", "hilore_jax.rl.grpo"), "tasks/ imports only itself"),
    (("hilore_jax.tasks.verifiers", "jax"), "tasks/ imports no JAX"),
    (("hilore_jax.loop.evaluation", "hilore_jax.loop.trainer"), "only experiments/ and train/ import the trainer"),
    (("hilore_jax.cli", "hilore_jax.loop.engine"), "the loop sits on the wings"),
    (("hilore_jax.tasks.task", "hilore_jax.loop.metrics"), "the loop sits on the wings"),
    (("hilore_jax.optim.optimizer", "hilore_jax.loop.checkpointing"), "the loop sits on the wings"),
    (("hilore_jax.loop.evaluation", "experiments.bench.report"), "neither the library nor train/ imports the lab"),
    (("hilore_jax.capacity.measure", "experiments.bench.run"), "neither the library nor train/ imports the lab"),
    (("train.capacity", "experiments.bench.run"), "neither the library nor train/ imports the lab"),
    (("experiments.common.config", "hilore_jax.memory.manager"), "a wing's config imports only leaf"),
])
def test_each_rule_catches_a_synthetic_break(edge, rule):
  graph = import_graph(external=True)
  broken = {**graph, edge[0]: graph.get(edge[0], set()) | {edge[1]}}
  assert any(rule in v for v in violations(broken)), edge


def test_a_cycle_is_caught():
  graph = {"hilore_jax.a": {"hilore_jax.b"}, "hilore_jax.b": {"hilore_jax.c"}, "hilore_jax.c": {"hilore_jax.a"},
           "hilore_jax.d": {"hilore_jax.a"}}
  assert violations(graph) == ["import cycle: hilore_jax.a -> hilore_jax.b -> hilore_jax.c"]


TEST_FOLDERS = ("model", "memory", "rl", "tasks", "optim", "capacity", "loop", "experiments")
PROJECT_WIDE_TESTS = ("test_layout.py", "test_house.py", "test_docs.py")  # the repository as a whole


def test_tests_mirror_the_wings():
  """A wing's tests in its folder; at the root, the repository's and those of the package's root modules
  (tests/test_config.py for hilore_jax/config.py)."""
  tests = os.path.join(ROOT, "tests")
  for d, _, fs in os.walk(tests):
    for f in (f for f in fs if f.startswith("test_") and f.endswith(".py")):
      folder = os.path.relpath(d, tests)
      root_module = os.path.isfile(os.path.join(ROOT, PKG, f[len("test_"):]))
      assert folder in TEST_FOLDERS or (folder == "." and (f in PROJECT_WIDE_TESTS or root_module)), \
          f"tests/{folder}/{f}"
