"""What a node runs, and whether two nodes of a job run the same.

Each node's launcher takes its fingerprint once (`take`, from
`tfdist.launch.spec.preflight`): the releases of tfdist, TensorFlow and
Keras that its Python sees (read with `importlib.metadata`: nothing is
imported), that Python's version, the SHA-256 of what the interpreter runs
(a Python or shell script after the interpreter's options, the ``-m``
module's file, ``-c`` code, or the program itself) together with the local
modules a Python script imports from its own folder, and the command
itself. Node 0
compares every joining node's with its own (`compare`): a release or a
script that differs, or one that a node cannot read, refuses the node; a command that differs in its
arguments alone is worth a warning, since nodes often pass their own paths.
TensorFlow-free.

Example:
  >>> ours = take(("python", "train.py"))  # doctest: +SKIP
  >>> compare(ours, theirs, rank=1)  # doctest: +SKIP
  ('Keras 3.14.0 on node 1, 3.15.1 on node 0 (every node must run ...)',
   None)
"""

from __future__ import annotations

import ast
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
#: Interpreters whose first operand is the script they run, and their
#: options that take the next argument as their value.
_PYTHON_VALUE = ("-W", "-X", "--check-hash-based-pycs")
_SHELLS = ("sh", "bash", "dash", "zsh", "ksh")
_SHELL_VALUE = ("-o", "+o", "-O", "+O", "--rcfile", "--init-file")


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
  script = _script(command, cwd or os.getcwd(),
                   os.environ if environ is None else environ)
  return {**found, "Python": platform.python_version(), "script": script,
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
  unread = [f"node {r} cannot read what it runs: {node['script']['unread']}"
            for r, node in ((rank, theirs), (0, ours))
            if isinstance(node["script"], Mapping)
            and node["script"].get("unread")]
  if unread:
    return "; ".join(unread) + " (an unread script matches nothing)", None
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
    extra = value.get("files", 1) - 1
    return (f"{value['name']} (sha256 {value['sha256'][:12]}"
            + (f", with {extra} local modules)" if extra else ")"))
  return str(value)


def _arg(argv: Sequence[str], i: int) -> str:
  return repr(argv[i]) if i < len(argv) else "missing"


def _script(command: Sequence[str], cwd: str,
            environ: Mapping[str, str]) -> dict[str, Any]:
  """What ``command`` runs: its name, the SHA-256 of its text and of the
  local modules a Python script imports from its own folder, or why it
  could not be read (``unread``)."""
  program, args = command[0], list(command[1:])
  name = os.path.basename(program)
  if name.startswith("python"):
    label, target = _operand(args, _PYTHON_VALUE, "-m")
  elif name in _SHELLS:
    label, target = _operand(args, _SHELL_VALUE, None)
  else:
    label, target = name, _which(program, cwd, environ)
  if isinstance(target, bytes):
    return {"name": label, "sha256": hashlib.sha256(target).hexdigest()}
  if label.startswith("module "):
    target = _module(label[7:], cwd, environ)
  if target is None:
    return {"name": label, "sha256": "", "unread": f"{label} was not found"}
  path = os.path.join(cwd, target)
  digest = hashlib.sha256()
  files = _local_modules(path) if path.endswith(".py") else [path]
  try:
    for file in files:
      with open(file, "rb") as f:
        digest.update(os.path.relpath(file, os.path.dirname(path)).encode()
                      + b"\0" + f.read() + b"\0")
  except OSError as e:
    return {"name": label, "sha256": "", "unread": f"{e.strerror}: {file}"}
  return {"name": label, "sha256": digest.hexdigest(), "files": len(files)}


def _operand(args: list[str], with_value: tuple[str, ...],
             module_flag: str | None) -> tuple[str, str | bytes | None]:
  """The script an interpreter runs: ``(name, path)``, or its ``-c`` code
  as bytes, skipping the interpreter's own options."""
  while args:
    arg = args.pop(0)
    if arg in ("-c", module_flag) and args:
      arg += args.pop(0)
    if arg.startswith("-c"):
      return "-c code", arg[2:].encode()
    if module_flag and arg.startswith(module_flag):
      return f"module {arg[2:]}", None
    if arg in with_value:
      args = args[1:]
    elif not arg.startswith(("-", "+")):
      return os.path.basename(arg), arg
  return "standard input", None


def _local_modules(script: str) -> list[str]:
  """``script`` and the modules it imports, directly or through each other,
  that live in its own folder (read with `ast`; nothing is imported)."""
  folder, found, todo = os.path.dirname(script), [], [script]
  while todo:
    path = todo.pop()
    if path in found:
      continue
    found.append(path)
    try:
      with open(path, "rb") as f:
        tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
      continue  # Read (and named if unreadable) by the caller.
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module] if isinstance(node, ast.ImportFrom)
               and node.module and not node.level else [])
      for name in names:
        base = os.path.join(folder, *name.split("."))
        todo += [p for p in (base + ".py", os.path.join(base, "__init__.py"))
                 if os.path.isfile(p)]
  return sorted(found)


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
