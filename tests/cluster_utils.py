"""Live multi-process clusters on localhost for tests: the one harness.

`Tasks` starts the processes of a cluster, each leading a session of its own,
reads each one's stdout line by line as it comes (stderr goes to a file) and
lets a test wait for a line, signal or kill a task and wait for exit codes.
Every wait is bounded; `Tasks.close` (or leaving its ``with`` block) SIGKILLs
the process group of every process it started that still runs, and nothing
else. `run_processes`, `run_cluster`, `run_script`, `run_alone` and
`run_to_end` run tasks to their end on that same core.

Example:
  with cluster_utils.Tasks.of_script(
      "fault_job.py", cluster_utils.worker_configs(2),
      args=["multi_worker_mirrored", "fit", backup]) as tasks:
    tasks.wait_for(0, "step 5", 240)
    tasks.signal(1, signal.SIGTERM)
    codes = tasks.wait_all(60)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Mapping, Sequence

import stalls
import warm
from tfdist import _net

__all__ = [
    "REPO",
    "SCRIPTS",
    "Process",
    "Result",
    "Tasks",
    "base_env",
    "plotting_env",
    "alive",
    "free_ports",
    "processes",
    "run_alone",
    "run_cluster",
    "run_processes",
    "run_script",
    "run_to_end",
    "session_processes",
    "tail",
    "wait_until",
    "worker_configs",
]

REPO = _net.REPO_ROOT
SCRIPTS = os.path.join(REPO, "tests", "scripts")

free_ports = _net.free_ports
base_env = _net.child_env

#: First on every child's PYTHONPATH (tests/conftest.py): its sitecustomize
#: hides matplotlib, as a base install does (tests/base_install).
BASE_INSTALL = os.path.join(REPO, "tests", "base_install")


def plotting_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
  """`base_env` for a process that draws a plot: matplotlib importable."""
  env = base_env(extra)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in env["PYTHONPATH"].split(os.pathsep) if p != BASE_INSTALL)
  return env

#: A stdout line to wait for: the line itself, or a test it must pass.
LineTest = str | Callable[[str], bool]


def tail(text: str, n: int = 3000) -> str:
  """The end of ``text``, short enough for a failure message."""
  return text[-n:]


_FATAL = re.compile(r"^(\[[^]]*\] )?Fatal Python error: "
                    r"(Segmentation fault|Aborted|Bus error)$", re.M)


def native_crash(output: str) -> bool:
  """Whether a process in ``output`` died of a fault in a thread that runs no
  Python: Python's fault handler wrote its report but named no "Current
  thread". In these tests' tasks such a thread is TensorFlow's own (tfdist
  has no native code), so the fault is TensorFlow's, not the code under test.

  Seen once, in CI on 2026-11-28: a worker of tests/test_stall.py's three
  nodes got SIGSEGV while TensorFlow aborted its collectives after their
  timeout (its main thread in ``context.get_graph_debug_info``); not seen in
  8 runs of that test since.
  """
  return bool(_FATAL.search(output)) and "Current thread" not in output


def _json_line(stdout: str, stderr: str) -> dict:
  """The last line of ``stdout`` that parses as a JSON object."""
  for line in reversed(stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  raise AssertionError(f"no JSON line in stdout:\n{stdout}\n"
                       f"stderr:\n{tail(stderr)}")


@dataclasses.dataclass
class Result:
  returncode: int
  stdout: str
  stderr: str

  def json(self) -> dict:
    """The last line of stdout that parses as a JSON object."""
    return _json_line(self.stdout, self.stderr)


# ------------------------------------------------------------ /proc.


@dataclasses.dataclass(frozen=True)
class Process:
  """One process of this machine, as /proc shows it."""
  pid: int
  state: str
  ppid: int
  pgrp: int
  session: int
  cmdline: str  # Arguments joined by spaces; empty for a zombie.


def processes() -> list[Process]:
  """Every process of this machine, zombies included."""
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        # Fields after the name: state, ppid, pgrp, session, ...
        state, ppid, pgrp, session = f.read().rsplit(")", 1)[1].split()[:4]
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
      continue  # Gone meanwhile.
    found.append(Process(int(entry), state, int(ppid), int(pgrp),
                         int(session), cmdline.strip()))
  return found


def session_processes(sid: int) -> list[int]:
  """PIDs of live processes in session ``sid`` (a process we started with
  ``start_new_session=True`` leads its own session)."""
  return [p.pid for p in processes()
          if p.session == sid and p.state not in ("Z", "X")]


def alive(pid: int) -> bool:
  """Whether process ``pid`` runs (a zombie does not)."""
  try:
    os.kill(pid, 0)
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split()[2] != "Z"
  except (ProcessLookupError, FileNotFoundError):
    return False


def wait_until(condition: Callable[[], object], timeout: float, *,
               interval: float = 0.2) -> bool:
  """Polls ``condition`` until it holds or ``timeout`` seconds of running
  have passed (`stalls`: time the machine stood still does not count).

  Returns:
    Whether it held.
  """
  start = time.monotonic()
  while not condition():
    if stalls.expired(start, timeout):
      return False
    time.sleep(interval)
  return True


# ------------------------------------------------------------ the harness.


@dataclasses.dataclass(eq=False)
class _Run:
  """One process started by `Tasks`."""
  index: int
  proc: subprocess.Popen
  err_path: str | None  # None: stderr goes into stdout.
  stdout: list[str] = dataclasses.field(default_factory=list)  # Raw lines.
  eof: bool = False
  stderr: str | None = None  # Read at close, before the file goes away.
  reader: threading.Thread | None = None


class Tasks:
  """The processes of a live cluster, started, watched and ended here.

  Task ``i`` runs ``commands[i]`` with ``envs[i]``; starting a task again
  starts a new process for it (the earlier one's stderr stays readable, see
  `stderr_of_all`). Each process leads a session of its own; a thread reads
  its stdout into lines, and its stderr goes to a file (or into stdout with
  ``merge_stderr``). Its processes' TMPDIR is a directory of its own,
  removed at `close`, unless their env names one. Output stays readable
  after `close`. Waits count
  running time (`stalls`); a task that overruns one is aborted with its
  Python stacks in the failure message (`stacks`).
  """

  def __init__(self, *, commands: Sequence[Sequence[str]],
               envs: Sequence[Mapping[str, str]], cwd: str | None = None,
               merge_stderr: bool = False, start: bool = True,
               warm: bool = True):
    """Starts every task unless ``start`` is false (then see `start`);
    ``warm``: Python scripts start forked from a warm zygote (tests/warm.py)
    where it can start them."""
    if len(commands) != len(envs):
      raise ValueError(f"{len(commands)} commands but {len(envs)} envs")
    self._commands = [list(c) for c in commands]
    self._envs = [dict(e) for e in envs]
    self._cwd, self._merge_stderr, self._warm = cwd, merge_stderr, warm
    self._runs: list[_Run] = []  # Every process started here, in order.
    self._latest: dict[int, _Run] = {}
    self._changed = threading.Condition()
    self._logs = tempfile.mkdtemp(prefix="tfdist-tasks-")
    # Their temporary files (a stall report's dumps, a worker's save
    # directory) go with the rest at `close`, unless the env names TMPDIR.
    self._tmp = os.path.join(self._logs, "tmp")
    os.mkdir(self._tmp)
    if start:
      try:
        self.start()
      except BaseException:
        self.close()
        raise

  @classmethod
  def of_script(cls, script: str, configs: Sequence[dict | None] = (None,),
                *, args: Sequence[str] = (),
                env: Mapping[str, str] | None = None,
                start: bool = True) -> Tasks:
    """One task of ``tests/scripts/<script>`` per TF_CONFIG in ``configs``.

    A ``None`` config runs the script without TF_CONFIG.
    """
    argv = [sys.executable, os.path.join(SCRIPTS, script), *args]
    envs = [base_env({**(env or {}), "TF_CONFIG": json.dumps(c)})
            if c is not None else base_env(env) for c in configs]
    return cls(commands=[argv] * len(envs), envs=envs, start=start)

  def __enter__(self) -> Tasks:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def start(self, *indices: int) -> None:
    """Starts the tasks ``indices``, every task when none is named."""
    for index in indices or range(len(self._commands)):
      err_path = None
      if not self._merge_stderr:
        n = sum(1 for run in self._runs if run.index == index)
        err_path = os.path.join(self._logs, f"task{index}-{n}.err")
      with (open(err_path, "w") if err_path is not None
            else contextlib.nullcontext()) as err:
        proc = warm.spawn(
            self._commands[index], cwd=self._cwd,
            env={"PYTHONFAULTHANDLER": "1", "TMPDIR": self._tmp,
                 **self._envs[index]},
            stderr=None if err is None else err.fileno(), warm=self._warm)
      run = _Run(index, proc, err_path)
      run.reader = threading.Thread(target=self._read, args=(run,),
                                    daemon=True)
      with self._changed:
        self._runs.append(run)
        self._latest[index] = run
      run.reader.start()

  def _read(self, run: _Run) -> None:
    try:
      for line in run.proc.stdout:
        with self._changed:
          run.stdout.append(line)
          self._changed.notify_all()
    except (OSError, ValueError):
      pass  # Closed under us.
    finally:
      with self._changed:
        run.eof = True
        self._changed.notify_all()

  def _run(self, index: int) -> _Run:
    try:
      return self._latest[index]
    except KeyError:
      raise AssertionError(f"task {index} was never started") from None

  # -------------------------------------------------------- output.

  def pid(self, index: int) -> int:
    """The PID (and process group, and session) of task ``index``."""
    return self._run(index).proc.pid

  def running(self, index: int) -> bool:
    return self._run(index).proc.poll() is None

  def lines(self, index: int) -> list[str]:
    """The stdout lines task ``index`` printed so far, without newlines."""
    run = self._run(index)
    with self._changed:
      return [line.rstrip("\n") for line in run.stdout]

  def stdout(self, index: int) -> str:
    run = self._run(index)
    with self._changed:
      return "".join(run.stdout)

  def stderr(self, index: int) -> str:
    """Task ``index``'s stderr (its stdout too, with ``merge_stderr``)."""
    return self._stderr(self._run(index))

  def stderr_of_all(self) -> list[str]:
    """The stderr of every process started here, the replaced ones too."""
    return [self._stderr(run) for run in self._runs]

  def _stderr(self, run: _Run) -> str:
    if run.err_path is None:
      with self._changed:
        return "".join(run.stdout)
    if run.stderr is not None:
      return run.stderr
    with open(run.err_path, errors="replace") as f:
      return f.read()

  def json(self, index: int) -> dict:
    """The last line task ``index`` printed that parses as a JSON object."""
    return _json_line(self.stdout(index), self.stderr(index))

  def result(self, index: int) -> Result:
    """The exit code and output of task ``index``, which has ended."""
    return Result(self._run(index).proc.returncode, self.stdout(index),
                  self.stderr(index))

  # -------------------------------------------------------- bounded waits.

  def wait_for(self, index: int, line: LineTest, timeout: float) -> str:
    """The first stdout line of task ``index`` that is ``line`` (or, for a
    callable, for which ``line`` holds), waiting at most ``timeout`` s."""
    matches = line if callable(line) else line.__eq__
    run = self._run(index)
    start = time.monotonic()
    seen = 0
    with self._changed:
      while True:
        for text in run.stdout[seen:]:
          if matches(text.rstrip("\n")):
            return text.rstrip("\n")
        seen = len(run.stdout)
        if run.eof or stalls.expired(start, timeout):
          break
        self._changed.wait(1.0)
    what = repr(line) if isinstance(line, str) else "the line waited for"
    stacks = self._stacks(run)
    raise AssertionError(
        f"task {index} never printed {what} within {timeout} s (exit code "
        f"{run.proc.poll()}); stdout tail: {self.lines(index)[-5:]}\n"
        f"stderr tail:\n{tail(self._stderr(run))}{stacks}")

  def wait(self, index: int, timeout: float) -> int:
    """The exit code of task ``index``, which must end within ``timeout``."""
    return self._wait(self._run(index), time.monotonic(), timeout)

  def wait_all(self, timeout: float) -> list[int]:
    """Exit codes, in task order; every task must end within ``timeout``."""
    start = time.monotonic()
    return [self._wait(self._latest[index], start, timeout)
            for index in sorted(self._latest)]

  def finish(self, timeout: float) -> list[Result]:
    """`wait_all`, then every task's `result`."""
    self.wait_all(timeout)
    return [self.result(index) for index in sorted(self._latest)]

  def _wait(self, run: _Run, start: float, timeout: float) -> int:
    """``run``'s exit code, once it ends within ``timeout`` s of running
    after monotonic ``start``."""
    while (code := run.proc.poll()) is None:
      if stalls.expired(start, timeout):
        stacks = self._stacks(run)
        raise AssertionError(
            f"task {run.index} ({shlex.join(run.proc.args)}) still running "
            f"after {timeout} s:\n{tail(self._stderr(run))}{stacks}")
      with contextlib.suppress(subprocess.TimeoutExpired):
        run.proc.wait(timeout=0.5)
    # Its last lines: the reader ends at the end of the pipe.
    run.reader.join(timeout=10)
    return code

  def stacks(self, index: int) -> str:
    """The Python stack of every thread of task ``index``, which ends it.

    For failure messages of a task that should have ended or printed: every
    task runs with Python's faulthandler on (``PYTHONFAULTHANDLER``), so
    SIGABRT makes it print its threads' stacks on stderr and abort.
    """
    return self._stacks(self._run(index))

  def _stacks(self, run: _Run) -> str:
    if run.proc.poll() is not None or run.err_path is None:
      return ""
    run.proc.send_signal(signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
      run.proc.wait(timeout=10)
    err = self._stderr(run)
    at = err.rfind("Fatal Python error: Aborted")
    return ("\nits threads when it was aborted for this message:\n"
            + err[at:at + 6000] if at >= 0 else "")

  # -------------------------------------------------------- signals.

  def signal(self, index: int, signum: int, *, group: bool = False) -> None:
    """Sends ``signum`` to task ``index``'s process, or with ``group`` to its
    process group, as tfdist launch, srun and scancel do."""
    proc = self._run(index).proc
    if not group:
      proc.send_signal(signum)
    elif proc.poll() is None:  # Not reaped: its PID is still its group's.
      with contextlib.suppress(ProcessLookupError):  # Reaped by a zygote.
        os.killpg(proc.pid, signum)

  def kill(self, index: int) -> None:
    """SIGKILL to task ``index``'s process group."""
    self.signal(index, signal.SIGKILL, group=True)

  def close(self) -> None:
    """SIGKILLs the process group of every process started here that still
    runs (only those); their output stays readable."""
    for run in self._runs:
      if run.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # Reaped by a zygote.
          os.killpg(run.proc.pid, signal.SIGKILL)
      run.proc.wait(timeout=30)
    for run in self._runs:
      run.reader.join(timeout=10)  # At the end of its pipe now.
      if not run.reader.is_alive():
        run.proc.stdout.close()
      if run.err_path is not None and run.stderr is None:
        run.stderr = self._stderr(run)
    shutil.rmtree(self._logs, ignore_errors=True)


# ------------------------------------------------------------ to the end.


def worker_configs(num_workers: int, *, num_ps: int = 0,
                   chief: bool = False) -> list[dict]:
  """One TF_CONFIG dict per task, on free ports: chief, workers, then ps."""
  return _net.cluster_tf_configs(
      {"chief": int(chief), "worker": num_workers, "ps": num_ps})


def run_processes(commands: Sequence[Sequence[str]],
                  envs: Sequence[Mapping[str, str]], *,
                  timeout: float) -> list[Result]:
  """Runs the commands concurrently; kills all of them past ``timeout``."""
  with Tasks(commands=commands, envs=envs) as tasks:
    return tasks.finish(timeout)


def run_alone(argv: Sequence[str], *, env: Mapping[str, str], cwd: str,
              timeout: float) -> tuple[Result, list[int]]:
  """Runs ``argv`` in a session of its own; returns its result and the PIDs
  of any process it left behind (those are killed before returning)."""
  with Tasks(commands=[argv], envs=[env], cwd=cwd) as tasks:
    tasks.wait(0, timeout)
    left = session_processes(tasks.pid(0))
    for pid in left:
      os.kill(pid, signal.SIGKILL)
    return tasks.result(0), left


def run_cluster(script: str, configs: Sequence[dict | None], *,
                args: Sequence[str] = (), timeout: float = 120,
                env: Mapping[str, str] | None = None) -> list[Result]:
  """Runs ``tests/scripts/<script>`` once per TF_CONFIG (None: without)."""
  with Tasks.of_script(script, configs, args=args, env=env) as tasks:
    return tasks.finish(timeout)


def run_script(script: str, *, args: Sequence[str] = (), timeout: float = 120,
               env: Mapping[str, str] | None = None) -> Result:
  """Runs one ``tests/scripts/<script>`` without TF_CONFIG."""
  return run_cluster(script, [None], args=args, timeout=timeout, env=env)[0]


def run_to_end(script: str, configs: Sequence[dict | None] = (None,), *,
               args: Sequence[str] = (), timeout: float = 240,
               env: Mapping[str, str] | None = None) -> list[dict]:
  """`run_cluster`, where every task must exit 0; each task's JSON line."""
  results = run_cluster(script, configs, args=args, timeout=timeout, env=env)
  for i, result in enumerate(results):
    if result.returncode != 0:
      raise AssertionError(f"task {i} exited {result.returncode}:\n"
                           f"{tail(result.stderr)}")
  return [result.json() for result in results]
