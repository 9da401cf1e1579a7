"""The package's floors: every import points down, and no import cycles.

The floors, lowest first (README.md, "Layout"):

  errors, _net, _lazy, _compat  <-  cluster, ring  <-  strategy  <-  data, perf
  <-  training  <-  facade, flags, recipes, launch, bench, report  <-  cli

Imports are read from the source with `ast`, inside functions too, and so are
module paths written inside strings (``python -m tfdist...``, ``-c`` helper
code, lazy tables), so no import hides from these checks.
"""

from __future__ import annotations

import ast
import os
import re

from absl.testing import absltest
from absl.testing import parameterized
import pytest

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tfdist")

#: Module prefix -> floor; the longest matching prefix wins.
FLOORS = {
    "tfdist.errors": 0, "tfdist._net": 0, "tfdist._lazy": 0,
    "tfdist._secret": 0, "tfdist._compat": 0, "tfdist._flight": 0,
    "tfdist._process": 0,
    "tfdist.cluster": 1, "tfdist.ring": 1,
    "tfdist.strategy": 2,
    "tfdist.data": 3, "tfdist.perf": 3,
    "tfdist.training": 4,
    "tfdist": 5,  # The facade and the top floor: flags, recipes, launch, ...
    "tfdist.cli": 6, "tfdist.__main__": 6,
}

_MODULE_TEXT = re.compile(r"\btfdist(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _module_names() -> dict[str, str]:
  """Every module of the package: dotted name -> file path."""
  names = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      names[".".join(parts)] = path
  return names


MODULES = _module_names()


def floor_of(module: str) -> int:
  prefix = max((p for p in FLOORS if module == p or module.startswith(p + ".")),
               key=len)
  return FLOORS[prefix]


def _known(dotted: str) -> str | None:
  """The longest prefix of ``dotted`` that is a module of the package."""
  parts = dotted.split(".")
  for end in range(len(parts), 1, -1):
    candidate = ".".join(parts[:end])
    if candidate in MODULES:
      return candidate
  return None


def _docstrings(tree: ast.AST) -> set[int]:
  ids = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        ids.add(id(first.value))
  return ids


def references(module: str) -> tuple[set[str], set[str], set[str]]:
  """``(imports, strings, external)`` of ``module``.

  ``imports``: package modules it imports (anywhere in the file);
  ``strings``: package modules named in its non-docstring string constants;
  ``external``: top-level names of other packages it imports.
  """
  with open(MODULES[module]) as f:
    tree = ast.parse(f.read())
  imports, strings, external = set(), set(), set()
  docstrings = _docstrings(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        (imports if alias.name.startswith("tfdist") else external).add(
            alias.name if alias.name.startswith("tfdist")
            else alias.name.split(".")[0])
    elif isinstance(node, ast.ImportFrom) and node.module:
      if not node.module.startswith("tfdist"):
        external.add(node.module.split(".")[0])
        continue
      for alias in node.names:
        imports.add(_known(f"{node.module}.{alias.name}") or node.module)
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings):
      for match in _MODULE_TEXT.findall(node.value):
        if (known := _known(match)) is not None:
          strings.add(known)
  imports = {_known(m) or m for m in imports}
  return ({m for m in imports if m in MODULES and m != module},
          {m for m in strings if m != module}, external)


def _module_level_imports(module: str) -> set[str]:
  """Top-level names imported at module level (not inside functions)."""
  with open(MODULES[module]) as f:
    tree = ast.parse(f.read())
  names = set()
  for node in tree.body:
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module.split(".")[0])
  return names


def _in(module: str, package: str) -> bool:
  return module == package or module.startswith(package + ".")


class FloorsTest(parameterized.TestCase):

  def test_the_package_was_read(self):
    for module in ("tfdist", "tfdist.errors", "tfdist.cluster.info",
                   "tfdist.strategy.factory", "tfdist.training.fit"):
      self.assertIn(module, MODULES)

  def test_every_import_and_module_string_points_down(self):
    up = []
    for module in sorted(MODULES):
      imports, strings, _ = references(module)
      for target in sorted(imports | strings):
        if floor_of(target) > floor_of(module):
          up.append(f"{module} (floor {floor_of(module)}) -> {target} "
                    f"(floor {floor_of(target)})")
    self.assertEqual(up, [], "imports that point up:\n" + "\n".join(up))

  def test_no_import_cycles(self):
    graph = {m: references(m)[0] for m in MODULES}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done.

    def visit(node, path):
      state[node] = 1
      for nxt in sorted(graph[node]):
        if state.get(nxt) == 1:
          cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
        elif nxt not in state:
          visit(nxt, path + [nxt])
      state[node] = 2

    for module in sorted(graph):
      if module not in state:
        visit(module, [module])
    # A package face importing its own submodules is how packages work.
    cycles = [c for c in cycles
              if not all(_in(m, c.split(" -> ")[0]) for m in c.split(" -> "))]
    self.assertEqual(cycles, [], "import cycles:\n" + "\n".join(cycles))

  @parameterized.named_parameters(
      ("strategy_never_imports_training_data_perf", "tfdist.strategy",
       ("tfdist.training", "tfdist.data", "tfdist.perf")),
      ("data_never_imports_training", "tfdist.data", ("tfdist.training",)),
      ("perf_never_imports_training", "tfdist.perf", ("tfdist.training",)),
      ("launch_never_imports_strategy_or_training", "tfdist.launch",
       ("tfdist.strategy", "tfdist.training", "tfdist.data", "tfdist.perf")),
      ("cluster_imports_nothing_above", "tfdist.cluster",
       ("tfdist.strategy", "tfdist.data", "tfdist.perf", "tfdist.training")),
      ("ring_imports_nothing_above", "tfdist.ring",
       ("tfdist.cluster", "tfdist.strategy", "tfdist.data", "tfdist.perf",
        "tfdist.training")),
      ("errors_import_nothing", "tfdist.errors", ("tfdist",)),
      ("net_imports_nothing", "tfdist._net", ("tfdist",)),
      ("secret_imports_nothing", "tfdist._secret", ("tfdist",)),
      ("lazy_imports_nothing", "tfdist._lazy", ("tfdist",)),
      ("compat_imports_nothing_but_process", "tfdist._compat",
       ("tfdist.errors", "tfdist._net", "tfdist._lazy", "tfdist._secret",
        "tfdist._flight")),  # The floor test forbids the floors above.
      ("process_imports_nothing", "tfdist._process", ("tfdist",)),
  )
  def test_rule(self, package, forbidden):
    broken = []
    for module in sorted(m for m in MODULES if _in(m, package)):
      imports, strings, _ = references(module)
      for target in sorted(imports | strings):
        if _in(target, package):
          continue  # Inside the package itself.
        if any(_in(target, f) for f in forbidden):
          broken.append(f"{module} -> {target}")
    self.assertEqual(broken, [])

  def test_only_main_imports_cli(self):
    importers = sorted(m for m in MODULES if not _in(m, "tfdist.cli")
                       and any(_in(t, "tfdist.cli")
                               for t in set.union(*references(m)[:2])))
    self.assertEqual(importers, ["tfdist.__main__"])

  def test_launch_needs_no_tensorflow(self):
    users = sorted(m for m in MODULES if _in(m, "tfdist.launch")
                   and "tensorflow" in references(m)[2])
    self.assertEqual(users, [])

  def test_ring_needs_no_tensorflow(self):
    users = sorted(m for m in MODULES if _in(m, "tfdist.ring")
                   and "tensorflow" in references(m)[2])
    self.assertEqual(users, [])

  def test_cluster_is_tensorflow_free_at_import_but_the_resolver(self):
    users = sorted(m for m in MODULES if _in(m, "tfdist.cluster")
                   and "tensorflow" in _module_level_imports(m))
    self.assertEqual(users, ["tfdist.cluster.resolver"])

  def test_floor_table_catches_an_upward_import(self):
    # The check itself can fail: a cluster module naming training points up.
    self.assertGreater(floor_of("tfdist.training.fit"),
                       floor_of("tfdist.cluster.info"))
    self.assertEqual(floor_of("tfdist.cli.main"), 6)
    self.assertEqual(floor_of("tfdist._compat.keras"), 0)


if __name__ == "__main__":
  absltest.main()
