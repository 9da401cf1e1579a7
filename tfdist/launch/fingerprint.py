"""What a node runs, and whether two nodes of a job run the same.

Each node's launcher takes its fingerprint once (`take`, from
`tfdist.launch.spec.preflight`): the releases of tfdist, TensorFlow and
Keras that its Python sees (read with `importlib.metadata`: nothing is
imported), that Python's version, the SHA-256 of the script, ``-m`` module
or ``-c`` code the launched command runs, and the command itself. Node 0
compares every joining node's with its own (`compare`): a release or a
script that differs refuses the node; a command that differs in its
arguments alone is worth a warning, since nodes often pass their own paths.
TensorFlow-free.

Example:
  >>> ours = take(("python", "train.py"))  # doctest: +SKIP
  >>> compare(ours, theirs, rank=1)  # doctest: +SKIP
  ('Keras 3.14.0 on node 1, 3.15.1 on node 0 (every node must run ...)',
   None)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import sys
from typing import Any, Mapping, Sequence

__all__ = ["take", "compare"]

#: Each release that must match -> the distributions that provide it (the
#: first one installed counts).
_RELEASES = {
    "tfdist": ("tfdist",),
    "TensorFlow": ("tensorflow", "tensorflow-cpu", "tf-nightly",
                   "tensorflow-macos"),
    "Keras": ("keras", "keras-nightly"),
}
#: Fields that must match, in the order a refusal names them.
_MUST_MATCH = (*_RELEASES, "Python", "script")
#: Python's options that take the next argument as their value.
_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def take(command: Sequence[str], *, cwd: str | None = None,
         environ: Mapping[str, str] | None = None) -> dict[str, Any]:
  """This node's fingerprint for ``command`` (JSON-able).

  Args:
    command: the launched program and its arguments.
    cwd: where it runs (this process's working directory by default).
    environ: its environment, for ``PYTHONPATH`` (``os.environ`` by
      default).
  """
  found = {name: _release(dists) for name, dists in _RELEASES.items()}
  label, digest = _script(command, cwd or os.getcwd(),
                          os.environ if environ is None else environ)
  return {**found, "Python": platform.python_version(),
          "script": {"name": label, "sha256": digest},
          "argv": list(command)}


def compare(ours: Mapping[str, Any], theirs: Any, *,
            rank: int) -> tuple[str | None, str | None]:
  """Whether node ``rank``'s fingerprint ``theirs`` matches node 0's.

  Returns:
    Why the node is refused (each release or script that differs, with
    both values), or ``None``; and, when it is not, a warning naming the
    first argument of the command that differs, or ``None``.
  """
  if not isinstance(theirs, Mapping) or set(theirs) != set(ours):
    return (f"node {rank} did not say what it runs (another tfdist "
            f"release?); node 0 runs tfdist {ours['tfdist']}"), None
  differ = [f"{field} {_shown(theirs[field])} on node {rank}, "
            f"{_shown(ours[field])} on node 0" for field in _MUST_MATCH
            if _key(theirs[field]) != _key(ours[field])]
  if differ:
    return ("; ".join(differ) + " (every node must run the same tfdist, "
            "TensorFlow, Keras, Python and script)"), None
  argv, mine = list(theirs["argv"]), list(ours["argv"])
  if argv == mine:
    return None, None
  i = next(i for i, (a, b) in enumerate(zip(argv + [None], mine + [None]))
           if a != b)
  return None, (f"node {rank} runs the same script with other arguments: "
                f"argv[{i}] is {_arg(argv, i)} on node {rank}, "
                f"{_arg(mine, i)} on node 0 (fine for per-node paths)")


def _release(dists: Sequence[str]) -> str:
  for dist in dists:
    try:
      return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      continue
  return "not installed"


def _key(value: Any) -> Any:
  """What is compared: a script by its content alone (paths may differ)."""
  return value["sha256"] if isinstance(value, Mapping) else value


def _shown(value: Any) -> str:
  if isinstance(value, Mapping):
    return f"{value['name']} (sha256 {value['sha256'][:12] or 'unread'})"
  return str(value)


def _arg(argv: Sequence[str], i: int) -> str:
  return repr(argv[i]) if i < len(argv) else "missing"


def _script(command: Sequence[str], cwd: str,
            environ: Mapping[str, str]) -> tuple[str, str]:
  """What ``command`` runs, named, and the SHA-256 of its text (``""`` when
  it cannot be read): a Python command's script, ``-m`` module or ``-c``
  code; any other program's own file."""
  program, args = command[0], list(command[1:])
  if not os.path.basename(program).startswith("python"):
    return os.path.basename(program), _digest(_which(program, cwd, environ))
  while args:
    arg = args.pop(0)
    if arg in ("-m", "-c") and args:
      arg += args.pop(0)
    if arg.startswith("-c"):
      return "-c code", hashlib.sha256(arg[2:].encode()).hexdigest()
    if arg.startswith("-m"):
      return f"module {arg[2:]}", _digest(_module(arg[2:], cwd, environ))
    if arg in _WITH_VALUE:
      args = args[1:]
    elif not arg.startswith("-"):
      return os.path.basename(arg), _digest(os.path.join(cwd, arg))
  return "standard input", ""


def _which(program: str, cwd: str, environ: Mapping[str, str]) -> str | None:
  if os.sep in program:
    return os.path.join(cwd, program)
  for folder in environ.get("PATH", os.defpath).split(os.pathsep):
    path = os.path.join(folder, program)
    if os.path.isfile(path):
      return path
  return None


def _module(name: str, cwd: str, environ: Mapping[str, str]) -> str | None:
  """The file ``python -m name`` runs, found as Python finds it (the
  working directory, ``PYTHONPATH``, then this Python's path) without
  importing anything."""
  parts = name.split(".")
  folders = [cwd, *environ.get("PYTHONPATH", "").split(os.pathsep),
             *sys.path]
  for folder in filter(None, folders):
    base = os.path.join(folder, *parts)
    for path in (base + ".py", os.path.join(base, "__main__.py")):
      if os.path.isfile(path):
        return path
  return None


def _digest(path: str | None) -> str:
  if path is None:
    return ""
  try:
    with open(path, "rb") as f:
      return hashlib.file_digest(f, "sha256").hexdigest()
  except OSError:
    return ""
