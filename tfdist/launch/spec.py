"""What `tfdist launch` runs: `LaunchSpec`, its checks, and what is computed
once per run (`preflight`).

`LaunchSpec` is a pure value, like torch's ``LaunchConfig``: building one
checks what needs no I/O. `preflight` checks what this machine must provide
(the program, the script, free ports, the job secret, the GPUs) and returns
it as a `Prepared`, computed once for every attempt of the run. TensorFlow-
free.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import ipaddress
import math
import os
import re
import resource
import secrets
import shutil
from typing import Mapping, Sequence

from tfdist import _net
from tfdist.errors import ConfigError
from tfdist.launch import fingerprint

__all__ = ["LaunchSpec", "Prepared", "preflight", "job_secret", "gpu_plan",
           "MAX_RESTART_DELAY_SECONDS", "make_dirs", "run_id_of"]

_SOURCE = "LaunchSpec"

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
#: ``--nnodes``: N, or MIN:MAX as torchrun spells it.
_NNODES = re.compile(r"(\d+)(?::(\d+))?")
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")

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
      (checked by `preflight`).
    port_base: first port; consecutive ports from there must be free (checked
      by `preflight`). Free ports are picked when ``None``.
    log_dir: also write each task's output to ``<log_dir>/<type>-<index>.log``
      (appended to; the directory is created, before any task starts).
    max_restarts: relaunch the cluster up to this many times after a task
      failed (node 0's counts for the job); a change of members spends none.
    restart_delay_seconds: wait before the first restart after a failure;
      each further one waits twice as long, at most
      `MAX_RESTART_DELAY_SECONDS`. A change of members waits for nothing.
    grace_seconds: how long a task may take to exit after SIGTERM.
    env: extra environment for every task.
    nnodes: the nodes of a multi-node launch, ``N`` or ``"MIN:MAX"`` (an
      elastic job: it starts with MAX nodes, or with MIN or more at the
      last call, and restarts at the new size when nodes are lost or join,
      while MIN or more are left, spending no restart); each node runs its
      own launcher with the same ``nnodes``, ``master_addr`` and
      ``master_port``, and the task counts above mean the tasks *on this
      node*. Read back as MAX.
    min_nodes: MIN, when ``nnodes`` is a number; ``nnodes`` by default.
    node_rank: this node's rank, 0 to MAX - 1; node 0 runs the rendezvous
      (`tfdist.launch.rendezvous`) and holds the chief.
    last_call_seconds: how long each round of an elastic job waits for
      more nodes once MIN have joined, before it starts without them.
    run_id: the job's name, the same on every node (``TFDIST_RUN_ID`` in
      every task): letters, digits, ``-``, ``_`` and ``.``. By default the
      first 12 hex digits of a SHA-256 of the job secret (`run_id_of`).
    master_addr: node 0's address as every node reaches it (the rendezvous
      listens there only); needed when ``nnodes > 1`` (`preflight`), unless
      a SLURM step gives it (`tfdist.launch.members`).
    master_port: the rendezvous port on node 0; needed likewise.
    rendezvous_timeout_seconds: how long each round may wait for enough
      nodes (all, or MIN) to join.
    secret_file: a file holding the job's shared secret (readable by its
      owner only), when ``TFDIST_JOB_SECRET`` is not set; a multi-node launch
      needs one of them, the same on every node.
    gpus_per_task: GPUs for each chief, worker and evaluator task of this
      node (in ``CUDA_VISIBLE_DEVICES``); by default the node's GPUs are
      split evenly. ps tasks get none.
    stall_seconds: print the stall report (`tfdist.launch.stall`) when a
      task saw no training step for this long after its first; 0: only on
      a collective's timeout, a lost peer, or SIGUSR2 to the launcher.

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
  nnodes: int | str = 1
  min_nodes: int | None = None
  node_rank: int = 0
  last_call_seconds: float = 10.0
  run_id: str | None = None
  master_addr: str | None = None
  master_port: int | None = None
  rendezvous_timeout_seconds: float = 300.0
  secret_file: str | None = None
  gpus_per_task: int | None = None
  stall_seconds: float = 0.0

  def __post_init__(self):
    low, high = _node_counts(self.nnodes, self.min_nodes)
    object.__setattr__(self, "nnodes", high)
    object.__setattr__(self, "min_nodes", low)
    _words("command", self.command,
           "a program and its arguments, e.g. ('python', 'train.py')")
    object.__setattr__(self, "command", tuple(self.command))
    _int_at_least("num_workers", self.num_workers,
                  1 if self.nnodes == 1 else 0, high=_MAX_TASKS,
                  hint="Every cluster needs a worker: ask for 1 or more")
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
    _int_at_least("node_rank", self.node_rank, 0, high=self.nnodes - 1)
    _seconds("rendezvous_timeout_seconds", self.rendezvous_timeout_seconds,
             zero=False)
    _seconds("last_call_seconds", self.last_call_seconds, zero=True)
    _seconds("stall_seconds", self.stall_seconds, zero=True)
    if self.run_id is not None and not (
        isinstance(self.run_id, str) and _RUN_ID.fullmatch(self.run_id)):
      raise ConfigError(
          field="run_id", value=self.run_id, source=_SOURCE,
          expected="1 to 128 letters, digits, '-', '_' and '.'",
          hint="e.g. --run-id resnet-2026-11-27; leave it out for one made "
               "from the job secret")
    if self.elastic and self.node_rank == 0 and not self.num_workers and (
        low == 1):
      raise ConfigError(
          field="nnodes", value=f"{low}:{high}", source=_SOURCE,
          expected="a MIN this node's tasks can serve: node 0 runs no worker, "
                   "so it cannot train alone",
          hint="Give node 0 a worker or more, or a MIN of 2 or more")
    if self.elastic and self.node_rank and (self.chief or self.num_ps
                                            or self.evaluator):
      raise ConfigError(
          field="node_rank", value=self.node_rank, source=_SOURCE,
          expected="0 for a node with a chief, ps or evaluator task in an "
                   "elastic job (only node 0, which holds the rendezvous, is "
                   "sure to stay)",
          hint="Put the chief, ps and evaluator tasks on node 0; other "
               "nodes run workers")
    if self.master_addr is not None:
      _host("master_addr", self.master_addr)
    if self.master_port is not None:
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
  def elastic(self) -> bool:
    return self.min_nodes < self.nnodes

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
    """Seconds to wait before the restart after task failure number
    ``restart`` (1, 2, ...)."""
    if not self.restart_delay_seconds:
      return 0.0
    doublings = min(restart - 1, 64)  # Past the cap long before 2**64.
    return min(self.restart_delay_seconds * 2.0 ** doublings,
               MAX_RESTART_DELAY_SECONDS)

  @property
  def kinds(self) -> list[str]:
    """The type of each of this node's tasks, in start order."""
    return ([job for job, n in self.jobs.items() for _ in range(n)]
            + ["evaluator"] * self.evaluator)

  def ports(self, host: str) -> list[int]:
    """A port for each task: consecutive from ``port_base``, else free on
    ``host`` now."""
    if self.port_base is not None:
      return list(range(self.port_base, self.port_base + self.num_tasks))
    return _net.free_ports(self.num_tasks, host)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What `preflight` found, for every attempt of one run.

  Attributes:
    secret: the job's secret, given or made fresh for one node.
    gpus: ``CUDA_VISIBLE_DEVICES`` of each task, in `LaunchSpec.kinds`
      order (`gpu_plan`).
    node: what this node runs (`tfdist.launch.fingerprint.take`), for
      node 0 to compare; empty on one node.
    run_id: ``run_id``, or one made from the secret (`run_id_of`).
  """
  secret: str
  gpus: list[str | None]
  node: dict = dataclasses.field(default_factory=dict)
  run_id: str = ""


def _node_counts(nnodes, min_nodes) -> tuple[int, int]:
  """``nnodes`` (``N`` or ``"MIN:MAX"``) and ``min_nodes`` as (MIN, MAX)."""
  if isinstance(nnodes, int) and not isinstance(nnodes, bool):
    low = high = nnodes
    if min_nodes is not None:
      _int_at_least("min_nodes", min_nodes, 1, high=nnodes)
      low = min_nodes
  elif min_nodes is not None:
    raise ConfigError(field="min_nodes", value=min_nodes, source=_SOURCE,
                      expected=f"no min_nodes beside nnodes={nnodes!r}")
  else:
    match = isinstance(nnodes, str) and _NNODES.fullmatch(nnodes.strip())
    if not match:
      low = high = -1
    else:
      low = int(match.group(1))
      high = int(match.group(2) or low)
  if not 1 <= low <= high <= _MAX_TASKS:
    raise ConfigError(
        field="nnodes", value=nnodes, source=_SOURCE,
        expected=f"N or MIN:MAX, whole numbers with 1 <= MIN <= MAX <= "
                 f"{_MAX_TASKS}, e.g. 2 or 2:4")
  return low, high


def preflight(spec: LaunchSpec) -> Prepared:
  """Checks what ``spec`` needs from this machine, before anything starts.

  The program must be on PATH (and a Python script must exist), ``host``
  must be an address of this machine, the open-file limit must allow a pipe
  (and a log file) per task, ``log_dir`` must not be a file, with a
  ``port_base`` the ports of every task must be free on ``host``, a
  multi-node job needs its secret, and the GPUs asked for must be there.
  Nothing is written.

  Returns:
    The secret, the GPU plan and, on several nodes, what this node runs,
    for every attempt of the run.

  Raises:
    ConfigError: the first thing missing, naming the field.
  """
  if spec.nnodes > 1 and None in (spec.master_addr, spec.master_port):
    raise ConfigError(
        field="master_addr" if spec.master_addr is None else "master_port",
        source=_SOURCE, hint="Give every node the same master address and "
        "port (under SLURM, run tfdist launch in an srun step instead)",
        expected=f"node 0's address and port for a job of {spec.nnodes} "
                 "nodes")
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
  if (spec.log_dir and os.path.lexists(spec.log_dir)
      and not os.path.isdir(spec.log_dir)):
    raise ConfigError(field="log_dir", value=spec.log_dir, source=_SOURCE,
                      expected="a directory for the tasks' log files")
  if spec.port_base is not None:
    ports = range(spec.port_base, spec.port_base + spec.num_tasks)
    taken = [p for p in ports if _net.port_problem(spec.address, p)]
    if taken:
      raise ConfigError(
          field="port_base", value=spec.port_base, source=_SOURCE,
          expected=(f"{spec.num_tasks} free ports from {spec.port_base}; "
                    f"port {taken[0]} on {spec.address} is taken"),
          hint="Pick another first port, or leave it out to use free "
               "ports")

  if spec.nnodes > 1:
    _, why = _net.lookup(spec.master_addr)
    if why:
      raise ConfigError(
          field="master_addr", value=spec.master_addr, source=_SOURCE,
          hint=why, expected="node 0's address, or a name that resolves to it")
  environ = {**os.environ, **spec.env}
  secret = job_secret(spec) or secrets.token_hex(32)
  return Prepared(secret=secret, gpus=gpu_plan(spec, spec.kinds, environ),
                  node=fingerprint.take(spec.command, environ=environ)
                  if spec.nnodes > 1 else {},
                  run_id=spec.run_id or run_id_of(secret))


def run_id_of(secret: str) -> str:
  """The default run id: the same on every node of a job (they share its
  secret), new with each secret. 48 bits of a hash reveal no more of the
  secret than the rendezvous's challenges, which carry HMACs of it."""
  return hashlib.sha256(b"tfdist run id\0" + secret.encode()).hexdigest()[:12]


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
        expected=f"the job's shared secret, the same on each of its "
                 f"{spec.nnodes} nodes",
        hint=f"Set {_net.JOB_SECRET_VARIABLE} to the same random value on "
             "every node (e.g. from `openssl rand -hex 32`), or give a file "
             "that holds it and only you can read; never pass it as an "
             "argument")
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
    ConfigError: ``gpus_per_task`` asks for more GPUs than there are; it
      says what fits instead.
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
        expected=(f"at most as many GPUs in all as this node has "
                  f"({','.join(gpus)}), not {each} for each task that uses "
                  f"GPUs ({len(users)} here)"),
        hint=_what_fits(each, len(users), gpus))
  if each is None:
    each = max(1, len(gpus) // len(users))
  plan: list[str | None] = [""] * len(kinds)
  for n, i in enumerate(users):
    plan[i] = ",".join(gpus[(n * each + k) % len(gpus)] for k in range(each))
  return plan



def _what_fits(each: int, tasks: int, gpus: Sequence[str]) -> str:
  """The choices that fit ``tasks`` tasks of ``each`` GPUs on ``gpus``."""
  fewer = len(gpus) // each
  choices = [f"run {fewer} such task" if fewer == 1 else
             f"run at most {fewer} such tasks"] if fewer else []
  if len(gpus) >= tasks:
    choices.append(f"ask for {len(gpus) // tasks} each, the even share "
                   "that leaving it out gives")
  else:
    shared = (f"GPU {gpus[0]}" if len(gpus) == 1
              else f"GPUs {','.join(gpus)} in turn")
    choices.append(f"leave it out so that the {tasks} tasks share {shared}")
  said = ", or ".join(choices)
  return said[0].upper() + said[1:]


def make_dirs(path: str | None) -> None:
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


