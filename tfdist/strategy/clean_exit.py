"""The clean exit of a multi-worker task: nobody leaves while others still talk.

Every task of a MultiWorkerMirroredStrategy cluster keeps sending heartbeats
to TensorFlow's coordination service, which runs inside the leader (the first
chief or worker). Tasks finish their last step together, but then their
teardown takes different times: Keras's `fit` destroys its dataset iterators,
which can take seconds on a busy machine (measured here: 13 to 26 s in 2 of 5
runs of the README's 2-worker example). A task that leaves first makes the
others log ``BaseCollectiveExecutor::StartAbort UNAVAILABLE: Failed to send
RPC to coordination service`` (the leader left) or ``tasks are unhealthy
(stopped sending heartbeats)`` (a worker left) although nothing failed.

So `arm` (`tfdist.make_strategy` calls it) adds an ``atexit`` handler: at a
clean end (exit status 0) every task waits at one barrier of the coordination
service, bounded by ``timeout_s``, and they leave together. Any other end
leaves at once, since its peers may never reach the barrier: an uncaught
exception or `SystemExit` (`tfdist.PreemptedError` too), ``sys.exit(n)`` with
n != 0; ``os._exit`` and signals skip ``atexit`` anyway.

``atexit`` cannot read the exit status, so an end is clean when the main
module ran to its end, else when the last ``sys.exit`` got 0 or None: `arm`
wraps ``sys.exit`` to record it (importing tfdist changes nothing), and for
one looked up before (``sys.exit(main())``, absl's ``app.run``) reads what
the outermost returned function on `arm`'s stack returned, if a constant or
a local. `CleanExit.close`, or a later `arm`, removes both hooks.
"""

from __future__ import annotations

import atexit
import dis
import functools
import sys
import time
import traceback
import types
from typing import Any

from tfdist import _flight
from tfdist.cluster.info import ClusterInfo

__all__ = ["BARRIER_ID", "CleanExit", "arm"]

#: The coordination-service barrier every task reaches before it leaves.
BARRIER_ID = "tfdist/exit"

_UNKNOWN = object()


class CleanExit:
  """One strategy's wait at exit, armed from `arm` until `close`."""

  def __init__(self, *, task: str, timeout_s: float) -> None:
    self.task, self.timeout_s, self.status = task, timeout_s, _UNKNOWN
    self._frames = [f for f, _ in traceback.walk_stack(None)  # Outermost last.
                    if not f.f_globals.get("__name__", "").startswith("tfdist.")]
    self._previous = sys.exit

    @functools.wraps(sys.exit)
    def recording_exit(status=None):
      self.status = status
      self._previous(status)
    recording_exit.clean_exit = self
    self._hook = sys.exit = recording_exit
    atexit.register(self._wait)

  def close(self) -> None:
    """Puts ``sys.exit`` back and drops the wait at exit."""
    atexit.unregister(self._wait)
    if sys.exit is self._hook:
      sys.exit = self._previous

  def clean_end(self) -> bool:
    """Whether the interpreter ends with exit status 0, as far as seen."""
    if getattr(sys, "last_value", None) is not None:
      return False  # An uncaught exception.
    main = getattr(sys.modules.get("__main__"), "__dict__", None)
    mains = [f for f in self._frames
             if f.f_globals is main and f.f_code.co_name == "<module>"]
    if mains and _returned(mains[-1])[0]:
      return True  # The main module ran to its end.
    if self.status is not _UNKNOWN:
      return self.status in (None, 0)
    for frame in reversed(self._frames):  # sys.exit(f()): what f returned.
      returned, value = _returned(frame)
      if returned:
        return value in (None, 0)
    return not mains  # Else a SystemExit raised directly ended it.

  def _wait(self) -> None:
    self.close()
    if not self.clean_end():
      return
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    start = time.monotonic()
    try:
      with _flight.recorded("barrier: clean exit", peers="every task",
                            transport="tensorflow coordination service"):
        context.context().wait_at_barrier(BARRIER_ID,
                                          int(self.timeout_s * 1000))
    except Exception as e:  # pylint: disable=broad-except
      # A peer that failed, or one still busy past the bound: leave anyway,
      # saying so, with the exit status the program chose.
      first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
      print(f"tfdist: {self.task} waited {time.monotonic() - start:.0f} s at "
            f"exit for the other tasks (bound {self.timeout_s:g} s, "
            f"exit_timeout_seconds) and leaves without them: {first}",
            file=sys.stderr, flush=True)


def arm(info: ClusterInfo, timeout_s: float | None) -> CleanExit | None:
  """Waits at `BARRIER_ID` at a clean exit, bounded by ``timeout_s`` (None:
  not at all), unless ``info`` has one task; closes the one armed before."""
  if timeout_s is None or info.num_workers < 2:
    return None
  if hasattr(sys.exit, "clean_exit"):
    sys.exit.clean_exit.close()
  return CleanExit(task=f"{info.task_type}:{info.task_id}",
                   timeout_s=timeout_s)


def _returned(frame: types.FrameType) -> tuple[bool, Any]:
  """Whether ``frame`` returned, and what where its code says (a constant or
  a local), else ``_UNKNOWN``."""
  code = {i.offset: i for i in dis.get_instructions(frame.f_code)}
  last = code.get(frame.f_lasti)
  if last is None or last.opname not in ("RETURN_VALUE", "RETURN_CONST"):
    return False, _UNKNOWN
  value = last if last.opname == "RETURN_CONST" else code.get(
      frame.f_lasti - 2)
  if value is not None and value.opname in ("RETURN_CONST", "LOAD_CONST"):
    return True, value.argval
  if value is not None and value.opname.startswith("LOAD_FAST"):
    return True, frame.f_locals.get(value.argval, _UNKNOWN)
  return True, _UNKNOWN
