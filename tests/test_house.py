"""The house the imports draw (tests/layout_util.py): rooms with no circle between them and no arrow back up a floor,
the floor table docs/design.md keeps, no module over 350 lines, and no private attribute of the library written from
outside its class."""

import ast
import os
import re

import pytest

from layout_util import LAB, PKG, ROOM_WINGS, ROOT, files, findings, house, import_graph, room

MAX_LINES = 350
DESIGN = os.path.join(ROOT, "docs", "design.md")


def test_the_house_has_no_circles_and_no_arrows_back_up():
  h = house(import_graph())
  print(h.summary())
  for floor, r, deps in h.rows():
    print(f"{floor:2d}  {r:30s} -> {deps}")
  studies = {f"{LAB}/{d}/" for d in os.listdir(os.path.join(ROOT, LAB)) if os.path.isdir(os.path.join(ROOT, LAB, d))
             and os.path.isfile(os.path.join(ROOT, LAB, d, "__init__.py"))}
  wings = {f"{PKG}/{w}/" for w in ROOM_WINGS}
  assert wings | studies | {"train/", f"{PKG}/__init__.py", f"{PKG}/config.py", f"{PKG}/errors.py"} <= set(h.floors)
  assert (h.circles, h.back_up) == ([], [])
  # the floors are the design's: errors at the bottom, the model under the step's functions, the memory decisions
  # over them, the config composing the wings, the loop on the config, the entry points and the lab on top
  f = h.floors
  assert f[f"{PKG}/errors.py"] == f[f"{PKG}/model/"] == 0
  assert f[f"{PKG}/rl/"] < f[f"{PKG}/memory/"] < f[f"{PKG}/config.py"] < f[f"{PKG}/loop/"] < f["train/"]
  assert max(f[r] for r in f if not r.startswith(LAB)) < max(f[r] for r in studies)


def test_floors_are_the_longest_way_down():
  h = house({"hilore_jax.loop.a": {"hilore_jax.rl.b", "hilore_jax.errors"}, "hilore_jax.rl.b": {"hilore_jax.errors"},
             "hilore_jax.errors": set(), "train.c": {"hilore_jax.loop.a", "hilore_jax.errors"}})
  assert h.floors == {"hilore_jax/errors.py": 0, "hilore_jax/rl/": 1, "hilore_jax/loop/": 2, "train/": 3}
  assert h.arrows["train/"] == {"hilore_jax/loop/": 1, "hilore_jax/errors.py": 1}
  assert h.summary() == "4 rooms, 4 floors, 5 arrows, 0 arrows back up, 0 circles"


@pytest.mark.parametrize("edge", [("hilore_jax.model.decoder", "hilore_jax.loop.trainer"),
                                  ("hilore_jax.errors", "hilore_jax.config"),
                                  ("hilore_jax.loop.engine", "experiments.common.engines")])
def test_a_back_edge_is_caught(edge):
  graph = import_graph()
  graph[edge[0]] = graph[edge[0]] | {edge[1]}
  h = house(graph)
  low, high = house(import_graph()).floors, h.floors
  assert low[room(edge[0])] < low[room(edge[1])]  # an arrow up the house as it stands
  assert (room(edge[0]), room(edge[1])) in h.back_up
  assert any(room(edge[0]) in c and room(edge[1]) in c for c in h.circles)
  assert high[room(edge[0])] == high[room(edge[1])]  # a circle's rooms share a floor


def _design_table() -> tuple[str, dict[int, set[str]]]:
  text = open(DESIGN).read()
  section = text[text.index("## The house"):]
  section = section[:section.index("\n## ", 1)]
  summary = re.search(r"\d+ rooms, \d+ floors, \d+ arrows, \d+ arrows back up, \d+ circles", section).group(0)
  table = {}
  for floor, rooms in re.findall(r"^\| (\d+) \| (.+) \|$", section, re.M):
    table[int(floor)] = set(re.findall(r"`([^`]+)`", rooms))
  return summary, table


def test_the_design_page_draws_the_house_as_it_stands():
  h = house(import_graph())
  want = {}
  for r, floor in h.floors.items():
    want.setdefault(floor, set()).add(r)
  rows = "\n".join(f"| {f} | {', '.join(f'`{r}`' for r in sorted(want[f]))} |" for f in sorted(want, reverse=True))
  assert _design_table() == (h.summary(), want), f"docs/design.md#the-house should read:\n{h.summary()}\n{rows}"


def long_modules(paths: list[str]) -> list[str]:
  """Modules over MAX_LINES lines, whatever their docstring says."""
  out = []
  for path in paths:
    with open(path) as fh:
      n = len(fh.read().splitlines())
    if n > MAX_LINES:
      out.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
  return out


def test_no_module_is_over_350_lines():
  paths = files(PKG, "train", LAB, "tests")
  assert len(paths) > 250
  long = long_modules(paths)
  assert long == [], f"over {MAX_LINES} lines"


def test_a_long_module_is_caught_whatever_its_docstring(tmp_path):
  path = tmp_path / "long.py"
  path.write_text('"""Long on purpose."""\n' + "x = 1\n" * MAX_LINES)
  assert long_modules([str(path)]) == [f"{os.path.relpath(path, ROOT)}: {MAX_LINES + 1} lines"]
  path.write_text('"""Short."""\n' + "x = 1\n" * (MAX_LINES - 1))
  assert long_modules([str(path)]) == []


def _own(node: ast.AST, in_class: bool) -> bool:
  return in_class and isinstance(node, ast.Name) and node.id in ("self", "cls")


def _private(name) -> bool:
  return isinstance(name, str) and name.startswith("_") and not name.endswith("__")


def _written(target: ast.AST):
  """The attributes an assignment target writes or writes into: `a.b._c[k].d = v` writes d of a.b._c[k] and into
  _c of a.b."""
  if isinstance(target, (ast.Tuple, ast.List)):
    for e in target.elts:
      yield from _written(e)
  elif isinstance(target, ast.Starred):
    yield from _written(target.value)
  else:
    while isinstance(target, (ast.Attribute, ast.Subscript)):
      if isinstance(target, ast.Attribute):
        yield target.value, target.attr
      elif isinstance(target.value, ast.Attribute) and target.value.attr == "__dict__":  # obj.__dict__["_x"] = v
        key = target.slice
        yield target.value.value, key.value if isinstance(key, ast.Constant) else None
      target = target.value


def private_writes(path: str, source: str) -> list[str]:
  """Where a module writes a private attribute of an object other than the self / cls of a class it defines:
  `obj._name = ...` (augmented, annotated, deleted, or into it: `obj._name[k] = ...`), `setattr(obj, "_name", ...)`,
  `object.__setattr__(obj, "_name", ...)` or `obj.__dict__["_name"] = ...`."""
  out = []

  def visit(node, in_class):
    targets = []
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
      targets = [node.target]
    elif isinstance(node, ast.Delete):
      targets = node.targets
    writes = [w for t in targets for w in _written(t)]
    if isinstance(node, ast.Call):
      fn, args = node.func, node.args
      if isinstance(fn, ast.Name) and fn.id == "setattr" and len(args) >= 2:
        writes.append((args[0], args[1].value if isinstance(args[1], ast.Constant) else None))
      elif isinstance(fn, ast.Attribute) and fn.attr == "__setattr__":
        obj, name = (args[0], args[1:2]) if isinstance(fn.value, ast.Name) and fn.value.id == "object" else \
            (fn.value, args[:1])
        if name:
          writes.append((obj, name[0].value if isinstance(name[0], ast.Constant) else None))
    out.extend(f"{path}:{node.lineno}: {ast.unparse(obj)}.{name} written on another object than its class's self / cls"
               for obj, name in writes if _private(name) and not _own(obj, in_class))
    for child in ast.iter_child_nodes(node):
      visit(child, in_class or isinstance(node, ast.ClassDef))

  visit(ast.parse(source), False)
  return out


def test_the_library_writes_no_private_attribute_from_outside_its_class():
  paths = files(PKG, "train")
  assert len(paths) > 100
  out = findings(paths, private_writes)
  assert out == [], "a module sets another object's state through its public methods or constructor:\n" + \
      "\n".join(out)


@pytest.mark.parametrize("source,found", [
    ("def f(mm):\n  mm._keep_measured = True\n", "mm._keep_measured"),
    ("def f(mm):\n  mm._a['x'] = 1\n", "mm._a"),
    ("def f(mm):\n  mm._n += 1\n", "mm._n"),
    ("def f(mm):\n  del mm._n\n", "mm._n"),
    ("def f(mm):\n  mm.scorer._l1, x = 1, 2\n", "mm.scorer._l1"),
    ("def f(mm):\n  setattr(mm, '_scorer', None)\n", "mm._scorer"),
    ("def f(mm):\n  object.__setattr__(mm, '_scorer', None)\n", "mm._scorer"),
    ("def f(mm):\n  mm.__setattr__('_scorer', None)\n", "mm._scorer"),
    ("def f(mm):\n  mm.__dict__['_scorer'] = None\n", "mm._scorer"),
    ("class A:\n  @classmethod\n  def make(cls):\n    a = cls()\n    a._x = 1\n    return a\n", "a._x"),
    ("class A:\n  def f(self):\n    self.other._x = 1\n", "self.other._x"),
    ("def f(self):\n  self._x = 1\n", "self._x"),  # a function outside any class has no own self
])
def test_the_private_write_rule_catches_a_synthetic_write(source, found):
  assert any(f"{found} written on" in v for v in private_writes("hilore_jax/x.py", source)), source


def test_the_private_write_rule_leaves_own_state_and_reads_alone():
  source = ("import dataclasses\n@dataclasses.dataclass(frozen=True)\nclass A:\n  n: int\n"
            "  def __post_init__(self):\n    object.__setattr__(self, '_m', self.n)\n"
            "  def f(self, other):\n    self._x = other._y\n    self._d[other._k] = 1\n    self._s.public = 2\n"
            "    setattr(self, '_z', 3)\n    other.public = other._y\n")
  assert private_writes("hilore_jax/x.py", source) == []
