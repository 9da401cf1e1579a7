"""What tfdist does once in a process, written one way (`once`, `number`),
and the cores it may run on (`cores`).

Everything else tfdist keeps lives on the object it belongs to (a strategy's
`tfdist.strategy.introspect.Record`, a ring, a launcher).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Hashable

__all__ = ["once", "number", "cores", "INTRA_OP"]

INTRA_OP = "TF_NUM_INTRAOP_THREADS"  # TensorFlow's intra-op pool size.
_lock = threading.Lock()
_counters: dict[Hashable, itertools.count] = {}


def once(key: Hashable) -> bool:
  """True the first time this process asks with ``key``, then False."""
  return number(("once", key)) == 0


def number(key: Hashable, start: int = 0) -> int:
  """``start``, then one more each time this process asks with ``key``."""
  with _lock:
    return next(_counters.setdefault(key, itertools.count(start)))


def cores() -> int:
  """The cores this process may run on."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1
