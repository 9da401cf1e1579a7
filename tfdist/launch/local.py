"""Every task of a cluster as a local process (``tfdist launch``).

TensorFlow has no ``torchrun``. `launch` starts one process per task on this
machine, each with its own TF_CONFIG on free ports, prefixes each line of
output with the task's role, forwards SIGINT and SIGTERM, and never leaves a
process behind:

* a task that fails stops the others, and the launcher reports which task,
  its exit code and the tail of its output, then exits with that code;
* once the training tasks (chief, workers under MultiWorkerMirrored) finish,
  the servers (ps, and workers under ParameterServer) are stopped;
* ``max_restarts`` relaunches the whole cluster after a failure; each task
  sees ``TFDIST_RESTART`` (0 on the first run).

Every wait is bounded: a task that ignores SIGTERM is killed after
``grace_seconds``.

`LaunchSpec` is a pure value, like torch's ``LaunchConfig``: building one
checks what needs no I/O; `preflight` checks what this machine must provide
(the program, the script, free ports) and `launch` runs it before starting
anything.

Example:
  >>> spec = LaunchSpec(num_workers=2, command=("python", "train.py"))
  >>> launch(spec)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence, TextIO

from tfdist import _net
from tfdist.errors import ConfigError

__all__ = ["LaunchSpec", "Launcher", "launch", "preflight", "TaskFailure"]

_SOURCE = "LaunchSpec"
_TAIL_LINES = 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchSpec:
  """What to launch; building one does no I/O.

  Attributes:
    command: the program and its arguments, run once per task.
    num_workers: number of ``worker`` tasks (at least 1).
    num_ps: number of ``ps`` tasks; with num_ps > 0 a ``chief`` (the
      coordinator) is always added.
    chief: add a ``chief`` task.
    evaluator: add an ``evaluator`` task.
    host: the address every task binds, ``127.0.0.1`` by default.
    port_base: first port; consecutive ports from there must be free (checked
      by `preflight`). Free ports are picked when ``None``.
    log_dir: also write each task's output to ``<log_dir>/<type>-<index>.log``
      (created when launching).
    max_restarts: relaunch the cluster up to this many times after a failure.
    grace_seconds: how long a task may take to exit after SIGTERM.
    env: extra environment for every task.

  Raises:
    ConfigError: a value that cannot work, naming the field.
  """
  command: tuple[str, ...]
  num_workers: int = 1
  num_ps: int = 0
  chief: bool = False
  evaluator: bool = False
  host: str = "127.0.0.1"
  port_base: int | None = None
  log_dir: str | None = None
  max_restarts: int = 0
  grace_seconds: float = 10.0
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "command", tuple(self.command))
    _int_at_least("num_workers", self.num_workers, 1,
                  hint="Every cluster needs a worker: set num_workers to 1 "
                        "or more")
    _int_at_least("num_ps", self.num_ps, 0)
    _int_at_least("max_restarts", self.max_restarts, 0)
    if not self.grace_seconds > 0:
      raise ConfigError(field="grace_seconds", value=self.grace_seconds,
                        expected="a positive number of seconds", source=_SOURCE)
    if not self.command:
      raise ConfigError(field="command", value=self.command, source=_SOURCE,
                        expected="a program and its arguments, e.g. "
                                 "('python', 'train.py')")
    if self.port_base is not None:
      _int_at_least("port_base", self.port_base, 1024)
      if self.port_base + self.num_tasks - 1 > 65535:
        raise ConfigError(field="port_base", value=self.port_base,
                          source=_SOURCE,
                          expected=f"at most {65536 - self.num_tasks} for "
                                   f"{self.num_tasks} tasks")

  @property
  def jobs(self) -> dict[str, int]:
    """Job name to task count, in start order."""
    chief = int(self.chief or self.num_ps > 0)
    return {k: v for k, v in (("chief", chief), ("worker", self.num_workers),
                              ("ps", self.num_ps)) if v}

  @property
  def num_tasks(self) -> int:
    return sum(self.jobs.values()) + int(self.evaluator)

  def tf_configs(self) -> list[dict]:
    """One TF_CONFIG per task: the cluster tasks, then the evaluator."""
    configs = _net.cluster_tf_configs(self.jobs, host=self.host,
                                      port_base=self.port_base)
    if self.evaluator:
      configs.append({"cluster": configs[0]["cluster"],
                      "task": {"type": "evaluator", "index": 0}})
    return configs


def preflight(spec: LaunchSpec) -> None:
  """Checks what ``spec`` needs from this machine, before anything starts.

  The program must be on PATH (and a Python script must exist), and with a
  ``port_base`` the ports of every task must be free on ``host``.

  Raises:
    ConfigError: the first thing missing, naming the field.
  """
  program = spec.command[0]
  if shutil.which(program) is None:
    raise ConfigError(field="command", value=program, source=_SOURCE,
                      expected="a program on PATH or a path to an executable")
  if os.path.basename(program).startswith("python") and len(spec.command) > 1:
    script = spec.command[1]
    if not script.startswith("-") and not os.path.isfile(script):
      raise ConfigError(field="script", value=script, source=_SOURCE,
                        expected="an existing Python file")
  if spec.port_base is not None:
    ports = range(spec.port_base, spec.port_base + spec.num_tasks)
    taken = [p for p in ports if _net.port_problem(spec.host, p)]
    if taken:
      raise ConfigError(
          field="port_base", value=spec.port_base, source=_SOURCE,
          expected=(f"{spec.num_tasks} free ports from {spec.port_base}; "
                    f"port {taken[0]} on {spec.host} is taken"),
          hint="Pick another port_base or leave it out to use free ports")


class TaskFailure(Exception):
  """A task exited non-zero (internal to the launcher)."""

  def __init__(self, role: str, code: int, tail: Sequence[str]):
    super().__init__(role, code)
    self.role, self.code, self.tail = role, code, list(tail)


@dataclasses.dataclass
class _Task:
  role: str
  config: dict
  proc: subprocess.Popen
  tail: collections.deque
  reader: threading.Thread

  @property
  def kind(self) -> str:
    return self.config["task"]["type"]


class Launcher:
  """Runs a `LaunchSpec`; `run` returns the exit code.

  Raises:
    ConfigError: from `run`, when `preflight` fails; nothing has started.
  """

  def __init__(self, spec: LaunchSpec, *, out: TextIO | None = None):
    self._spec = spec
    self._out = out or sys.stdout
    self._lock = threading.Lock()
    self._tasks: list[_Task] = []
    self._signal: int | None = None

  def run(self) -> int:
    preflight(self._spec)
    handlers = {s: signal.signal(s, self._on_signal)
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
      for attempt in range(self._spec.max_restarts + 1):
        try:
          return self._run_once(attempt)
        except TaskFailure as failure:
          self._report(failure)
          if self._signal is not None or attempt == self._spec.max_restarts:
            return failure.code if failure.code > 0 else 1
          self._say(f"restarting the cluster ({attempt + 1} of "
                    f"{self._spec.max_restarts})")
      return 1  # Unreachable: the loop always returns.
    finally:
      self._stop_all()
      for s, h in handlers.items():
        signal.signal(s, h)

  def _run_once(self, attempt: int) -> int:
    self._tasks = [self._start(c, attempt) for c in self._spec.tf_configs()]
    servers = "ps" in self._spec.jobs  # Workers only serve under PS.
    trainers = [t for t in self._tasks
                if t.kind == "chief" or (t.kind == "worker" and not servers)]
    while True:
      if self._signal is not None:
        self._stop_all()
        return 128 + self._signal
      for t in self._tasks:
        code = t.proc.poll()
        if code not in (None, 0):
          t.reader.join(timeout=5)
          self._stop_all()
          raise TaskFailure(t.role, code, t.tail)
      if all(t.proc.poll() == 0 for t in trainers):
        self._finish_evaluator()
        self._stop_all()
        return 0
      time.sleep(0.1)

  def _finish_evaluator(self) -> None:
    deadline = time.monotonic() + self._spec.grace_seconds
    for t in self._tasks:
      if t.kind == "evaluator":
        while t.proc.poll() is None and time.monotonic() < deadline:
          time.sleep(0.1)

  def _start(self, config: dict, attempt: int) -> _Task:
    task = config["task"]
    role = f"{task['type']}:{task['index']}"
    env = dict(os.environ)
    env.update(self._spec.env)
    env.update(TF_CONFIG=json.dumps(config), TFDIST_RESTART=str(attempt),
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(self._spec.command, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    tail: collections.deque = collections.deque(maxlen=_TAIL_LINES)
    log = None
    if self._spec.log_dir:
      os.makedirs(self._spec.log_dir, exist_ok=True)
      log = open(os.path.join(self._spec.log_dir,
                              f"{task['type']}-{task['index']}.log"), "a")
    reader = threading.Thread(target=self._pump,
                              args=(role, proc.stdout, tail, log), daemon=True)
    reader.start()
    return _Task(role, config, proc, tail, reader)

  def _pump(self, role, stream, tail, log) -> None:
    """Copies a task's output with its role before each line.

    A carriage return (a progress bar redrawing its line) is passed on at
    once with the prefix, so bars stay live.
    """
    pending = b""
    try:
      for chunk in iter(lambda: stream.read1(65536), b""):
        pending += chunk
        while True:
          cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r"))
                     if i >= 0), default=-1)
          if cut < 0:
            break
          piece, end = pending[:cut], pending[cut:cut + 1]
          pending = pending[cut + 1:]
          self._emit(role, piece.decode(errors="replace"), end == b"\n",
                     tail, log)
      if pending:
        self._emit(role, pending.decode(errors="replace"), True, tail, log)
    finally:
      if log:
        log.close()

  def _emit(self, role, text, newline, tail, log) -> None:
    if newline:
      tail.append(text)
      if log:
        log.write(text + "\n")
        log.flush()
    with self._lock:
      if newline:
        self._out.write(f"[{role}] {text}\n")
      elif text:
        self._out.write(f"\r[{role}] {text}")
      self._out.flush()

  def _on_signal(self, signum, frame) -> None:
    del frame
    self._signal = signum
    for t in self._tasks:
      _signal_group(t.proc, signum)

  def _stop_all(self) -> None:
    """SIGTERM every live task, then SIGKILL what outlives the grace period."""
    live = [t for t in self._tasks if t.proc.poll() is None]
    for t in live:
      _signal_group(t.proc, signal.SIGTERM)
    deadline = time.monotonic() + self._spec.grace_seconds
    for t in live:
      try:
        t.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    for t in self._tasks:
      if t.proc.poll() is None:
        _signal_group(t.proc, signal.SIGKILL)
        t.proc.wait(timeout=10)
      _signal_group(t.proc, signal.SIGKILL)  # Stray grandchildren, if any.
      t.reader.join(timeout=5)

  def _report(self, failure: TaskFailure) -> None:
    how = (f"was killed by signal {-failure.code}" if failure.code < 0
           else f"exited with code {failure.code}")
    lines = [f"task {failure.role} {how}; last lines of its output:"]
    lines += [f"  | {line}" for line in failure.tail] or ["  | (no output)"]
    self._say("\n".join(lines))

  def _say(self, text: str) -> None:
    with self._lock:
      self._out.write(f"tfdist: {text}\n")
      self._out.flush()


def launch(spec: LaunchSpec, *, out: TextIO | None = None) -> int:
  """Runs every task of ``spec``; returns the launcher's exit code.

  Args:
    spec: what to launch.
    out: where the tasks' prefixed output goes; ``sys.stdout`` by default.

  Returns:
    0 when the training tasks succeeded; the failed task's exit code (1 when
    it was killed by a signal) after the last restart; ``128 + N`` when the
    launcher itself got signal N.

  Raises:
    ConfigError: `preflight` failed; nothing has started.
  """
  return Launcher(spec, out=out).run()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
  try:
    os.killpg(proc.pid, signum)  # The task's own session: only what we started.
  except (ProcessLookupError, PermissionError):
    pass


def _int_at_least(field: str, value, low: int, hint: str | None = None) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected=f"an integer >= {low}", hint=hint)
