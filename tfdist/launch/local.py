"""The launcher's one supervision loop (``tfdist launch``), any number of
nodes.

TensorFlow has no ``torchrun``. `launch` starts one process per task of this
node, each with its own TF_CONFIG, and never leaves a process behind. The
cluster comes from a rendezvous (`tfdist.launch.rendezvous`): on one node
`Solo`, in this process; on several, node 0's `Master`, reached as a
`Member`. Either way the same loop runs each round:

1. join, and get this node's TF_CONFIGs;
2. start the tasks, prefixing each line of output with the task's role
   (`tfdist.launch.output`);
3. watch them and the rendezvous: a task that fails is reported (its exit
   code and the tail of its output; a preempted one, exit 42, as the step it
   saved at) and stops the round; ``finish`` (every
   training task done) gives the evaluator ``grace_seconds``, then stops the
   servers; ``stop`` ends the round, and the job unless it names the next
   round, which every node joins at once after a change of members, and
   after ``restart_delay_seconds`` after a failure (doubling with each,
   at most `MAX_RESTART_DELAY_SECONDS`). Each task sees the job as torchrun's
   see theirs (`job_variables`).

Every task leads a process group (and session) of its own and dies with the
launcher: SIGINT, SIGTERM and SIGUSR1 are forwarded to every task, SIGHUP as
SIGTERM, a second signal kills the tasks at once, and a parent-death signal
(Linux ``PR_SET_PDEATHSIG``) SIGKILLs every task when the launcher dies, even
of SIGKILL (call `launch` from the main thread: the kernel sends that signal
when the thread that started the task ends). A launcher that got signal N
leaves the job and exits ``128 + N``, once its tasks ended saying in one line
where its training tasks saved and which did not
(`tfdist.launch.output.signalled_line`); a waiting one leaves at once.

Every run gives its tasks one secret in ``TFDIST_JOB_SECRET``
(`tfdist._net.JOB_SECRET_VARIABLE`), fresh unless given: the socket
all-reduce ring admits only tasks that know it. TensorFlow's gRPC server
listens on every interface (``0.0.0.0``/``[::]``), whatever address TF_CONFIG
names: ``host`` only sets the addresses the tasks dial, and isolates nothing.

Tasks of one node share its cores: unless the user set it, each gets
``TF_NUM_INTRAOP_THREADS`` = the cores this launcher may use over the tasks
of this node (at least 1), as torchrun sets ``OMP_NUM_THREADS``. Each
TensorFlow process otherwise sizes its intra-op pool to every core, and N
pools on the same cores slow each other (docs/benchmarks.md, "Tasks that
share cores").

Every wait is bounded: a task that ignores SIGTERM is killed after
``grace_seconds``.

Example:
  >>> spec = LaunchSpec(num_workers=2, command=("python", "train.py"))
  >>> launch(spec)  # doctest: +SKIP
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
from typing import Callable, TextIO

from tfdist import _net
from tfdist.errors import ConfigError
from tfdist.launch import output
from tfdist.launch import rendezvous
from tfdist.launch import rounds
from tfdist.launch import stall
from tfdist.launch import stopper
from tfdist.launch.spec import LaunchSpec
from tfdist.launch.spec import Prepared
from tfdist.launch.spec import make_dirs
from tfdist.launch.spec import preflight

__all__ = ["Launcher", "launch", "job_variables"]

_SOURCE = "LaunchSpec"
#: The launcher's signal -> what its tasks get: SIGUSR1 (SLURM's
#: ``--signal=USR1@N``) as it is, tfdist's tasks save on it as on SIGTERM;
#: SIGHUP (the terminal went away) asks them to save and stop, as SIGTERM.
_FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
              signal.SIGUSR1: signal.SIGUSR1, signal.SIGHUP: signal.SIGTERM}
#: A task that could not be started -> the field to blame.
_START_ERRORS = {errno.EMFILE: "num_workers", errno.ENFILE: "num_workers",
                 errno.EAGAIN: "num_workers", errno.ENOMEM: "num_workers"}
#: Node 0 could not listen for the rendezvous -> the field to blame (else
#: master_addr: not an address of node 0).
_LISTEN_ERRORS = {errno.EADDRINUSE: "master_port", errno.EACCES: "master_port"}
_PR_SET_PDEATHSIG = 1  # From <linux/prctl.h>.
#: TensorFlow's intra-op pool size, read from the environment at start-up.
_INTRA_OP = "TF_NUM_INTRAOP_THREADS"


@dataclasses.dataclass(frozen=True)
class _Outcome:
  """How one node's round ended: its exit code, or the round to join and
  how long to wait first."""
  code: int
  restart: int | None = None
  delay: float = 0.0


@dataclasses.dataclass
class _Task:
  role: str
  config: dict
  proc: subprocess.Popen
  tail: collections.deque
  reader: threading.Thread
  log: TextIO | None

  @property
  def kind(self) -> str:
    return self.config["task"]["type"]


class Launcher:
  """Runs a `LaunchSpec`; `run` returns the exit code.

  Raises:
    ConfigError: from `run`, when `preflight` fails, node 0 cannot listen
      for the rendezvous, or the log directory or a task cannot be created;
      no task is left running.
  """

  def __init__(self, spec: LaunchSpec, *, out: TextIO | None = None,
               resume: str = output.RESUME):
    self._spec = spec
    self._console = output.Console(out or sys.stdout, resume=resume,
                                   quiet="TF_CPP_MIN_LOG_LEVEL" not in {
                                       **os.environ, **spec.env})
    self._tasks: list[_Task] = []
    self._signal: int | None = None
    self._stopping = threading.Event()  # Set with _signal: waits end.
    self._flight: stall.Flight | None = None

  def run(self) -> int:
    spec = self._spec
    prepared = preflight(spec)
    handlers = {s: signal.signal(s, self._on_signal) for s in _FORWARDED}
    handlers[stall.SIGNAL] = signal.signal(stall.SIGNAL, self._on_report)
    master = member = None
    try:
      if spec.nnodes == 1:
        if not _net.is_loopback(spec.address):
          print(f"tfdist: warning: TensorFlow's gRPC servers listen on every "
                f"interface (0.0.0.0), not only on {spec.address}: host "
                "only sets the addresses in TF_CONFIG", file=sys.stderr,
                flush=True)
        member = rounds.Solo(max_restarts=spec.max_restarts)
        host = spec.address
      else:
        if spec.node_rank == 0:
          master = self._master(prepared)
        member = rendezvous.Member(
            master=(spec.master_addr, spec.master_port), rank=spec.node_rank,
            secret=prepared.secret.encode(), node=prepared.node,
            agree=_agreed(spec, prepared),
            timeout=spec.rendezvous_timeout_seconds, stop=self._stopping,
            say=self._console.say)
        host = spec.host or member.local_address
      make_dirs(spec.log_dir)
      self._flight = stall.Flight(
          log_dir=spec.log_dir, stall_seconds=spec.stall_seconds,
          say=self._console.say, source=_SOURCE, rank=spec.node_rank,
          send=member.send if spec.nnodes > 1 else None)
      outcome = _Outcome(0, restart=0)
      while True:
        placed = member.join(attempt=outcome.restart, host=host,
                             jobs=spec.jobs, evaluator=spec.evaluator,
                             ports=spec.ports(host))
        if "why" in placed:  # A restart.
          self._console.say(self._restart_line(placed, outcome.delay))
        if self._signal is not None:
          return 128 + self._signal
        outcome = self._run_round(placed, member, prepared)
        if outcome.restart is None:
          return outcome.code
        if not self._sleep(outcome.delay):
          return 128 + self._signal
    except rendezvous.RendezvousError as e:
      self._console.say(f"node {spec.node_rank}: {e}")
      return e.code if self._signal is None else 128 + self._signal
    finally:
      self._stop_all()
      if self._flight is not None:
        self._flight.close()
      if member is not None:
        member.close()
      if master is not None:
        master.close()
      for s, h in handlers.items():
        signal.signal(s, h)

  def _master(self, prepared: Prepared) -> rendezvous.Master:
    spec = self._spec
    try:
      return rendezvous.Master(
          address=(spec.master_addr, spec.master_port), nnodes=spec.nnodes,
          min_nodes=spec.min_nodes, last_call=spec.last_call_seconds,
          secret=prepared.secret.encode(), node=prepared.node,
          agree=_agreed(spec, prepared),
          timeout=spec.rendezvous_timeout_seconds,
          max_restarts=spec.max_restarts, log=self._console.stream,
          on_report=self._merge_report)
    except OSError as e:
      field = _LISTEN_ERRORS.get(e.errno, "master_addr")
      raise ConfigError(
          field=field, value=getattr(spec, field), source=_SOURCE,
          expected=f"an address of node 0 and a free port (node 0 cannot "
                   f"listen on {spec.master_addr} port {spec.master_port})",
          hint=f"{e.strerror or e}; --master-addr must be an address of "
               "node 0 and the port free") from None

  def _run_round(self, placed: dict, member,
                 prepared: Prepared) -> _Outcome:
    """Runs this node's part of the round ``placed`` (the rendezvous's
    ``cluster`` message) until the rendezvous ends it."""
    attempt = placed["attempt"]
    configs = [{"cluster": placed["cluster"],
                "task": {"type": kind, "index": index}}
               for kind, index in placed["places"]]
    self._start_all(placed, configs, prepared)
    servers = "ps" in configs[0]["cluster"]  # Workers only serve under PS.
    trainers = [t for t in self._tasks
                if t.kind == "chief" or (t.kind == "worker" and not servers)]
    done = failed = False
    while True:
      if self._signal is not None:  # The tasks got it: this node leaves.
        self._stop_all()
        if trainers:
          self._console.signalled(
              signal.Signals(self._signal).name,
              [(t.role, t.proc.returncode, t.tail) for t in trainers])
        return _Outcome(128 + self._signal)
      message = member.poll(timeout=0.1)
      if self._signal is not None:
        continue  # It came meanwhile: said at the loop's top.
      self._flight.watch(self._pids(), self._tails(), message)
      if message is not None:
        kind = message["kind"]
        if kind == "finish":
          bad = self._finish_evaluator()
          self._stop_all()
          if bad:
            self._console.failure(bad.role, bad.proc.returncode, bad.tail)
            return _Outcome(_exit_code(bad.proc.returncode))
          return _Outcome(0)
        if kind in ("stop", "lost", "error"):
          self._stop_all()
          if message.get("restart") is None and self._spec.nnodes > 1:
            self._console.say(
                f"node {self._spec.node_rank} stops: {message['why']}")
          return _Outcome(
              _exit_code(message.get("code", 1)), message.get("restart"),
              self._spec.restart_delay(message["failures"])
              if message.get("failure") else 0.0)
      if failed:
        continue
      for t in self._tasks:
        code = t.proc.poll()
        if code not in (None, 0):
          t.reader.join(timeout=5)
          failed = True
          dump = self._flight.lost_peer(t.role)
          self._console.failure(
              t.role, code, t.tail,
              restarting=placed["failures"] < placed["max_restarts"])
          if dump is not None:  # Asked before any node stops its tasks.
            self._flight.failed(t.role, code, dump, self._pids(),
                                self._tails())
          member.send({"kind": "failed", "role": t.role, "code": code,
                       "attempt": attempt, "peer_lost": dump is not None})
          self._stop_all()
          break
      if not failed and not done and trainers and all(
          t.proc.poll() == 0 for t in trainers):
        done = True
        member.send({"kind": "done"})

  def _restart_line(self, placed: dict, delay: float) -> str:
    """The one line of a restart: after a failure its number and wait, else
    that members changed; why; on several nodes the sizes before and
    after, and the nodes left out at the last call."""
    if placed["failure"]:
      line = (f"restart {placed['failures']} of {placed['max_restarts']} "
              f"after {delay:g} s: {placed['why']}")
    else:
      line = (f"members changed (round {placed['attempt']}, no restart "
              f"spent): {placed['why']}")
    if self._spec.nnodes > 1:
      line += f"; {placed['previous']} nodes, now {len(placed['nodes'])}"
    if placed.get("late"):
      line += (f" (not back by the last call: node"
               f"{'s' if len(placed['late']) > 1 else ''} "
               f"{', '.join(map(str, placed['late']))})")
    return line

  def _finish_evaluator(self) -> _Task | None:
    """Gives the evaluator ``grace_seconds`` to end; one that failed by
    itself, or ``None``."""
    deadline = time.monotonic() + self._spec.grace_seconds
    for t in self._tasks:
      if t.kind == "evaluator":
        while t.proc.poll() is None and time.monotonic() < deadline:
          time.sleep(0.1)
        if t.proc.poll() not in (None, 0):
          t.reader.join(timeout=5)
          return t
    return None

  def _start_all(self, placed: dict, configs: list[dict],
                 prepared: Prepared) -> None:
    """Starts every task, then their readers (so no thread runs while the
    launcher forks), or none: a task that cannot start stops the others."""
    env = dict(os.environ)
    env.update(self._spec.env)
    env[_net.JOB_SECRET_VARIABLE] = prepared.secret
    # TensorFlow's C++ chatter, unless the user asked for a level: level 2,
    # and the start-up lines that ignore it dropped from the console.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(job_variables(placed, prepared.run_id), PYTHONUNBUFFERED="1",
               **self._flight.env(placed["attempt"]))
    if len(configs) > 1 and _INTRA_OP not in env:
      env[_INTRA_OP] = str(max(1, _cores() // len(configs)))
    paths = [os.path.join(self._spec.log_dir,
                          f"{c['task']['type']}-{c['task']['index']}.log")
             if self._spec.log_dir else None for c in configs]
    logs: list[TextIO | None] = []
    self._tasks = []
    try:
      for path in paths:
        logs.append(open(path, "a") if path else None)
      for config, log, gpu in zip(configs, logs, prepared.gpus):
        if self._signal is None:
          extra = {} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu}
          self._tasks.append(self._start(config, {**env, **extra}, log))
    except OSError as e:
      for log in logs[len(self._tasks):]:
        if log:
          log.close()
      self._stop_all()
      field = ("log_dir" if len(logs) < len(configs)
               else _START_ERRORS.get(e.errno, "command"))
      raise ConfigError(
          field=field, value=getattr(self._spec, field), source=_SOURCE,
          expected="a cluster this machine can start and log",
          hint=f"task {len(self._tasks)} could not start: {e}") from None
    for t in self._tasks:
      t.reader.start()

  def _start(self, config: dict, env: dict[str, str],
             log: TextIO | None) -> _Task:
    task = config["task"]
    role = f"{task['type']}:{task['index']}"
    proc = subprocess.Popen(
        self._spec.command, env={**env, "TF_CONFIG": json.dumps(config)},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=_die_with(os.getpid()))
    reader, tail = self._console.reader(role, proc.stdout, log)
    return _Task(role, config, proc, tail, reader, log)

  def _on_signal(self, signum, frame) -> None:
    """Forwards the first signal; a second one kills the tasks at once."""
    del frame
    again = self._signal is not None
    self._signal = self._signal or signum
    self._stopping.set()
    for t in self._tasks:
      stopper.signal_group(t.proc, signal.SIGKILL if again
                          else _FORWARDED[signum])

  def _on_report(self, signum, frame) -> None:
    """SIGUSR2: the stall report, made by the round's loop."""
    del signum, frame
    if self._flight is not None:
      self._flight.request()

  def _merge_report(self, rank: int, message: dict) -> None:
    """Node 0: a node's answer to a stall report's ask."""
    if self._flight is not None:
      self._flight.merge(rank, message)

  def _pids(self) -> dict[str, int]:
    return {t.role: t.proc.pid for t in self._tasks}

  def _tails(self) -> dict[str, list[str]]:
    return {t.role: list(t.tail) for t in self._tasks}

  def _sleep(self, seconds: float) -> bool:
    """Sleeps ``seconds`` unless a signal comes; whether none came."""
    return not self._stopping.wait(seconds)

  def _stop_all(self) -> None:
    """Stops every task (`stopper.stop`; a forwarded signal already asked
    them), then lets their readers finish."""
    stopper.stop([t.proc for t in self._tasks],
                 grace_seconds=self._spec.grace_seconds,
                 asked=self._signal is not None)
    for t in self._tasks:
      if t.reader.is_alive():
        t.reader.join(timeout=5)
      elif t.reader.ident is None:  # Never started: nothing to read.
        t.proc.stdout.close()
        if t.log:
          t.log.close()


def launch(spec: LaunchSpec, *, out: TextIO | None = None,
           resume: str = output.RESUME) -> int:
  """Runs every task of ``spec``; returns the launcher's exit code.

  Call it from the main thread: it handles SIGINT, SIGTERM, SIGUSR1 and
  SIGHUP, and the tasks die when the thread that started them ends.

  Args:
    spec: what to launch.
    out: where the tasks' prefixed output goes; ``sys.stdout`` by default.
    resume: how to resume, said after a task was preempted and saved.

  Returns:
    0 when the training tasks succeeded and the evaluator, if any, did not
    fail; after the last restart, the failed task's exit code (42 for a
    preempted task that saved: run the same command to resume), ``128 + N``
    when it was killed by signal N; ``128 + N`` when the launcher itself got
    signal N.

  Raises:
    ConfigError: `preflight` failed, or the log directory or a task could
      not be created; no task is left running.
  """
  return Launcher(spec, out=out, resume=resume).run()


def job_variables(placed: dict, run_id: str) -> dict[str, str]:
  """What each task of round ``placed`` (the rendezvous's ``cluster``
  message) learns of the job, as torchrun's tasks do from its
  ``TORCHELASTIC_*`` variables."""
  return {
      "TFDIST_RESTART": str(placed["attempt"]),  # The round: 0, 1, ...
      "TFDIST_RESTART_COUNT": str(placed["failures"]),  # Restarts spent.
      "TFDIST_MAX_RESTARTS": str(placed["max_restarts"]),
      "TFDIST_RUN_ID": run_id,
      "TFDIST_NNODES": str(len(placed["nodes"])),  # This round's nodes.
  }


def _agreed(spec: LaunchSpec, prepared: Prepared) -> dict[str, str]:
  """The settings every node of a job must share with node 0."""
  nodes = (str(spec.nnodes) if spec.min_nodes == spec.nnodes
           else f"{spec.min_nodes}:{spec.nnodes}")
  return {"--nnodes": nodes, "--run-id": prepared.run_id}


def _cores() -> int:
  """The cores this process may run on (all of them where the OS cannot
  say)."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def _exit_code(code: int) -> int:
  """A task's return code as a shell gives it: ``128 + N`` for signal N."""
  return code if code >= 0 else 128 - code


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
