"""Time the machine stood still, so that a test's bounds count running time.

The machines that run this suite are virtual, and their host stops them now
and then (CI runs saw a thread that was runnable, holding no lock, get no
processor for over 40 s, while its peer's clock ran on; the kernel log read
"crng reseeded due to virtual machine fork"). The monotonic clock keeps
counting through such a stop, so a bound of 30 s on something that takes 5 s
of running fails although nothing was slow.

A daemon thread of the test process ticks every `TICK_S`; a gap longer than
`GAP_S` between two ticks is a stall, and everything beyond one tick of it is
time the machine (or at least this process) did not run. Waits in the
harness (`cluster_utils.wait_until`, `cluster_utils.Tasks`) extend their
deadlines by the stalls inside them, and tests that bound how long something
took measure `running_since` instead of the wall clock. Stalls are reported at
the end of the session (tests/conftest.py) with the test they fell in.

Only the test side is corrected: a product's own timeout inside a child
process still counts the stall, as it would on a user's machine.

Example:
  start = time.monotonic()
  ...
  self.assertLess(stalls.running_since(start), 30)
"""

from __future__ import annotations

import dataclasses
import threading
import time

__all__ = ["TICK_S", "GAP_S", "Stall", "stalled_since", "running_since",
           "expired", "stalls", "note_test"]

#: How often the watching thread wakes.
TICK_S = 0.1
#: A gap between two ticks longer than this is a stall.
GAP_S = 2.0


@dataclasses.dataclass(frozen=True)
class Stall:
  """One gap: it ended at monotonic ``ended``, ``seconds`` long (beyond the
  tick), during test ``test``."""
  ended: float
  seconds: float
  test: str


_lock = threading.Lock()
_stalls: list[Stall] = []
_test = ["(between tests)"]


def note_test(nodeid: str) -> None:
  """Names the test that runs now (conftest's hook), for the report."""
  _test[0] = nodeid


_last_tick = [time.monotonic()]


def _watch() -> None:
  while True:
    time.sleep(TICK_S)
    now = time.monotonic()
    with _lock:
      if now - _last_tick[0] > GAP_S:
        _stalls.append(Stall(now, now - _last_tick[0] - TICK_S, _test[0]))
      _last_tick[0] = now


def stalls() -> list[Stall]:
  """Every stall so far, oldest first."""
  with _lock:
    return list(_stalls)


def stalled_since(start: float) -> float:
  """Seconds of stall after monotonic ``start`` (a stall that began before
  ``start`` counts only its part after it).

  A gap the watching thread has not woken up from yet counts too: after a
  stop every thread resumes, and a waiter may look at the clock first.
  """
  now = time.monotonic()
  with _lock:
    gaps = [(s.ended, s.seconds) for s in _stalls if s.ended > start]
    if now - _last_tick[0] > GAP_S:
      gaps.append((now, now - _last_tick[0] - TICK_S))
  return sum(min(seconds, ended - start) for ended, seconds in gaps)


def running_since(start: float) -> float:
  """Seconds since monotonic ``start``, less the stalls since then."""
  return time.monotonic() - start - stalled_since(start)


def expired(start: float, timeout: float) -> bool:
  """Whether ``timeout`` seconds of running have passed since ``start``."""
  return running_since(start) >= timeout


threading.Thread(target=_watch, name="tfdist-test-stalls", daemon=True).start()
