"""A bound on cluster start-up that TensorFlow does not give, and the
signal contract before training starts.

Building `MultiWorkerMirroredStrategy` blocks inside TensorFlow until every
task has registered; a peer that never starts makes the others wait forever,
and TensorFlow's SIGTERM handler swallows the signal meanwhile.

`bounded_startup` guards that call. TensorFlow holds the GIL while it waits,
so no Python thread of the process can act: a small helper process watches
instead. Once the limit passes it prints one line
``tfdist: StartupTimeoutError: ...`` naming the tasks not answering, and
SIGKILLs the blocked process. A stop signal ends it with that signal's
contract, saving nothing: on SIGTERM or SIGUSR1 the process exits with 42
(through a real-time signal whose handler is the C library's ``_exit``, which
needs no GIL); on SIGINT it is ended by SIGINT.

SIGTERM and SIGUSR1 are blocked in the main thread for the duration (and so
in every thread TensorFlow starts meanwhile): they stay pending, where the
helper sees them in ``/proc/PID/status``, and TensorFlow's handler never
swallows them. One taken by a thread that TensorFlow started before reaches
the helper through Python's wakeup file descriptor.

`install_stop_handlers` covers the rest of start-up, until training watches
signals (`tfdist.training.preemption`): SIGTERM and SIGUSR1 end the process
at once with code 42 and one line saying that nothing was saved; SIGINT keeps
Python's meaning, so an interactive session survives Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

from tfdist import _net
from tfdist.cluster.info import ClusterInfo
from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import PREEMPTION_SIGNALS
from tfdist.errors import STOP_SIGNALS
from tfdist.errors import StartupTimeoutError

__all__ = ["bounded_startup", "missing_tasks", "startup_timeout_message",
           "leader_lost_message", "install_stop_handlers", "StopBeforeTraining",
           "DEFAULT_STARTUP_TIMEOUT"]

#: Seconds a task waits for the rest of its cluster by default.
DEFAULT_STARTUP_TIMEOUT = 300.0
_SIGNALS = tuple(STOP_SIGNALS)
#: The real-time signal whose handler is ``_exit``: its number is the code.
_EXIT_SIGNAL = PREEMPTED_EXIT_CODE
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


class StopBeforeTraining:
  """The handler of SIGTERM and SIGUSR1 before training watches signals.

  Nothing can be saved yet: it says so in one line and ends the process at
  once with the signal's code (42). Training's `PreemptionWatcher` replaces
  it, and gives back ``previous`` (what was there before tfdist) when done.
  """

  def __init__(self, previous: Any):
    self.previous = previous

  def __call__(self, signum: int, frame: Any) -> None:
    del frame
    code = STOP_SIGNALS[signum]
    sys.stderr.write(
        f"tfdist: {signal.Signals(signum).name} with nothing to save yet "
        "(start-up, restore, or training without a backup); exiting with "
        f"code {code}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)  # No clean-up that could wait on a peer: nothing to keep.


def install_stop_handlers() -> None:
  """Installs `StopBeforeTraining` for SIGTERM and SIGUSR1 (main thread).

  A handler a user installed is kept; the default action and a handler
  TensorFlow set in C++ (it reads as ``None``) are replaced.
  """
  if threading.current_thread() is not threading.main_thread():
    return
  for signum in PREEMPTION_SIGNALS:
    current = signal.getsignal(signum)
    if isinstance(current, StopBeforeTraining):
      continue
    if current in (None, signal.SIG_DFL):
      signal.signal(signum, StopBeforeTraining(signal.SIG_DFL))


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
  install_stop_handlers()
  old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
  old_int = signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ends it, 130.
  old_exit = _set_exit_handler()
  wake_read, wake_write = os.pipe()
  os.set_blocking(wake_write, False)
  old_wakeup = signal.set_wakeup_fd(wake_write)
  spec = json.dumps({"info": {k: info.to_dict()[k] for k in _FIELDS},
                     "timeout": timeout or 0, "wakeup": wake_read,
                     "exit_signal": old_exit is not None})
  try:
    helper = subprocess.Popen(
        [sys.executable, "-c", _HELPER, str(os.getpid()), spec],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=None,
        pass_fds=(wake_read,),
        env={**os.environ, "PYTHONPATH": _net.REPO_ROOT + os.pathsep +
             os.environ.get("PYTHONPATH", "")})
  finally:
    os.close(wake_read)
  try:
    yield
  finally:
    helper.stdin.close()  # EOF: the helper ends without doing anything.
    try:
      helper.wait(timeout=5)
    except subprocess.TimeoutExpired:
      helper.kill()
      helper.wait(timeout=5)
    signal.set_wakeup_fd(old_wakeup)
    os.close(wake_write)
    if old_exit is not None:
      _libc().signal(_EXIT_SIGNAL, old_exit)
    # TensorFlow may have set its own SIGTERM handler meanwhile.
    install_stop_handlers()
    signal.signal(signal.SIGINT, old_int)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _libc() -> ctypes.CDLL:
  libc = ctypes.CDLL(None)
  libc.signal.restype = ctypes.c_void_p
  libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
  return libc


def _set_exit_handler() -> int | None:
  """Makes `_EXIT_SIGNAL` call ``_exit(_EXIT_SIGNAL)``; the old handler.

  A C handler runs in whichever thread takes the signal without the GIL,
  which TensorFlow holds while it waits. ``None`` where that cannot be set;
  the helper then SIGKILLs instead.
  """
  if not signal.SIGRTMIN <= _EXIT_SIGNAL <= signal.SIGRTMAX:
    return None
  try:
    libc = _libc()
    return libc.signal(_EXIT_SIGNAL,
                       ctypes.cast(libc._exit, ctypes.c_void_p)) or 0
  except (OSError, AttributeError):
    return None


# Runs in a separate small process: the TensorFlow call being guarded holds
# the GIL, so no thread of this process could act. Signals stay pending in
# the blocked process, where /proc shows them.
_HELPER = "import sys; from tfdist.strategy import startup; startup._watch()"


def _watch() -> None:
  """The helper: ends the parent on a stop signal or past the limit."""
  parent, spec = int(sys.argv[1]), json.loads(sys.argv[2])
  timeout = spec["timeout"]
  deadline = time.monotonic() + timeout if timeout else None
  wanted = {s: 1 << (int(s) - 1) for s in _SIGNALS}
  stop = lambda signum: _stop(parent, signum, spec["exit_signal"])
  # A signal sent to the task's process group (tfdist launch, srun, scancel)
  # reaches this helper too; one sent to the blocked PID alone stays pending
  # there, or reaches us through the wakeup pipe when a thread took it.
  for signum in _SIGNALS:
    signal.signal(signum, lambda n, _: stop(n))
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)  # Inherited blocked.
  wakeup = spec["wakeup"]
  while True:
    ready, _, _ = select.select([sys.stdin, wakeup], [], [], 0.2)
    if sys.stdin in ready and not os.read(sys.stdin.fileno(), 64):
      return  # The start-up finished (or the parent is gone).
    if wakeup in ready:
      for signum in os.read(wakeup, 64):
        if signum in wanted:
          stop(signal.Signals(signum))
    pending = _pending(parent)
    for signum, bit in wanted.items():
      if pending & bit:
        stop(signum)
    if deadline is not None and time.monotonic() > deadline:
      info = ClusterInfo(**spec["info"])
      error = StartupTimeoutError(startup_timeout_message(info, timeout))
      _kill(parent, f"tfdist: StartupTimeoutError: {error}", signal.SIGKILL)


def _stop(parent: int, signum: int, exit_signal: bool) -> None:
  """Ends the parent with ``signum``'s code (42, or killed by SIGINT)."""
  code = STOP_SIGNALS[signum]
  line = (f"tfdist: {signal.Signals(signum).name} during cluster start-up: "
          f"nothing to save yet; exiting with code {code}")
  if signum == signal.SIGINT:
    _kill(parent, line, signal.SIGINT)  # Its default action there: 130.
  _kill(parent, line, _EXIT_SIGNAL if exit_signal else signal.SIGKILL)


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


def _kill(pid: int, line: str, signum: int) -> None:
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  try:
    os.kill(pid, signum)  # Our parent, which started us.
  except ProcessLookupError:
    pass
  sys.exit(0)

