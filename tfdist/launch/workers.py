"""This node's tasks of one round: started, polled, signalled, stopped.

Every task leads a process group (and session) of its own, and a
parent-death signal (Linux ``PR_SET_PDEATHSIG``) SIGKILLs it when the
launcher dies, even of SIGKILL: the kernel sends it when the thread that
started the task ends. Every wait is bounded: a task that ignores SIGTERM is
killed after ``grace_seconds`` (`tfdist.launch.stopper`).

Tasks of one node share its cores: unless the user set it, each gets
``TF_NUM_INTRAOP_THREADS`` = the cores this launcher may use over the tasks
of this node (at least 1), as torchrun sets ``OMP_NUM_THREADS``. Each
TensorFlow process otherwise sizes its intra-op pool to every core, and N
pools on the same cores slow each other (docs/benchmarks.md, "Tasks that
share cores").
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence, TextIO

from tfdist import _process
from tfdist.errors import ConfigError
from tfdist.launch import output
from tfdist.launch import stopper

__all__ = ["Workers"]

#: A task that could not be started -> the field to blame.
_START_ERRORS = {errno.EMFILE: "num_workers", errno.ENFILE: "num_workers",
                 errno.EAGAIN: "num_workers", errno.ENOMEM: "num_workers"}
_PR_SET_PDEATHSIG = 1  # From <linux/prctl.h>.


@dataclasses.dataclass
class Task:
  role: str
  config: dict
  proc: subprocess.Popen
  tail: collections.deque
  reader: threading.Thread
  log: TextIO | None

  @property
  def kind(self) -> str:
    return self.config["task"]["type"]


class Workers:
  """The tasks (``tasks``) of ``spec`` on this node, their output to
  ``console``; errors name ``spec``'s fields and ``source``."""

  def __init__(self, *, spec, console: output.Console, source: str):
    self._spec, self._console, self._source = spec, console, source
    self._log_dir, self._grace = spec.log_dir, spec.grace_seconds
    self.tasks: list[Task] = []
    self.signalled = False  # A signal was forwarded: they were asked.

  def start(self, configs: list[dict], env: dict[str, str],
            gpus: Sequence[str | None]) -> None:
    """Starts a task per TF_CONFIG, then their readers (no thread runs while
    the launcher forks), or none: a ConfigError when one cannot start."""
    if len(configs) > 1 and _process.INTRA_OP not in env:
      share = max(1, _process.cores() // len(configs))
      env = {**env, _process.INTRA_OP: str(share)}
    paths = [os.path.join(self._log_dir,
                          f"{c['task']['type']}-{c['task']['index']}.log")
             if self._log_dir else None for c in configs]
    logs: list[TextIO | None] = []
    self.tasks = []
    try:
      for path in paths:
        logs.append(open(path, "a") if path else None)
      for config, log, gpu in zip(configs, logs, gpus):
        if not self.signalled:
          extra = {} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu}
          self.tasks.append(self._start(config, {**env, **extra}, log))
    except OSError as e:
      for log in logs[len(self.tasks):]:
        if log:
          log.close()
      self.stop()
      field = ("log_dir" if len(logs) < len(configs)
               else _START_ERRORS.get(e.errno, "command"))
      raise ConfigError(
          field=field, value=getattr(self._spec, field), source=self._source,
          expected="a cluster this machine can start and log",
          hint=f"task {len(self.tasks)} could not start: {e}") from None
    for t in self.tasks:
      t.reader.start()

  def _start(self, config: dict, env: dict[str, str],
             log: TextIO | None) -> Task:
    task = config["task"]
    role = f"{task['type']}:{task['index']}"
    proc = subprocess.Popen(
        self._spec.command, env={**env, "TF_CONFIG": json.dumps(config)},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=_die_with(os.getpid()))
    reader, tail = self._console.reader(role, proc.stdout, log)
    return Task(role, config, proc, tail, reader, log)

  def signal(self, signum: int) -> None:
    """Sends ``signum`` to every task's process group."""
    self.signalled = True
    for t in self.tasks:
      stopper.signal_group(t.proc, signum)

  def failed(self) -> Task | None:
    """The first task that exited with an error (its output read)."""
    for t in self.tasks:
      if t.proc.poll() not in (None, 0):
        t.reader.join(timeout=5)
        return t
    return None

  def finish_evaluator(self) -> Task | None:
    """Gives the evaluator ``grace_seconds`` to end; one that failed by
    itself, or ``None``."""
    deadline = time.monotonic() + self._grace
    for t in self.tasks:
      if t.kind == "evaluator":
        while t.proc.poll() is None and time.monotonic() < deadline:
          time.sleep(0.1)
        if t.proc.poll() not in (None, 0):
          t.reader.join(timeout=5)
          return t
    return None

  def pids(self) -> dict[str, int]:
    return {t.role: t.proc.pid for t in self.tasks}

  def tails(self) -> dict[str, collections.deque]:
    """Each task's last lines, live: a line read later is in them too."""
    return {t.role: t.tail for t in self.tasks}

  def stop(self) -> None:
    """Stops every task (`stopper.stop`; a forwarded signal already asked
    them), then lets their readers finish."""
    stopper.stop([t.proc for t in self.tasks], grace_seconds=self._grace,
                 asked=self.signalled)
    for t in self.tasks:
      if t.reader.is_alive():
        t.reader.join(timeout=5)
      elif t.reader.ident is None:  # Never started: nothing to read.
        t.proc.stdout.close()
        if t.log:
          t.log.close()


def _die_with(parent: int) -> Callable[[], None] | None:
  """A ``preexec_fn`` asking the kernel to SIGKILL the task when ``parent``
  (the launching thread) ends; ``None`` where Linux's prctl is missing."""
  prctl = getattr(_LIBC, "prctl", None)
  if prctl is None:
    return None

  def preexec() -> None:
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # The launcher died before prctl.
      os.kill(os.getpid(), signal.SIGKILL)
  return preexec


def _load_libc() -> ctypes.CDLL | None:
  if not sys.platform.startswith("linux"):
    return None
  try:
    return ctypes.CDLL(None, use_errno=True)
  except OSError:
    return None


_LIBC = _load_libc()
