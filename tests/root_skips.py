"""Skips that a run as root must not have.

The tests of the network bed (modules that import tests/netbed.py), of SLURM
(modules that import tests/slurm_harness.py) and of a full disk
(tests/test_disk_full.py) skip, saying why, where they cannot run: without
root, namespaces, mount or apt-get. As root nothing should stop them, so
there a skip hides a broken set-up. Where `VARIABLE` is set (`.ci/run` sets
it) and the run is root's, tests/conftest.py names each such skip at the end
of the session and fails the run.
"""

from __future__ import annotations

import ast
import functools
import os
from typing import Iterable, Mapping

__all__ = ["VARIABLE", "needs_root_for", "enforced", "hidden"]

#: Set (to anything but empty) to fail a root run on these skips.
VARIABLE = "TFDIST_FAIL_ON_ROOT_SKIPS"

#: A test module's import -> what its tests need root for.
_IMPORTS = {"netbed": "the network bed", "slurm_harness": "SLURM"}
#: A test module's file name -> what its tests need root for.
_FILES = {"test_disk_full.py": "a full disk"}


@functools.cache
def needs_root_for(path: str) -> str | None:
  """What the tests of the module at ``path`` need root for, or ``None``."""
  if os.path.basename(path) in _FILES:
    return _FILES[os.path.basename(path)]
  try:
    with open(path) as f:
      tree = ast.parse(f.read())
  except (OSError, SyntaxError, ValueError):
    return None
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      imported.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      imported.add(node.module)
  return next((what for name, what in _IMPORTS.items() if name in imported),
              None)


def enforced(environ: Mapping[str, str], euid: int) -> bool:
  """Whether these skips fail the run: `VARIABLE` set, and root's run."""
  return bool(environ.get(VARIABLE)) and euid == 0


def hidden(skips: Iterable[tuple[str, str]], root: str) -> list[str]:
  """One line for each skip of a test that needs root.

  Args:
    skips: ``(node id, reason)`` of each skipped test.
    root: the directory node ids are relative to.
  """
  lines = []
  for nodeid, reason in skips:
    what = needs_root_for(os.path.join(root, nodeid.split("::")[0]))
    if what:
      lines.append(f"{nodeid} ({what}): {reason}")
  return lines
