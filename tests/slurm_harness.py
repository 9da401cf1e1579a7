"""A real, private SLURM for tests, and SLURM's own hostlist parser.

`LocalSlurm` starts munged, slurmctld and one slurmd per node (``slurmd -N
NAME``, all on this machine) from Debian's ``slurm-wlm`` and ``munge``
packages as children of the test process, on 127.0.0.1 and free ports, with
every file in a temporary directory. It never touches a system SLURM or munge:
the daemons read only the generated ``slurm.conf`` and munge socket, and
`LocalSlurm.stop` kills exactly the PIDs it started. Start-up takes about a
second; every wait is bounded.

Example::

  with LocalSlurm(nodes=("n9", "n10"), cpus=4) as slurm:
    result = slurm.srun(["-n", "5", "-m", "cyclic", sys.executable, "t.py"],
                        env={"PYTHONPATH": repo_root}, timeout=120)
    job_id, output = slurm.sbatch("#!/bin/sh\\nsrun hostname\\n",
                                  args=["-N", "2"], timeout=60)

`scontrol_hostnames` runs ``scontrol show hostnames`` with nothing but a
throw-away ``slurm.conf``: no daemon is needed to expand a hostlist.

Tests call `slurm_unavailable_reason()` and skip with its reason when it is not
``None``. When the packages are missing and can be installed (root and apt-get
are present) they are installed; a failed installation raises instead of
skipping, so a broken set-up is never hidden as a skip.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from typing import Mapping, Sequence

from tfdist import _net

import apt_install

__all__ = [
    "LocalSlurm",
    "local_node_name",
    "SlurmError",
    "HostnamesResult",
    "scontrol_hostnames",
    "slurm_unavailable_reason",
]

_COMMANDS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol",
             "sinfo", "squeue", "scancel")
_PACKAGES = ("slurm-wlm", "munge")
#: See `LocalSlurm.release_requeued`: past the next whole second, by a margin.
_REQUEUE_RELEASE_MARGIN_S = 0.2
#: The host of a `netbed.NetBed` that runs slurmctld and the commands.
CONTROLLER = "ctl"
_NOT_CHECKED = object()
_unavailable_reason: object = _NOT_CHECKED  # Cached str, or None when usable.


class SlurmError(RuntimeError):
  """A SLURM daemon or command did not do what the harness needed."""


def _missing_commands() -> list[str]:
  return [c for c in _COMMANDS
          if shutil.which(c, path=os.environ.get("PATH", "") + ":/usr/sbin")
          is None]


def slurm_unavailable_reason() -> str | None:
  """Why SLURM cannot run here, or ``None`` when it can.

  Installs ``slurm-wlm`` and ``munge`` with apt-get when they are missing and
  this process is root with apt-get available.

  Raises:
    SlurmError: installation was possible and failed.
  """
  global _unavailable_reason
  if _unavailable_reason is not _NOT_CHECKED:
    return _unavailable_reason  # type: ignore[return-value]
  missing = _missing_commands()
  if missing:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
      _unavailable_reason = (
          f"SLURM commands {missing} are missing and cannot be installed "
          "here (needs root and apt-get): apt-get install slurm-wlm munge")
      return _unavailable_reason
    apt_install.install(lambda: _PACKAGES if _missing_commands() else (),
                        error=SlurmError)
    missing = _missing_commands()
    if missing:
      raise SlurmError(f"installed {_PACKAGES} but {missing} still missing")
  _unavailable_reason = None
  return None


def _which(command: str) -> str:
  path = shutil.which(command, path=os.environ.get("PATH", "") + ":/usr/sbin")
  if path is None:
    raise SlurmError(f"{command} not found; call slurm_unavailable_reason()")
  return path


# ---------------------------------------------------------------- hostnames.

_hostnames_conf: str | None = None


def _minimal_conf() -> str:
  """A throw-away slurm.conf; ``scontrol show hostnames`` only reads it."""
  global _hostnames_conf
  if _hostnames_conf is None or not os.path.exists(_hostnames_conf):
    directory = tempfile.mkdtemp(prefix="tfdist-hostnames-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    _hostnames_conf = os.path.join(directory, "slurm.conf")
    with open(_hostnames_conf, "w") as f:
      f.write("ClusterName=hostnames\n"
              "SlurmctldHost=localhost(127.0.0.1)\n"
              "NodeName=localhost CPUs=1\n"
              "PartitionName=p Nodes=localhost Default=YES\n")
  return _hostnames_conf


class HostnamesResult:
  """What ``scontrol show hostnames`` made of one hostlist.

  Attributes:
    accepted: False when SLURM printed ``Invalid hostlist`` or an error.
    names: the expanded names, in SLURM's order (empty when rejected).
    stderr: what scontrol wrote to stderr.
  """

  def __init__(self, accepted: bool, names: list[str], stderr: str):
    self.accepted = accepted
    self.names = names
    self.stderr = stderr

  def __repr__(self):
    return (f"HostnamesResult(accepted={self.accepted}, names={self.names!r},"
            f" stderr={self.stderr!r})")


def scontrol_hostnames(text: str, *, env: Mapping[str, str] | None = None,
                       timeout: float = 30) -> HostnamesResult:
  """Expands ``text`` with SLURM's own parser (``scontrol show hostnames``).

  Needs only a slurm.conf, no daemon. scontrol exits 0 even for an invalid
  hostlist; it then prints ``Invalid hostlist: ...`` or an ``error:`` line
  on stderr, which is what `HostnamesResult.accepted` reflects.

  Args:
    text: the hostlist expression.
    env: environment for scontrol; by default one whose ``SLURM_CONF`` names a
      minimal throw-away slurm.conf.
    timeout: seconds before scontrol is killed.

  Returns:
    A `HostnamesResult`.
  """
  if env is None:
    env = dict(os.environ, SLURM_CONF=_minimal_conf())
  proc = subprocess.run([_which("scontrol"), "--", "show", "hostnames", text],
                        env=dict(env), capture_output=True, timeout=timeout,
                        check=False)
  stdout = proc.stdout.decode("utf-8", "surrogateescape")
  stderr = proc.stderr.decode("utf-8", "surrogateescape")
  if proc.returncode != 0:
    raise SlurmError(f"scontrol show hostnames {text!r} exited "
                     f"{proc.returncode}: {stderr}")
  # With three or more bracket groups SLURM 22.05 reports a bad range in an
  # early group ("error: _parse_single_range: Invalid range") but then drops
  # those names and carries on; count any error as a rejection.
  if "Invalid hostlist" in stderr or "error:" in stderr:
    return HostnamesResult(False, [], stderr)
  return HostnamesResult(True, stdout.split("\n")[:-1] if stdout else [],
                         stderr)


# ---------------------------------------------------------------- daemons.


def local_node_name() -> str:
  """This machine's short host name: a node name TensorFlow can resolve."""
  return socket.gethostname().split(".")[0]

_CONF_TEMPLATE = """\
ClusterName=tfdist
SlurmctldHost={hostname}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
# Start a batch job at the controller's next one-second tick, not up to 3 s
# (the default) after its submission or release.
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=300
KillWait=5
InactiveLimit=0
MinJobAge=300
{node_lines}
PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
  """A private SLURM cluster on loopback, owned by this process.

  Every node is a ``slurmd -N NAME`` on this machine with its own port, all
  reached at 127.0.0.1, so a one-machine "cluster" can have several nodes and
  srun lays tasks out over them exactly as on real hardware. TensorFlow can
  only reach a node whose name resolves, so the default single node is named
  after this machine (`local_node_name`). (``localhost`` does not work as a
  node name next to others: slurmd 22.05 then fails with "Duplicated
  NodeHostName".)

  Attributes:
    root: the temporary directory holding every file of the cluster.
    conf_path: the generated slurm.conf.
    nodes: the node names (``SLURMD_NODENAME`` in jobs), in slurm.conf order.
    cpus: the CPUs each node declares (may exceed the real core count;
      ``SlurmdParameters=config_overrides`` lets slurmd accept that).
    env: the environment for SLURM commands: ``SLURM_CONF`` set, any
      inherited ``SLURM_*`` variables removed.
  """

  def __init__(self, *, nodes: Sequence[str] | None = None, cpus: int = 8,
               start_timeout: float = 60, bed=None):
    self.bed = bed
    if bed is not None and not nodes:
      nodes = [h for h in bed.hosts if h != CONTROLLER]
    self.nodes = tuple(nodes) if nodes else (local_node_name(),)
    self.cpus = cpus
    self.start_timeout = start_timeout
    self.root: str | None = None
    self.conf_path: str | None = None
    self.env: dict[str, str] = {}
    self._procs: list[subprocess.Popen] = []

  # -- lifecycle.

  def __enter__(self) -> "LocalSlurm":
    self.start()
    return self

  def __exit__(self, *exc_info) -> None:
    self.stop()

  def start(self) -> None:
    """Starts munged, slurmctld and the slurmds; waits for idle nodes.

    Raises:
      SlurmError: SLURM is unavailable, a daemon died, or the nodes were not
        idle within ``start_timeout`` seconds; the message carries the logs.
    """
    reason = slurm_unavailable_reason()
    if reason is not None:
      raise SlurmError(reason)
    self.root = tempfile.mkdtemp(prefix="tfdist-slurm-")
    try:
      self._start()
    except BaseException:
      self.stop()
      raise

  def _start(self) -> None:
    root = self.root
    for sub in ("state", "spool", "munge"):
      os.makedirs(os.path.join(root, sub))
    # munged wants no group/other write up the path, and execute for all on
    # its socket's directory; the key itself is 0400.
    for path in (root, os.path.join(root, "munge")):
      os.chmod(path, 0o755)
    key = os.path.join(root, "munge", "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    munge_socket = os.path.join(root, "munge", "munge.socket")
    self._spawn("munged", [
        _which("munged"), "--foreground", "--force",
        f"--socket={munge_socket}", f"--key-file={key}",
        f"--pid-file={root}/munge/munged.pid",
        f"--log-file={root}/munge/munged.log",
        f"--seed-file={root}/munge/munged.seed"])
    self._wait(lambda: os.path.exists(munge_socket), "munged socket")

    ctld_port, *node_ports = _net.free_ports(1 + len(self.nodes))
    hostname, ctld_addr = local_node_name(), "127.0.0.1"
    if self.bed is not None:
      hostname, ctld_addr = CONTROLLER, self.bed.address(CONTROLLER)
    node_lines = "\n".join(
        f"NodeName={node} NodeHostname={node} NodeAddr={self._address(node)} "
        f"Port={port} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
        for node, port in zip(self.nodes, node_ports))
    self.conf_path = os.path.join(root, "slurm.conf")
    with open(self.conf_path, "w") as f:
      f.write(_CONF_TEMPLATE.format(
          hostname=hostname, ctld_addr=ctld_addr, ctld_port=ctld_port,
          munge_socket=munge_socket,
          root=root, node_lines=node_lines, nodes=",".join(self.nodes)))
    self.env = {k: v for k, v in os.environ.items()
                if not k.startswith(("SLURM_", "SLURMD_", "SRUN_", "SBATCH_",
                                     "SALLOC_"))}
    self.env["SLURM_CONF"] = self.conf_path
    # The job scripts run `tfdist launch`: this interpreter's entry point.
    self.env["PATH"] = (os.path.dirname(sys.executable) + os.pathsep
                        + self.env.get("PATH", os.defpath))
    self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f",
                              self.conf_path], host=CONTROLLER)
    for node in self.nodes:
      self._spawn(f"slurmd.{node}", [_which("slurmd"), "-D", "-N", node,
                                     "-f", self.conf_path], host=node)
    self.wait_idle()

  def _address(self, node: str) -> str:
    return "127.0.0.1" if self.bed is None else self.bed.address(node)

  def command(self, argv: Sequence[str], host: str = None) -> list[str]:
    """``argv`` as run on this cluster: on the bed's ``host`` (its
    controller by default) when it runs over a `netbed.NetBed`."""
    if self.bed is None:
      return list(argv)
    return self.bed.command(host or CONTROLLER, argv)

  def _spawn(self, name: str, argv: list[str], host: str = None) -> None:
    log = open(os.path.join(self.root, f"{name}.stdout"), "wb")
    try:
      proc = subprocess.Popen(self.command(argv, host), stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL,
                              env=dict(self.env or os.environ),
                              start_new_session=True)
    finally:
      log.close()
    proc.tfdist_name = name  # type: ignore[attr-defined]
    self._procs.append(proc)

  def _wait(self, ready, what: str) -> None:
    deadline = time.monotonic() + self.start_timeout
    while time.monotonic() < deadline:
      for proc in self._procs:
        if proc.poll() is not None:
          raise SlurmError(f"{proc.tfdist_name} exited with {proc.returncode}"
                           f" while waiting for {what}\n{self.logs()}")
      if ready():
        return
      time.sleep(0.2)
    raise SlurmError(f"timed out after {self.start_timeout}s waiting for "
                     f"{what}\n{self.logs()}")

  def wait_idle(self, nodes: Sequence[str] | None = None) -> None:
    """Waits (at most ``start_timeout`` s) until ``nodes`` (all by default)
    are idle: a job submitted now may have them, the moment the controller
    schedules it.

    Raises:
      SlurmError: a daemon died, or the nodes were not idle in time.
    """
    nodes = tuple(nodes or self.nodes)
    self._wait(lambda: self._nodes_idle(nodes), f"nodes {list(nodes)} idle")

  def _nodes_idle(self, nodes: Sequence[str]) -> bool:
    proc = subprocess.run(
        self.command([_which("sinfo"), "-h", "-N", "-o", "%N %T"]),
        env=self.env, capture_output=True, text=True, timeout=10, check=False)
    states = dict(line.split() for line in proc.stdout.splitlines()
                  if len(line.split()) == 2)
    return proc.returncode == 0 and all(
        states.get(node) == "idle" for node in nodes)

  def logs(self) -> str:
    """The tails of the daemon logs, for error messages."""
    out = []
    if self.root:
      names = ["munge/munged.log", "munged.stdout", "slurmctld.log",
               "slurmctld.stdout"]
      for node in self.nodes:
        names += [f"slurmd.{node}.log", f"slurmd.{node}.stdout"]
      for name in names:
        path = os.path.join(self.root, name)
        if os.path.exists(path):
          with open(path, errors="replace") as f:
            out.append(f"--- {name}\n{f.read()[-3000:]}")
    return "\n".join(out)

  def stop(self) -> None:
    """Ends this cluster's jobs and the daemons this object started.

    Cancels the jobs first so slurmd can end their tasks, then signals
    exactly the PIDs this object started (newest first; SIGKILL after 15 s)
    and removes the temporary directory. Takes at most about 30 seconds.
    """
    if self._procs and all(p.poll() is None for p in self._procs):
      self._cancel_all()  # Lets slurmd end its tasks before it goes.
      deadline = time.monotonic() + 10
      while self._any_job() and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in reversed(self._procs):
      if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in reversed(self._procs):
      try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    self._procs = []
    if self.root:
      shutil.rmtree(self.root, ignore_errors=True)
      self.root = None

  # -- commands.

  def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
    if not self.env:
      raise SlurmError("LocalSlurm is not started")
    merged = dict(self.env)
    merged.update(env or {})
    return merged

  def srun(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``srun ARGS`` and returns its completed process (text output).

    srun runs with ``--kill-on-bad-exit=1``, so one failing task ends the
    step instead of leaving its peers waiting.

    Args:
      args: srun's arguments, e.g. ``["-n", "2", sys.executable, "x.py"]``.
      env: extra environment variables for srun (and so for the tasks).
      timeout: seconds before the job is cancelled and srun killed.

    Raises:
      subprocess.TimeoutExpired: srun did not finish within ``timeout``.
    """
    argv = self.command([_which("srun"), "--kill-on-bad-exit=1", *args])
    proc = subprocess.Popen(argv, env=self._env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
      stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      self._cancel_all()
      proc.kill()
      proc.communicate(timeout=30)
      raise
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)

  def sbatch(self, script: str, *, args: Sequence[str] = (),
             timeout: float = 120) -> tuple[str, str]:
    """Submits a batch script and waits for it to finish.

    Args:
      script: the script text (starting with ``#!``) or a path to one.
      args: extra sbatch options, e.g. ``["-n", "2"]``.
      timeout: seconds to wait for the job to finish; it is cancelled after.

    Returns:
      ``(job_id, output)``: the job id and the job's stdout and stderr.

    Raises:
      SlurmError: sbatch failed, or the job did not finish within ``timeout``.
    """
    env = self._env(None)
    if not os.path.exists(script):
      path = os.path.join(self.root, f"batch-{time.monotonic_ns()}.sh")
      with open(path, "w") as f:
        f.write(script)
      script = path
    output = os.path.join(self.root, "job-%j.out")
    proc = subprocess.run(
        self.command([_which("sbatch"), "--parsable", f"--output={output}",
                      f"--chdir={self.root}", *args, script]),
        env=env, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
      raise SlurmError(f"sbatch failed: {proc.stderr}")
    job_id = proc.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while self._job_active(job_id):
      if time.monotonic() > deadline:
        self._cancel_all()
        raise SlurmError(f"job {job_id} still running after {timeout}s")
      time.sleep(0.3)
    path = output.replace("%j", job_id)
    if not os.path.exists(path):  # The job never ran.
      raise SlurmError(f"job {job_id} left no output\n{self.logs()}")
    with open(path, errors="replace") as f:
      return job_id, f.read()

  def _job_active(self, job_id: str) -> bool:
    proc = subprocess.run(
        self.command([_which("scontrol"), "-o", "show", "job", job_id]),
        env=self.env,
        capture_output=True, text=True, timeout=30, check=False)
    match = re.search(r"JobState=(\S+)", proc.stdout)
    return bool(match) and match.group(1) in (
        "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")

  def _any_job(self) -> bool:
    proc = subprocess.run(self.command([_which("squeue"), "-h", "-o", "%i"]),
                          env=self.env,
                          capture_output=True, text=True, timeout=30,
                          check=False)
    return proc.returncode == 0 and bool(proc.stdout.strip())

  def _cancel_all(self) -> None:
    subprocess.run(self.command([_which("scancel"), "--full",
                                 "--partition=debug"]),
                   env=self.env, capture_output=True, timeout=30, check=False)

  def release_requeued(self, job: str) -> None:
    """Starts a requeued, pending job now instead of after SLURM's hold.

    Call it once the job is PENDING again. SLURM holds a requeued job
    (BeginTime about 121 s ahead). slurmd revoked the job's credential when
    it killed the previous run and compares whole seconds: a credential made
    in the same second as that kill is refused ("Job N already killed, do not
    launch batch job") and the job ends FAILED. The kill is done before the
    job shows PENDING (it is COMPLETING until slurmd has ended the run), so
    this waits until the next whole second has begun, plus a margin.

    Args:
      job: the job id, or ``ARRAYID_TASKID`` for an array element.
    """
    now = time.time()
    time.sleep(int(now) + 1 + _REQUEUE_RELEASE_MARGIN_S - now)
    proc = subprocess.run(
        self.command([_which("scontrol"), "update", f"JobId={job}",
                      "StartTime=now"]),
        env=self._env(None), capture_output=True, text=True, timeout=30,
        check=False)
    if proc.returncode != 0:
      raise SlurmError(f"scontrol update JobId={job} StartTime=now failed: "
                       f"{proc.stderr}")

  def scontrol_hostnames(self, text: str) -> HostnamesResult:
    """``scontrol show hostnames TEXT`` with this cluster's slurm.conf."""
    return scontrol_hostnames(text, env=self._env(None))


class SharedSlurm:
  """One `LocalSlurm` for a test module: started on first use, stopped once.

  Use::

    _SLURM = slurm_harness.SharedSlurm(nodes=("n9", "n10"))
    tearDownModule = _SLURM.stop

  `get` skips the calling test with the reason when SLURM cannot run here.
  """

  def __init__(self, **local_slurm_kwargs):
    self._kwargs = local_slurm_kwargs
    self._slurm: LocalSlurm | None = None

  def get(self) -> LocalSlurm:
    if self._slurm is None:
      reason = slurm_unavailable_reason()
      if reason:
        raise unittest.SkipTest(reason)
      slurm = LocalSlurm(**self._kwargs)
      slurm.start()
      self._slurm = slurm
    return self._slurm

  def stop(self) -> None:
    if self._slurm is not None:
      self._slurm.stop()
      self._slurm = None
