"""Package faces whose names load on first use (PEP 562).

A face lists each public name once, with the module that defines it; the
module is imported when the name is first read, so importing a face costs
nothing (``tfdist --help`` and TF_CONFIG parsing never load TensorFlow).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Mapping

__all__ = ["install"]


def install(namespace: dict[str, Any], exports: Mapping[str, str],
            aliases: Mapping[str, tuple[str, str]] | None = None) -> None:
  """Makes a package's ``__init__`` a lazily loading face.

  Sets the package's ``__all__`` (the sorted exports, plus any names it
  defines itself and lists in ``__all__`` already), ``__getattr__`` and
  ``__dir__``.

  Args:
    namespace: the package's ``globals()``.
    exports: public name -> the module that defines it.
    aliases: old name -> ``(module, new name)`` for names that moved; a new
      name of ``""`` stands for the module itself. Reading an alias warns
      with a `DeprecationWarning` that gives the new spelling.

  """
  aliases = dict(aliases or {})
  package = namespace["__name__"]

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name in exports:
      value = getattr(importlib.import_module(exports[name]), name)
    elif name in aliases:
      module, new = aliases[name]
      value = importlib.import_module(module)
      value = getattr(value, new) if new else value
      warnings.warn(
          f"{package}.{name} moved to {module}{'.' + new if new else ''}; "
          "the old name goes in the next release", DeprecationWarning,
          stacklevel=2)
      return value
    else:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    namespace[name] = value
    return value

  def __dir__() -> list[str]:  # pylint: disable=invalid-name
    return sorted(set(namespace) | set(exports))

  namespace["__all__"] = sorted({*exports, *namespace.get("__all__", ())})
  namespace["__getattr__"] = __getattr__
  namespace["__dir__"] = __dir__
