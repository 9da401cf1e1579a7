"""Every task of a cluster as a local process (``tfdist launch``).

TensorFlow has no ``torchrun``. `launch` starts one process per task on this
machine, each with its own TF_CONFIG on free ports, prefixes each line of
output with the task's role, and never leaves a process behind:

* each task leads a process group (and session) of its own, and dies with
  the launcher: SIGINT and SIGTERM are forwarded to every task, SIGHUP is
  forwarded as SIGTERM, a second signal kills the tasks at once, and a
  parent-death signal (Linux ``PR_SET_PDEATHSIG``) SIGKILLs every task when
  the launcher dies, even of SIGKILL. Call `launch` from the main thread:
  the kernel sends that signal when the thread that started the task ends;
* a task that fails stops the others, and the launcher reports which task,
  its exit code and the tail of its output, then exits with that code
  (``128 + N`` for a task killed by signal N, as a shell says it); an
  evaluator that fails after training fails the launch too;
* once the training tasks (chief, workers under MultiWorkerMirrored) finish,
  the evaluator gets ``grace_seconds`` to end, and the servers (ps, and
  workers under ParameterServer) are stopped;
* ``max_restarts`` relaunches the whole cluster after a failure, waiting
  ``restart_delay_seconds`` first, twice as long before each further restart
  (at most `MAX_RESTART_DELAY_SECONDS`); each task sees ``TFDIST_RESTART``
  (0 on the first run);
* every run gives its tasks one fresh random secret in ``TFDIST_JOB_SECRET``
  (`tfdist._net.JOB_SECRET_VARIABLE`), unless the environment sets one: the
  socket all-reduce ring admits only tasks that know it.

TensorFlow's gRPC server listens on every interface (``0.0.0.0``/``[::]``),
whatever address TF_CONFIG names: ``host`` only sets the addresses the tasks
dial, and isolates nothing.

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
import ctypes
import dataclasses
import errno
import ipaddress
import json
import math
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Sequence, TextIO

from tfdist import _net
from tfdist.errors import ConfigError
from tfdist.launch import rendezvous

__all__ = ["LaunchSpec", "Launcher", "launch", "preflight", "TaskFailure",
           "MAX_RESTART_DELAY_SECONDS"]

_SOURCE = "LaunchSpec"
_TAIL_LINES = 20

#: The longest wait before a restart; the delay doubles up to it.
MAX_RESTART_DELAY_SECONDS = 60.0
#: The longest ``grace_seconds`` or ``restart_delay_seconds`` accepted.
_MAX_SECONDS = 3600.0
#: One port per task, from the first unprivileged one.
_MAX_TASKS = 65536 - 1024
#: File descriptors the launcher keeps for itself beside its tasks' pipes.
_SPARE_FILES = 64
#: A DNS name: dot-separated labels of letters, digits and inner hyphens.
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
                       r"(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
#: The launcher's signal -> what its tasks get: SIGHUP (the terminal went
#: away) asks them to save and stop, as SIGTERM does.
_FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
              signal.SIGHUP: signal.SIGTERM}
#: A task that could not be started -> the field to blame.
_START_ERRORS = {errno.EMFILE: "num_workers", errno.ENFILE: "num_workers",
                 errno.EAGAIN: "num_workers", errno.ENOMEM: "num_workers"}
#: Node 0 could not listen for the rendezvous -> the field to blame (else
#: master_addr: not an address of node 0).
_LISTEN_ERRORS = {errno.EADDRINUSE: "master_port", errno.EACCES: "master_port"}
_PR_SET_PDEATHSIG = 1  # From <linux/prctl.h>.
#: TensorFlow's start-up lines that TF_CPP_MIN_LOG_LEVEL does not silence
#: (written before its logging starts): no GPU driver on a CPU machine, and
#: oneDNN's notice (TF_ENABLE_ONEDNN_OPTS=0 would silence it by changing the
#: numerics, so the line is dropped instead).
_NOISE = re.compile(
    r"All log messages before absl::InitializeLog\(\) is called are written "
    r"to STDERR|cudart_stub\.cc:\d+\] Could not find cuda drivers"
    r"|cuda_platform\.cc:\d+\] failed call to cuInit"
    r"|port\.cc:\d+\] oneDNN custom operations are on")
#: A terminal control sequence (colour, erase): kept for terminals only.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


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
    host: the address written in every task's TF_CONFIG, ``127.0.0.1`` by
      default: a loopback address, or an address or name of this machine
      (checked by `preflight`). TensorFlow's gRPC server listens on every
      interface whatever it says.
    port_base: first port; consecutive ports from there must be free (checked
      by `preflight`). Free ports are picked when ``None``.
    log_dir: also write each task's output to ``<log_dir>/<type>-<index>.log``
      (appended to; the directory is created, before any task starts).
    max_restarts: relaunch the cluster up to this many times after a failure.
    restart_delay_seconds: wait before the first restart; each further one
      waits twice as long, at most `MAX_RESTART_DELAY_SECONDS`.
    grace_seconds: how long a task may take to exit after SIGTERM.
    env: extra environment for every task.
    nnodes: the nodes of a multi-node launch; each runs its own launcher with
      the same ``nnodes``, ``master_addr`` and ``master_port``, and the task
      counts above mean the tasks *on this node*.
    node_rank: this node's rank, 0 to ``nnodes - 1``; node 0 runs the
      rendezvous (`tfdist.launch.rendezvous`).
    master_addr: node 0's address as every node reaches it (the rendezvous
      listens there only); needed when ``nnodes > 1``.
    master_port: the rendezvous port on node 0; needed when ``nnodes > 1``.
    rendezvous_timeout_seconds: how long every node may take to join.
    secret_file: a file holding the job's shared secret (readable by its
      owner only), when ``TFDIST_JOB_SECRET`` is not set; a multi-node launch
      needs one of them, the same on every node.
    gpus_per_task: GPUs for each chief, worker and evaluator task of this
      node (in ``CUDA_VISIBLE_DEVICES``); by default the node's GPUs are
      split evenly. ps tasks get none.

  Raises:
    ConfigError: a value that cannot work, naming the field.
  """
  command: tuple[str, ...]
  num_workers: int = 1
  num_ps: int = 0
  chief: bool = False
  evaluator: bool = False
  host: str | None = None
  port_base: int | None = None
  log_dir: str | None = None
  max_restarts: int = 0
  restart_delay_seconds: float = 1.0
  grace_seconds: float = 10.0
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)
  nnodes: int = 1
  node_rank: int = 0
  master_addr: str | None = None
  master_port: int | None = None
  rendezvous_timeout_seconds: float = 300.0
  secret_file: str | None = None
  gpus_per_task: int | None = None

  def __post_init__(self):
    _words("command", self.command,
           "a program and its arguments, e.g. ('python', 'train.py')")
    object.__setattr__(self, "command", tuple(self.command))
    _int_at_least("num_workers", self.num_workers,
                  1 if self.nnodes == 1 else 0, high=_MAX_TASKS,
                  hint="Every cluster needs a worker: set num_workers to 1 "
                        "or more")
    _int_at_least("num_ps", self.num_ps, 0, high=_MAX_TASKS)
    _int_at_least("max_restarts", self.max_restarts, 0)
    _seconds("grace_seconds", self.grace_seconds, zero=False)
    _seconds("restart_delay_seconds", self.restart_delay_seconds, zero=True)
    if self.nnodes > 1 and self.num_tasks == 0:
      raise ConfigError(field="num_workers", value=self.num_workers,
                        source=_SOURCE, expected="at least one task per node")
    if self.num_tasks > _MAX_TASKS:
      raise ConfigError(field="num_workers", value=self.num_workers,
                        source=_SOURCE,
                        expected=f"at most {_MAX_TASKS} tasks in all (one "
                                 f"unprivileged port each), not "
                                 f"{self.num_tasks}")
    if self.host is not None:
      _host("host", self.host)
    _int_at_least("nnodes", self.nnodes, 1, high=_MAX_TASKS)
    _int_at_least("node_rank", self.node_rank, 0, high=self.nnodes - 1)
    _seconds("rendezvous_timeout_seconds", self.rendezvous_timeout_seconds,
             zero=False)
    if self.nnodes > 1:
      if self.master_addr is None or self.master_port is None:
        raise ConfigError(
            field="master_addr" if self.master_addr is None else "master_port",
            value=None, source=_SOURCE,
            expected=f"node 0's address and port for nnodes={self.nnodes}",
            hint="Give every node the same --master-addr and --master-port")
      _host("master_addr", self.master_addr)
      _int_at_least("master_port", self.master_port, 1, high=65535)
    if self.secret_file is not None:
      _words("secret_file", (self.secret_file,), "a file path")
    if self.gpus_per_task is not None:
      _int_at_least("gpus_per_task", self.gpus_per_task, 0, high=1024)
    if self.log_dir is not None:
      _words("log_dir", (self.log_dir,), "a directory path")
    env = self.env if isinstance(self.env, Mapping) else None
    if env is None or not all(
        isinstance(k, str) and k and "=" not in k and "\0" not in k
        and isinstance(v, str) and "\0" not in v for k, v in env.items()):
      raise ConfigError(field="env", value=self.env, source=_SOURCE,
                        expected="a mapping of variable names (no '=') to "
                                 "strings, without NUL bytes")
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
    chief = int(self.chief or (self.num_ps > 0 and self.nnodes == 1))
    return {k: v for k, v in (("chief", chief), ("worker", self.num_workers),
                              ("ps", self.num_ps)) if v}

  @property
  def num_tasks(self) -> int:
    return sum(self.jobs.values()) + int(self.evaluator)

  @property
  def address(self) -> str:
    """The address in this node's tasks' TF_CONFIG, when known without I/O:
    ``host``, else ``127.0.0.1`` on one node (on several, the address this
    node reaches the master from)."""
    return self.host or "127.0.0.1"

  def restart_delay(self, restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...)."""
    if not self.restart_delay_seconds:
      return 0.0
    doublings = min(restart - 1, 64)  # Past the cap long before 2**64.
    return min(self.restart_delay_seconds * 2.0 ** doublings,
               MAX_RESTART_DELAY_SECONDS)

  def tf_configs(self) -> list[dict]:
    """One TF_CONFIG per task: the cluster tasks, then the evaluator."""
    configs = _net.cluster_tf_configs(self.jobs, host=self.address,
                                      port_base=self.port_base)
    if self.evaluator:
      configs.append({"cluster": configs[0]["cluster"],
                      "task": {"type": "evaluator", "index": 0}})
    return configs

  def log_paths(self) -> list[str]:
    """``<log_dir>/<type>-<index>.log`` of each task, in `tf_configs` order;
    empty without a ``log_dir``."""
    if not self.log_dir:
      return []
    names = [f"{job}-{i}.log" for job, n in self.jobs.items()
             for i in range(n)] + ["evaluator-0.log"] * self.evaluator
    return [os.path.join(self.log_dir, name) for name in names]


def preflight(spec: LaunchSpec) -> None:
  """Checks what ``spec`` needs from this machine, before anything starts.

  The program must be on PATH (and a Python script must exist), ``host``
  must be an address of this machine, the open-file limit must allow a pipe
  (and a log file) per task, the log files must not be directories, and
  with a ``port_base`` the ports of every task must be free on ``host``.
  Nothing is written.

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
  problem = spec.host and _net.port_problem(spec.host, 0)
  if problem:
    raise ConfigError(
        field="host", value=spec.host, source=_SOURCE, hint=problem,
        expected="an address or name of this machine, e.g. 127.0.0.1")
  per_task = 2 if spec.log_dir else 1
  files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
  if (files != resource.RLIM_INFINITY
      and spec.num_tasks * per_task + _SPARE_FILES > files):
    raise ConfigError(
        field="num_workers", value=spec.num_workers, source=_SOURCE,
        expected=(f"at most {max(0, files - _SPARE_FILES) // per_task} tasks "
                  f"in all under this process's open-file limit of {files}, "
                  f"not {spec.num_tasks}"),
        hint="Launch fewer tasks, or raise the limit with `ulimit -n`")
  for path in [spec.log_dir] * bool(spec.log_dir) + spec.log_paths():
    wanted = os.path.isdir if path == spec.log_dir else os.path.isfile
    if os.path.lexists(path) and not wanted(path):
      raise ConfigError(
          field="log_dir", value=spec.log_dir, source=_SOURCE,
          expected=f"a directory where {path} can be a log file")
  if spec.port_base is not None:
    ports = range(spec.port_base, spec.port_base + spec.num_tasks)
    taken = [p for p in ports if _net.port_problem(spec.address, p)]
    if taken:
      raise ConfigError(
          field="port_base", value=spec.port_base, source=_SOURCE,
          expected=(f"{spec.num_tasks} free ports from {spec.port_base}; "
                    f"port {taken[0]} on {spec.address} is taken"),
          hint="Pick another port_base or leave it out to use free ports")

  if spec.nnodes > 1:
    job_secret(spec)
    _, why = _net.lookup(spec.master_addr)
    if why:
      raise ConfigError(
          field="master_addr", value=spec.master_addr, source=_SOURCE,
          hint=why, expected="node 0's address, or a name that resolves to it")
  gpu_plan(spec, [kind for kind, n in spec.jobs.items() for _ in range(n)]
           + ["evaluator"] * spec.evaluator, {**os.environ, **spec.env})


def job_secret(spec: LaunchSpec) -> str | None:
  """The job's shared secret: ``TFDIST_JOB_SECRET`` from ``spec.env`` or the
  environment, else the contents of ``spec.secret_file``; ``None`` when
  neither is given (one node then makes a fresh one).

  Raises:
    ConfigError: a multi-node launch without a secret, or a secret file that
      cannot be read, is empty, or is readable by group or others.
  """
  value = (spec.env.get(_net.JOB_SECRET_VARIABLE)
           or os.environ.get(_net.JOB_SECRET_VARIABLE))
  if value:
    return value
  if spec.secret_file is not None:
    try:
      mode = os.stat(spec.secret_file).st_mode
      with open(spec.secret_file) as f:
        value = f.read().strip()
    except OSError as e:
      raise ConfigError(field="secret_file", value=spec.secret_file,
                        source=_SOURCE, expected="a readable file",
                        hint=e.strerror) from None
    if mode & 0o077:
      raise ConfigError(
          field="secret_file", value=spec.secret_file, source=_SOURCE,
          expected=f"a file only its owner can read, not mode {mode & 0o777:o}",
          hint=f"chmod 600 {spec.secret_file}")
    if not value:
      raise ConfigError(field="secret_file", value=spec.secret_file,
                        source=_SOURCE, expected="a file holding the secret")
    return value
  if spec.nnodes > 1:
    raise ConfigError(
        field="secret_file", value=None, source=_SOURCE,
        expected=f"the job's shared secret on every node for nnodes="
                 f"{spec.nnodes}",
        hint=f"Set {_net.JOB_SECRET_VARIABLE} to the same random value on "
             "every node (e.g. from `openssl rand -hex 32`), or give "
             "--secret-file with a file only you can read; never pass it "
             "as an argument")
  return None


def gpu_plan(spec: LaunchSpec, kinds: Sequence[str],
             environ: Mapping[str, str] | None = None
             ) -> list[str | None]:
  """``CUDA_VISIBLE_DEVICES`` for each local task of type ``kinds[i]``.

  The GPUs this launcher may use are its own ``CUDA_VISIBLE_DEVICES`` when
  set, else those the machine has (``/proc/driver/nvidia/gpus``). They are
  split over the chief, worker and evaluator tasks in order:
  ``spec.gpus_per_task`` each, or an even share (at least one, shared round
  robin when there are fewer GPUs than tasks). ps tasks get ``""``: no GPU.
  With no GPU known every value is ``None``: the variable is left alone.

  Raises:
    ConfigError: ``gpus_per_task`` asks for more GPUs than there are.
  """
  environ = os.environ if environ is None else environ
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None and visible.strip():
    gpus = [g.strip() for g in visible.split(",") if g.strip()]
  else:
    try:
      gpus = [str(i) for i in range(len(os.listdir(
          "/proc/driver/nvidia/gpus")))]
    except OSError:
      gpus = []
  users = [i for i, kind in enumerate(kinds) if kind != "ps"]
  if not gpus or not users:
    return [None] * len(kinds)
  each = spec.gpus_per_task
  if each is not None and each * len(users) > len(gpus):
    raise ConfigError(
        field="gpus_per_task", value=each, source=_SOURCE,
        expected=(f"at most {len(gpus) // len(users)} for {len(users)} tasks "
                  f"on this node's {len(gpus)} GPUs ({','.join(gpus)})"))
  if each is None:
    each = max(1, len(gpus) // len(users))
  plan: list[str | None] = [""] * len(kinds)
  for n, i in enumerate(users):
    plan[i] = ",".join(gpus[(n * each + k) % len(gpus)] for k in range(each))
  return plan


class TaskFailure(Exception):
  """A task exited non-zero (internal to the launcher).

  Attributes:
    restart: whether a restart can help (not after training finished).
  """

  def __init__(self, role: str, code: int, tail: Sequence[str], *,
               restart: bool = True):
    super().__init__(role, code)
    self.role, self.code, self.tail = role, code, list(tail)
    self.restart = restart


@dataclasses.dataclass(frozen=True)
class _Outcome:
  """How one node's attempt ended: its exit code, or the restart to join."""
  code: int
  restart: int | None = None


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
    ConfigError: from `run`, when `preflight` fails or the log directory or
      a task cannot be created; no task is left running.
  """

  def __init__(self, spec: LaunchSpec, *, out: TextIO | None = None):
    self._spec = spec
    self._out = out or sys.stdout
    self._lock = threading.Lock()
    self._tasks: list[_Task] = []
    self._signal: int | None = None
    self._stop = threading.Event()  # Set with _signal: ends rendezvous waits.
    self._tty = hasattr(self._out, "isatty") and self._out.isatty()
    self._quiet = False  # Set by _start_all: drop TensorFlow's start-up noise.
    self._partial: dict[str, str] = {}  # Role -> its redrawn line's state.
    self._drawing: str | None = None  # The role whose bar the cursor is on.

  def run(self) -> int:
    preflight(self._spec)
    if self._spec.nnodes > 1:
      return self._run_nodes()
    if not _net.is_loopback(self._spec.address):
      print(f"tfdist: warning: TensorFlow's gRPC servers listen on every "
            f"interface (0.0.0.0), not only on {self._spec.address}: host "
            "only sets the addresses in TF_CONFIG", file=sys.stderr,
            flush=True)
    handlers = {s: signal.signal(s, self._on_signal) for s in _FORWARDED}
    try:
      _make_dirs(self._spec.log_dir)
      for attempt in range(self._spec.max_restarts + 1):
        if attempt:
          delay = self._spec.restart_delay(attempt)
          self._say(f"restarting the cluster ({attempt} of "
                    f"{self._spec.max_restarts}) in {delay:g} s")
          if not self._sleep(delay):
            return 128 + self._signal
        try:
          return self._run_once(attempt)
        except TaskFailure as failure:
          self._report(failure)
          if self._signal is not None:
            return 128 + self._signal
          if not failure.restart or attempt == self._spec.max_restarts:
            return _exit_code(failure.code)
      return 1  # Unreachable: the loop always returns.
    finally:
      self._stop_all()
      for s, h in handlers.items():
        signal.signal(s, h)

  def _run_nodes(self) -> int:
    """One node of a multi-node launch: join the rendezvous (node 0 runs
    it), run this node's tasks, stop or restart with every other node."""
    spec = self._spec
    secret = job_secret(spec)
    master = None
    handlers = {s: signal.signal(s, self._on_signal) for s in _FORWARDED}
    member = None
    try:
      if spec.node_rank == 0:
        try:
          master = rendezvous.Master(
              address=(spec.master_addr, spec.master_port), nnodes=spec.nnodes,
              secret=secret.encode(), timeout=spec.rendezvous_timeout_seconds,
              max_restarts=spec.max_restarts, log=self._out)
        except OSError as e:
          field = _LISTEN_ERRORS.get(e.errno, "master_addr")
          raise ConfigError(
              field=field, value=getattr(spec, field), source=_SOURCE,
              expected=f"an address of node 0 and a free port (node 0 "
                       f"cannot listen on {spec.master_addr} port "
                       f"{spec.master_port})",
              hint=f"{e.strerror or e}; --master-addr must be an address of "
                   "node 0 and the port free") from None
      member = rendezvous.Member(
          master=(spec.master_addr, spec.master_port), rank=spec.node_rank,
          secret=secret.encode(), timeout=spec.rendezvous_timeout_seconds,
          stop=self._stop)
      host = spec.host or member.local_address
      _make_dirs(spec.log_dir)
      attempt = 0
      while True:
        ports = (list(range(spec.port_base, spec.port_base + spec.num_tasks))
                 if spec.port_base is not None
                 else _net.free_ports(spec.num_tasks, host))
        placed = member.join(attempt=attempt, host=host, jobs=spec.jobs,
                             evaluator=spec.evaluator, ports=ports)
        configs = [{"cluster": placed["cluster"],
                    "task": {"type": kind, "index": index}}
                   for kind, index in placed["places"]]
        if self._signal is not None:
          return 128 + self._signal
        outcome = self._run_node(attempt, configs, member)
        if outcome.restart is None:
          return outcome.code
        attempt = outcome.restart
        delay = spec.restart_delay(attempt)
        self._say(f"restarting with every node ({attempt} of "
                  f"{spec.max_restarts}) in {delay:g} s")
        if not self._sleep(delay):
          return 128 + self._signal
    except rendezvous.RendezvousError as e:
      self._say(f"node {spec.node_rank}: {e}")
      return e.code if self._signal is None else 128 + self._signal
    finally:
      self._stop_all()
      if member is not None:
        member.close()
      if master is not None:
        master.close()
      for s, h in handlers.items():
        signal.signal(s, h)

  def _run_node(self, attempt: int, configs: list[dict],
                member: "rendezvous.Member") -> "_Outcome":
    """Runs this node's part of one attempt until the rendezvous ends it."""
    self._start_all(attempt, configs)
    servers = "ps" in configs[0]["cluster"]
    trainers = [t for t in self._tasks
                if t.kind == "chief" or (t.kind == "worker" and not servers)]
    done = failed = False
    while True:  # A signal reaches the tasks, which end and are reported.
      message = member.poll(timeout=0.1)
      if message is not None:
        kind = message["kind"]
        if kind == "finish":
          bad = self._finish_evaluator()
          self._stop_all()
          if bad:
            self._report(TaskFailure(bad.role, bad.proc.returncode, bad.tail))
            return _Outcome(_exit_code(bad.proc.returncode))
          return _Outcome(0)
        if kind in ("stop", "lost", "error"):
          self._stop_all()
          self._say(f"node {self._spec.node_rank} stops: {message['why']}")
          code = (128 + self._signal if self._signal is not None
                  else _exit_code(message.get("code", 1)))
          return _Outcome(code, message.get("restart"))
      if failed:
        continue
      for t in self._tasks:
        code = t.proc.poll()
        if code not in (None, 0):
          t.reader.join(timeout=5)
          failed = True
          member.send({"kind": "failed", "role": t.role, "code": code,
                       "attempt": attempt})
          self._report(TaskFailure(t.role, code, t.tail))
          self._stop_all()
          break
      if not failed and not done and trainers and all(
          t.proc.poll() == 0 for t in trainers):
        done = True
        member.send({"kind": "done"})

  def _run_once(self, attempt: int) -> int:
    self._start_all(attempt)
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
        failed = self._finish_evaluator()
        self._stop_all()
        if failed:  # Training is done: a restart would not help.
          raise TaskFailure(failed.role, failed.proc.returncode, failed.tail,
                            restart=False)
        return 0
      time.sleep(0.1)

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

  def _start_all(self, attempt: int, configs: list[dict] | None = None
                 ) -> None:
    """Starts every task, then their readers (so no thread runs while the
    launcher forks), or none: a task that cannot start stops the others."""
    env = dict(os.environ)
    env.update(self._spec.env)
    env[_net.JOB_SECRET_VARIABLE] = (job_secret(self._spec)
                                     or secrets.token_hex(32))
    # TensorFlow's C++ chatter, unless the user asked for a level: level 2,
    # and the start-up lines that ignore it dropped from the console.
    self._quiet = "TF_CPP_MIN_LOG_LEVEL" not in env
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(TFDIST_RESTART=str(attempt), PYTHONUNBUFFERED="1")
    configs = configs or self._spec.tf_configs()
    gpus = gpu_plan(self._spec, [c["task"]["type"] for c in configs], env)
    paths = [os.path.join(self._spec.log_dir,
                          f"{c['task']['type']}-{c['task']['index']}.log")
             if self._spec.log_dir else None for c in configs]
    logs: list[TextIO | None] = []
    self._tasks = []
    try:
      for path in paths:
        logs.append(open(path, "a") if path else None)
      for config, log, gpu in zip(configs, logs, gpus):
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
    tail: collections.deque = collections.deque(maxlen=_TAIL_LINES)
    reader = threading.Thread(target=self._pump,
                              args=(role, proc.stdout, tail, log), daemon=True)
    return _Task(role, config, proc, tail, reader, log)

  def _pump(self, role, stream, tail, log) -> None:
    """Copies a task's output with its role before each line.

    A carriage return ends a redrawn line (a progress bar); its text is kept
    and, on a terminal, drawn at once over the role's previous state.
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
    """One line (``newline``) or one state of a redrawn line of ``role``.

    Each line carries one prefix. A redrawn line (Keras's progress bar
    writes backspaces, then a carriage return, then the new state) is drawn
    in place on a terminal, the line of another task first ended; elsewhere
    (a pipe, a log file) only its last state is written, once, when the line
    ends, so no control character reaches a log.
    """
    text = text.replace("\b", "")  # Keras erases with \b, then returns.
    with self._lock:
      drawn = self._partial.get(role)
      if not newline:
        if text:
          self._partial[role] = text
          if self._tty:
            if self._drawing not in (None, role):
              self._out.write("\n")  # End the other task's bar.
            self._out.write(f"\r[{role}] {text}\x1b[K")
            self._drawing = role
            self._out.flush()
        return
      self._partial.pop(role, None)
      if not text and drawn is not None:
        text = drawn  # The bar's last state is its final line.
      plain = _ANSI.sub("", text)  # Keras colours its bar.
      tail.append(plain)
      if log:
        log.write(plain + "\n")
        log.flush()
      if self._quiet and _NOISE.search(plain):
        return  # Kept in the task's log file and its tail.
      if not self._tty:
        text = plain
      if self._tty and self._drawing is not None:
        self._out.write("\r" if self._drawing == role else "\n")
      self._drawing = None
      self._out.write(f"[{role}] {text}" + ("\x1b[K\n" if self._tty
                                            else "\n"))
      self._out.flush()

  def _on_signal(self, signum, frame) -> None:
    """Forwards the first signal; a second one kills the tasks at once."""
    del frame
    again = self._signal is not None
    self._signal = self._signal or signum
    self._stop.set()
    for t in self._tasks:
      _signal_group(t.proc, signal.SIGKILL if again else _FORWARDED[signum])

  def _sleep(self, seconds: float) -> bool:
    """Sleeps ``seconds`` unless a signal comes; whether none came."""
    deadline = time.monotonic() + seconds
    while self._signal is None and time.monotonic() < deadline:
      time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return self._signal is None

  def _stop_all(self) -> None:
    """SIGTERM every live task (unless a forwarded signal already asked them
    to stop), then SIGKILL what outlives the grace period."""
    live = [t for t in self._tasks if t.proc.poll() is None]
    if self._signal is None:
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
      if t.reader.is_alive():
        t.reader.join(timeout=5)
      elif t.reader.ident is None:  # Never started: nothing to read.
        t.proc.stdout.close()
        if t.log:
          t.log.close()

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

  Call it from the main thread: it handles SIGINT, SIGTERM and SIGHUP, and
  the tasks die when the thread that started them ends.

  Args:
    spec: what to launch.
    out: where the tasks' prefixed output goes; ``sys.stdout`` by default.

  Returns:
    0 when the training tasks succeeded and the evaluator, if any, did not
    fail; after the last restart, the failed task's exit code, ``128 + N``
    when it was killed by signal N; ``128 + N`` when the launcher itself got
    signal N.

  Raises:
    ConfigError: `preflight` failed, or the log directory or a task could
      not be created; no task is left running.
  """
  return Launcher(spec, out=out).run()


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


def _make_dirs(path: str | None) -> None:
  """Creates directory ``path`` and its missing parents, or nothing.

  Raises:
    ConfigError: it cannot be created, or files cannot be created in it.
  """
  if not path:
    return
  missing = []
  parent = os.path.abspath(path)
  while not os.path.lexists(parent):
    missing.append(parent)
    parent = os.path.dirname(parent)
  created = []
  try:
    for directory in reversed(missing):
      os.mkdir(directory)
      created.append(directory)
    if not os.access(path, os.W_OK | os.X_OK):
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
  except OSError as e:
    for directory in reversed(created):  # Empty: only ours.
      os.rmdir(directory)
    raise ConfigError(field="log_dir", value=path, source=_SOURCE,
                      expected="a directory that can be created and written",
                      hint=f"{e.strerror}: {e.filename}") from None


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
  try:
    os.killpg(proc.pid, signum)  # The task's own session: only what we started.
  except (ProcessLookupError, PermissionError):
    pass


def _int_at_least(field: str, value, low: int, hint: str | None = None, *,
                  high: int | None = None) -> None:
  if (not isinstance(value, int) or isinstance(value, bool) or value < low
      or (high is not None and value > high)):
    expected = (f"an integer >= {low}" if high is None
                else f"an integer from {low} to {high}")
    low_int = isinstance(value, int) and value < low
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected=expected, hint=hint if low_int else None)


def _seconds(field: str, value, *, zero: bool) -> None:
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not math.isfinite(value) or value > _MAX_SECONDS
      or value < 0 or (value == 0 and not zero)):
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected=f"a number of seconds "
                               f"{'from 0' if zero else 'above 0'} to "
                               f"{_MAX_SECONDS:g}")


def _words(field: str, value, expected: str) -> None:
  if (isinstance(value, str) or not isinstance(value, Sequence) or not value
      or not all(isinstance(w, str) and w and "\0" not in w for w in value)):
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected=f"{expected}: non-empty strings without NUL "
                               "bytes")


def _host(field: str, host) -> None:
  """``host`` is an IP address or a DNS name (reachability: `preflight`)."""
  if isinstance(host, str):
    try:
      ipaddress.ip_address(host)
      return
    except ValueError:
      if len(host) <= 253 and _HOSTNAME.fullmatch(host):
        return
  raise ConfigError(field=field, value=host, source=_SOURCE,
                    expected="an IP address or a DNS name, e.g. 127.0.0.1")


def _load_libc() -> ctypes.CDLL | None:
  if not sys.platform.startswith("linux"):
    return None
  try:
    return ctypes.CDLL(None, use_errno=True)
  except OSError:
    return None


_LIBC = _load_libc()
