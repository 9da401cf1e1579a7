"""What tfdist does once in a process, written one way: `once` and `number`.

Everything else tfdist keeps lives on the object it belongs to (a strategy's
`tfdist.strategy.introspect.Record`, a ring, a launcher); this is what
belongs to the process itself.
"""

from __future__ import annotations

import itertools
import threading
from typing import Hashable

__all__ = ["once", "number"]


class _Process:
  """The keys done and the counters of this process."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.done: set[Hashable] = set()
    self.counters: dict[Hashable, itertools.count] = {}


_PROCESS = _Process()


def once(key: Hashable) -> bool:
  """True the first time this process asks with ``key``, then False."""
  with _PROCESS.lock:
    first = key not in _PROCESS.done
    _PROCESS.done.add(key)
    return first


def number(key: Hashable, start: int = 0) -> int:
  """``start``, ``start + 1``, ...: one more each time this process asks."""
  with _PROCESS.lock:
    return next(_PROCESS.counters.setdefault(key, itertools.count(start)))
