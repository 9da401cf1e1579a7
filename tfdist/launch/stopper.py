"""Stopping what we started: each process with its whole process group.

Every process that `tfdist launch` and `tfdist bench` start leads a session
of its own (``start_new_session=True``), so its process group holds only
what it started, grandchildren included. `stop` asks every group to stop
(SIGTERM), waits out one grace period for them all, SIGKILLs the groups
still alive, and SIGKILLs every group once more for stray grandchildren
whose leader already ended. Every wait is bounded. TensorFlow-free.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Sequence

__all__ = ["signal_group", "stop"]

#: How long a SIGKILLed process may take to be reaped.
_REAP_SECONDS = 10.0


def signal_group(proc: subprocess.Popen, signum: int) -> None:
  """Sends ``signum`` to ``proc``'s process group, if it is still there."""
  try:
    os.killpg(proc.pid, signum)  # Its own session: only what we started.
  except (ProcessLookupError, PermissionError):
    pass


def stop(procs: Sequence[subprocess.Popen], *, grace_seconds: float,
         asked: bool = False) -> None:
  """Stops every process of ``procs`` with its process group.

  Args:
    procs: processes each started with ``start_new_session=True``.
    grace_seconds: how long they all get to end after SIGTERM.
    asked: they were already asked to stop (a signal forwarded to them):
      no SIGTERM, the grace period only.
  """
  live = [p for p in procs if p.poll() is None]
  if not asked:
    for p in live:
      signal_group(p, signal.SIGTERM)
  deadline = time.monotonic() + grace_seconds
  for p in live:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  for p in procs:
    if p.poll() is None:
      signal_group(p, signal.SIGKILL)
      try:
        p.wait(timeout=_REAP_SECONDS)
      except subprocess.TimeoutExpired:
        pass  # Stuck in the kernel: nothing more to send.
    signal_group(p, signal.SIGKILL)  # Stray grandchildren, if any.
