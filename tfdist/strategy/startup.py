"""A bound on cluster start-up that TensorFlow does not give.

Building `MultiWorkerMirroredStrategy` blocks inside TensorFlow until every
task of the cluster has registered with the coordination service. A peer that
never starts (its port is taken, it was not launched, it crashed) makes the
others wait forever, and TensorFlow's own SIGTERM handler swallows the signal
meanwhile (measured with TensorFlow 2.21: a task blocked at start-up outlived
SIGTERM for minutes).

`bounded_startup` guards that call. TensorFlow holds the GIL while it waits,
so no Python thread of the process can act: a small helper process watches
instead. Once the limit passes it prints one line
``tfdist: StartupTimeoutError: ...`` naming the tasks not answering and their
addresses, and SIGKILLs the blocked process; on SIGTERM, SIGINT or SIGUSR1 it
prints ``tfdist: SIGTERM during cluster start-up; exiting`` and does the same.
The blocked process therefore ends killed by SIGKILL (exit status 137 in a
shell, -9 from ``subprocess``) within about 0.2 s of the limit or the signal.

Signals are blocked in the main thread for the duration (and so in every
thread TensorFlow starts meanwhile): they stay pending, where the helper sees
them in ``/proc/PID/status``, and TensorFlow's handler never swallows them.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

from tfdist import _net
from tfdist.cluster.info import ClusterInfo
from tfdist.errors import StartupTimeoutError

__all__ = ["bounded_startup", "missing_tasks", "startup_timeout_message",
           "leader_lost_message", "DEFAULT_STARTUP_TIMEOUT"]

#: Seconds a task waits for the rest of its cluster by default.
DEFAULT_STARTUP_TIMEOUT = 300.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_FIELDS = ("source", "cluster", "task_type", "task_id", "origin")


def missing_tasks(info: ClusterInfo, *, probe_timeout: float = 0.5
                  ) -> list[tuple[str, str]]:
  """``(task, address)`` of every other task whose address does not answer."""
  missing = []
  for job in sorted(info.cluster):
    for index, address in enumerate(info.cluster[job]):
      if (job, index) == (info.task_type, info.task_id):
        continue
      if not _net.reachable(address, probe_timeout):
        missing.append((f"{job}:{index}", address))
  return missing


def startup_timeout_message(info: ClusterInfo, timeout: float) -> str:
  """The `StartupTimeoutError` text for ``info`` after ``timeout`` seconds."""
  return _message(info, f"did not start within {timeout:g} s",
                  "raise startup_timeout_seconds")


def leader_lost_message(info: ClusterInfo, error: str) -> str:
  """The `StartupTimeoutError` text when the leader went away mid start-up.

  The leader (the first chief or worker) runs TensorFlow's coordination
  service; when its own start-up bound ends it, the others' wait fails with
  ``UnavailableError: Socket closed`` before their bound does.
  """
  job = "chief" if info.cluster.get("chief") else "worker"
  leader = f"{job}:0 at {info.cluster[job][0]}"
  return _message(
      info, f"did not start: the leader {leader} went away during start-up "
      f"({error.splitlines()[0][:120]})",
      "see the leader's log for why it ended")


def _message(info: ClusterInfo, why: str, fix: str) -> str:
  me = f"{info.task_type}:{info.task_id}"
  missing = missing_tasks(info)
  if missing:
    who = ", ".join(f"{task} at {address}" for task, address in missing)
    what = f"no answer from {who}"
  else:
    who = ", ".join(f"{job}:{i} at {a}" for job in sorted(info.cluster)
                    for i, a in enumerate(info.cluster[job]))
    what = (f"every address answers, but not every task joined ({who}); an "
            "address may be taken by another program, or a task was started "
            "with another cluster")
  return (f"{me}: the cluster {why}: {what} ({info.origin}). Start the "
          f"missing tasks, check their addresses and ports, or {fix}")


@contextlib.contextmanager
def bounded_startup(info: ClusterInfo, timeout: float | None
                    ) -> Iterator[None]:
  """Ends the process if the block outlives ``timeout`` or gets a signal.

  Args:
    info: this task's cluster, to name the missing tasks.
    timeout: seconds; ``None`` or 0 disables the bound (signals still end a
      blocked start-up).

  Yields:
    Nothing; the guarded block runs in the caller.
  """
  if threading.current_thread() is not threading.main_thread():
    yield  # Signal masks and exits belong to the main thread's owner.
    return
  old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
  spec = json.dumps({"info": {k: info.to_dict()[k] for k in _FIELDS},
                     "timeout": timeout or 0})
  helper = subprocess.Popen(
      [sys.executable, "-c", _HELPER, str(os.getpid()), spec],
      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=None,
      env={**os.environ, "PYTHONPATH": _ROOT + os.pathsep +
           os.environ.get("PYTHONPATH", "")})
  try:
    yield
  finally:
    helper.stdin.close()  # EOF: the helper ends without doing anything.
    try:
      helper.wait(timeout=5)
    except subprocess.TimeoutExpired:
      helper.kill()
      helper.wait(timeout=5)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


# Runs in a separate small process: the TensorFlow call being guarded holds
# the GIL, so no thread of this process could act. Signals stay pending in
# the blocked process, where /proc shows them.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_HELPER = "import sys; from tfdist.strategy import startup; startup._watch()"


def _watch() -> None:
  """The helper: SIGKILLs the parent on a pending signal or past the limit."""
  parent, spec = int(sys.argv[1]), json.loads(sys.argv[2])
  timeout = spec["timeout"]
  deadline = time.monotonic() + timeout if timeout else None
  wanted = {s: 1 << (int(s) - 1) for s in _SIGNALS}
  # A signal sent to the task's process group (tfdist launch, srun, scancel)
  # reaches this helper too; one sent to the blocked PID alone stays pending
  # there unless a thread TensorFlow started earlier takes it.
  for signum in _SIGNALS:
    signal.signal(signum, lambda n, _: _kill(
        parent, f"tfdist: {signal.Signals(n).name} during cluster start-up; "
                "exiting"))
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)  # Inherited blocked.
  while True:
    ready, _, _ = select.select([sys.stdin], [], [], 0.2)
    if ready and not os.read(sys.stdin.fileno(), 64):
      return  # The start-up finished (or the parent is gone).
    pending = _pending(parent)
    for signum, bit in wanted.items():
      if pending & bit:
        _kill(parent, f"tfdist: {signum.name} during cluster start-up; "
                      "exiting")
    if deadline is not None and time.monotonic() > deadline:
      info = ClusterInfo(**spec["info"])
      error = StartupTimeoutError(startup_timeout_message(info, timeout))
      _kill(parent, f"tfdist: StartupTimeoutError: {error}")


def _pending(pid: int) -> int:
  mask = 0
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith(("SigPnd:", "ShdPnd:")):
          mask |= int(line.split()[1], 16)
  except OSError:
    pass
  return mask


def _kill(pid: int, line: str) -> None:
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  try:
    os.kill(pid, signal.SIGKILL)  # Our parent, which started us.
  except ProcessLookupError:
    pass
  sys.exit(0)

