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

So `register` adds an ``atexit`` handler: at a clean end (exit status 0)
every task waits at one barrier of the coordination service, bounded by
``timeout_s``, and they leave together. Any other end leaves at once, since
its peers may never reach the barrier: an uncaught exception or `SystemExit`
(`tfdist.PreemptedError` too), ``sys.exit(n)`` with n != 0; ``os._exit`` and
signals skip ``atexit`` anyway.

``atexit`` cannot read the exit status, so an end is clean when the main
module ran to its end, or else when the last ``sys.exit`` got 0 or None
(importing tfdist wraps ``sys.exit`` to record it, before a script's
``sys.exit(main())`` or absl's ``app.run`` looks it up). Without the main
module on the stack that built the strategy (a notebook, a thread), only
those two kinds of failure are seen.
"""

from __future__ import annotations

import atexit
import dis
import functools
import sys
import time
import types

from tfdist import _flight
from tfdist.cluster.info import ClusterInfo

__all__ = ["BARRIER_ID", "register"]

#: The coordination-service barrier every task reaches before it leaves.
BARRIER_ID = "tfdist/exit"

_state: dict = {"registered": False}


def _recording(exit_):
  @functools.wraps(exit_)
  def recording_exit(status=None):
    _state["status"] = status
    exit_(status)
  return recording_exit


sys.exit = _recording(sys.exit)


def register(info: ClusterInfo, timeout_s: float | None) -> None:
  """Waits at `BARRIER_ID` when the interpreter exits cleanly (once per process).

  Args:
    info: the task's cluster; one task alone has nobody to wait for.
    timeout_s: bound on the wait; ``None`` registers nothing.
  """
  if timeout_s is None or info.num_workers < 2 or _state["registered"]:
    return
  _state["registered"] = True
  _state["main"] = _main_frame()
  atexit.register(_wait, f"{info.task_type}:{info.task_id}", timeout_s)


def _main_frame() -> types.FrameType | None:
  """The frame running the ``__main__`` module, if it is on this stack."""
  main = getattr(sys.modules.get("__main__"), "__dict__", None)
  frame, found = sys._getframe(), None  # pylint: disable=protected-access
  while frame is not None:
    if frame.f_globals is main and frame.f_code.co_name == "<module>":
      found = frame
    frame = frame.f_back
  return found


def _clean_end() -> bool:
  if getattr(sys, "last_value", None) is not None:
    return False  # An uncaught exception.
  frame = _state["main"]
  # A main module whose last instruction was a return ran to its end.
  if frame is not None and dis.opname[frame.f_code.co_code[frame.f_lasti]] in (
      "RETURN_VALUE", "RETURN_CONST"):
    return True
  if "status" in _state:
    return _state["status"] in (None, 0)
  return frame is None  # Else a SystemExit raised directly ended it.


def _wait(task: str, timeout_s: float) -> None:
  if not _clean_end():
    return
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  start = time.monotonic()
  try:
    with _flight.recorded("barrier: clean exit", peers="every task",
                          transport="tensorflow coordination service"):
      context.context().wait_at_barrier(BARRIER_ID, int(timeout_s * 1000))
  except Exception as e:  # pylint: disable=broad-except
    # A peer that failed, or one still busy past the bound: leave anyway,
    # saying so, with the exit status the program chose.
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    print(f"tfdist: {task} waited {time.monotonic() - start:.0f} s at exit for "
          f"the other tasks (bound {timeout_s:g} s, exit_timeout_seconds) and "
          f"leaves without them: {first}", file=sys.stderr, flush=True)
