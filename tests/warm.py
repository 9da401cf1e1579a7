"""Warm starts for test children: forked from an interpreter that imported TF.

Most of a test child's start is importing TensorFlow and Keras: about 4-8 s
of CPU on this machine, in some 600 children a suite run. A `Zygote` pays it
once: it imports them and tfdist, then forks one child per request. Each
child is a process of its own (its own PID, session, TF_CONFIG, memory), set up as a
fresh ``python script.py args`` would be: its argv, ``sys.path[0]``,
environment, working directory, stdio, faulthandler, temporary directory
and random seeds, then the script runs as ``__main__``. What a fork cannot
change is fixed when the zygote starts, so a zygote serves only children
whose `startup_key` (the interpreter and the variables read at start-up)
is its own; `spawn` keeps one per key and starts others cold.

Not for tests of what a fresh process looks like (``Tasks(warm=False)``):
the modules already imported, ``/proc/PID/cmdline`` (the zygote's), the
parent PID (the zygote), the hash seed.

Run as a script, this module is the zygote's main: it serves the socket
given as its argument's file descriptor.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Mapping, Sequence

#: Variables read while an interpreter starts or while the zygote imports.
_STARTUP = ("PYTHON", "TF_CPP_", "TF_ENABLE_", "TF_USE_", "KERAS_", "CUDA_",
            "LD_", "OMP_", "MALLOC", "XLA_")
#: Of those, the ones each child sets up for itself.
_PER_CHILD = ("PYTHONFAULTHANDLER",)
_MAX_MESSAGE = 1 << 20
#: Set (not "0") in the test run's environment: every child starts cold.
COLD_VARIABLE = "TFDIST_TESTS_COLD"


def startup_key(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
  """What a zygote for ``argv`` must have started with; None: start cold.

  Only ``python SCRIPT.py ...`` is started warm (no interpreter options).
  """
  if (len(argv) < 2 or argv[0] != sys.executable
      or not argv[1].endswith(".py") or argv[1].startswith("-")):
    return None
  return json.dumps(sorted(
      (k, v) for k, v in env.items()
      if k.startswith(_STARTUP) and k not in _PER_CHILD))


# ------------------------------------------------------------ test side.


class WarmProcess:
  """The `subprocess.Popen` subset `cluster_utils.Tasks` uses, for a child
  of a zygote (which reaps it and sends its wait status)."""

  def __init__(self, args: Sequence[str], status: socket.socket,
               stdout) -> None:
    self.args, self.stdout, self.returncode = list(args), stdout, None
    self._status = status
    self.pid = int(status.recv(64))

  def poll(self) -> int | None:
    return self.wait(0, _raise=False)

  def wait(self, timeout: float | None = None, *, _raise: bool = True):
    if self.returncode is None:
      if select.select([self._status], [], [], timeout)[0]:
        status = self._status.recv(64)
        if not status:
          raise RuntimeError(f"the zygote of PID {self.pid} ended first")
        self.returncode = os.waitstatus_to_exitcode(int(status))
        self._status.close()
      elif _raise:
        raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def send_signal(self, signum: int) -> None:
    if self.poll() is None:
      try:
        os.kill(self.pid, signum)
      except ProcessLookupError:
        pass  # Ended; its status is on its way.


class Zygote:
  """One warm interpreter, started with ``env``; forks a child per `spawn`."""

  def __init__(self, env: Mapping[str, str]) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self._proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
        env=dict(env), pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    theirs.close()
    self._socket, self._lock = ours, threading.Lock()

  def spawn(self, argv: Sequence[str], *, env: Mapping[str, str],
            cwd: str | None, stderr: int | None) -> WarmProcess:
    """Starts ``argv`` as a child of the zygote, in a session of its own;
    its stdout is a pipe (text), its stderr the file descriptor ``stderr``
    (None: into stdout)."""
    read, write = os.pipe()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
      request = json.dumps({"argv": list(argv), "env": dict(env),
                            "cwd": cwd or os.getcwd()}).encode()
      fds = [null, write, write if stderr is None else stderr,
             theirs.fileno()]
      with self._lock:
        socket.send_fds(self._socket, [request], fds)
    finally:
      for fd in (null, write, theirs.detach()):
        os.close(fd)
    ours.settimeout(60)  # Its PID comes as soon as it is forked.
    process = WarmProcess(argv, ours, open(read, errors="replace"))
    ours.settimeout(None)
    return process

  def alive(self) -> bool:
    """Whether it still serves (it leaves when this process closes its
    socket, at exit)."""
    return self._proc.poll() is None


_zygotes: dict[str, Zygote] = {}
_zygotes_lock = threading.Lock()


def spawn(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None,
          stderr: int | None, warm: bool = True):
  """A warm child for ``argv`` where a zygote can start it, else a Popen."""
  cold = os.environ.get(COLD_VARIABLE, "") not in ("", "0")
  key = startup_key(argv, env) if warm and not cold else None
  if key is None:
    return subprocess.Popen(
        argv, cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if stderr is None else stderr, text=True,
        errors="replace", start_new_session=True)
  with _zygotes_lock:
    zygote = _zygotes.get(key)
    if zygote is None or not zygote.alive():
      zygote = _zygotes[key] = Zygote(
          {k: v for k, v in env.items() if k not in _PER_CHILD})
  return zygote.spawn(argv, env=env, cwd=cwd, stderr=stderr)


# ------------------------------------------------------------ zygote side.


def _serve(control: socket.socket) -> dict:
  """Forks a child per request until the test process leaves; returns, in
  the child, its request."""
  wake_read, wake_write = os.pipe()
  os.set_blocking(wake_write, False)
  signal.set_wakeup_fd(wake_write)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  children: dict[int, socket.socket] = {}
  while True:
    ready = select.select([control, wake_read], [], [])[0]
    if wake_read in ready:
      os.read(wake_read, 4096)
    while children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        break
      with children.pop(pid) as status_socket, contextlib.suppress(OSError):
        status_socket.send(str(status).encode())  # Unless no one waits.
    if control not in ready:
      continue
    message, fds, _, _ = socket.recv_fds(control, _MAX_MESSAGE, 4)
    if not message:
      sys.exit(0)  # The test process left; its children are its to end.
    status_socket = socket.socket(fileno=fds[3])
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      signal.set_wakeup_fd(-1)
      signal.signal(signal.SIGCHLD, signal.SIG_DFL)
      for fd in (wake_read, wake_write, control.detach(),
                 status_socket.detach(),
                 *(s.detach() for s in children.values())):
        os.close(fd)
      os.setsid()
      for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
      for fd in set(fds[:3]):
        if fd > 2:
          os.close(fd)
      return json.loads(message)
    for fd in set(fds[:3]):
      os.close(fd)
    status_socket.send(str(pid).encode())
    children[pid] = status_socket


def _become(request: dict) -> str:
  """Sets this forked child up as ``python SCRIPT ...`` would start; returns
  the script's path."""
  import faulthandler  # pylint: disable=g-import-not-at-top
  import random  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  script = request["argv"][1]
  sys.argv = request["argv"][1:]
  sys.path[0] = os.path.dirname(os.path.abspath(script))
  tempfile.tempdir = None  # TMPDIR is the child's.
  random.seed()
  if "numpy" in sys.modules:
    sys.modules["numpy"].random.seed()
  if os.environ.get("PYTHONFAULTHANDLER"):
    faulthandler.enable()
  return script


if __name__ == "__main__":
  _control = socket.socket(fileno=int(sys.argv[1]))
  # What most test scripts import first (importing tfdist changes nothing:
  # tests/test_import_state.py).
  import keras  # pylint: disable=g-import-not-at-top,unused-import
  import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
  import tfdist.training  # pylint: disable=g-import-not-at-top,unused-import
  _script = _become(_serve(_control))
  del _control
  import runpy  # pylint: disable=g-import-not-at-top
  runpy.run_path(_script, run_name="__main__")
