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

So `register` adds an ``atexit`` handler: at a clean exit every task waits at
one barrier of the coordination service, bounded by ``timeout_s``, and then
they all leave together. A task that ends with an uncaught exception, or
through tfdist's own error exits (`mark_failing`), skips the wait: a failure
is reported at once, never held back by a barrier its peers may not reach.
A ``sys.exit(n)`` from user code cannot be told apart from a clean end and
waits like one (at most ``timeout_s``).
"""

from __future__ import annotations

import atexit
import sys
import time

from tfdist.cluster.info import ClusterInfo

__all__ = ["BARRIER_ID", "register", "mark_failing"]

#: The coordination-service barrier every task reaches before it leaves.
BARRIER_ID = "tfdist/exit"

_state = {"registered": False, "failing": False}


def mark_failing() -> None:
  """This process is ending with an error: leave without waiting for peers."""
  _state["failing"] = True


def register(info: ClusterInfo, timeout_s: float | None) -> None:
  """Waits at `BARRIER_ID` when the interpreter exits cleanly (once per process).

  Args:
    info: the task's cluster; one task alone has nobody to wait for.
    timeout_s: bound on the wait; ``None`` registers nothing.
  """
  if timeout_s is None or info.num_workers < 2 or _state["registered"]:
    return
  _state["registered"] = True
  atexit.register(_wait, f"{info.task_type}:{info.task_id}", timeout_s)


def _wait(task: str, timeout_s: float) -> None:
  if _state["failing"] or getattr(sys, "last_value", None) is not None:
    return
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  start = time.monotonic()
  try:
    context.context().wait_at_barrier(BARRIER_ID, int(timeout_s * 1000))
  except Exception as e:  # pylint: disable=broad-except
    # A peer that failed, or one still busy past the bound: leave anyway,
    # saying so, with the exit status the program chose.
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    print(f"tfdist: {task} waited {time.monotonic() - start:.0f} s at exit for "
          f"the other tasks (bound {timeout_s:g} s, exit_timeout_seconds) and "
          f"leaves without them: {first}", file=sys.stderr, flush=True)
