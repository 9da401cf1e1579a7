"""Several "hosts" on this one machine: Linux network namespaces on a private
switch, for multi-node tests.

Each host of a `NetBed` is a network namespace with its own address on
198.18.0.0/24 (reserved for benchmarking, RFC 2544), its own host name (a UTS
namespace) and its own ``/etc/hosts`` (bind-mounted in a mount namespace of
its own); its link can be shaped with ``tc tbf`` (``rate="1gbit"``). The
switch, a Linux bridge, lives in a namespace of its own too, and each veth
pair is created inside the namespaces: the machine's own interfaces, routes
and firewall are never touched, and no namespace has a default route or NAT.

What the bed creates carries its mark, ``tfdist-<pid>-`` (the test process's
PID), and is removed on `NetBed.close` (also at exit); a bed starting up first
removes marked namespaces whose PID is no longer alive (a crashed earlier
run), with the processes left in them, and nothing else.

Commands enter a host with ``nsenter --net`` plus ``unshare --uts --mount``,
not ``ip netns exec``, which remounts ``/sys`` and so breaks slurmd's cgroup
handling. Every process started in a host is killed on close, by PID.

Example::

  with NetBed(hosts=("node1", "node2"), rate="1gbit") as bed:
    server = bed.popen("node2", ["python3", "-m", "http.server", "8000"])
    bed.run("node1", ["curl", f"http://node2:8000/"], timeout=30)
    bed.address("node2")  # '198.18.0.12'

Tests call `netbed_unavailable_reason()` and skip with its reason when it is
not ``None`` (not root, or network namespaces are refused here). Missing
tools are installed with apt-get when this process is root; a failed
installation raises instead of skipping.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Mapping, Sequence

import apt_install

__all__ = ["NetBed", "netbed_unavailable_reason", "SUBNET", "NetBedError"]

#: The bed's addresses: 198.18.0.0/15 is reserved for network benchmarks.
SUBNET = "198.18.0.0/24"
_FIRST_HOST = 11  # node i gets 198.18.0.(11 + i).
_TOOLS = {"ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux",
          "unshare": "util-linux", "mount": "mount", "hostname": "hostname"}
_MARK = re.compile(r"^tfdist-(\d+)-\S+")
_COMMAND_TIMEOUT_S = 30
_NOT_CHECKED = object()
_reason: object = _NOT_CHECKED
#: Entering a host: name it, mount its hosts file, run the command.
_ENTER = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'


class NetBedError(RuntimeError):
  """A namespace, link or command of the bed did not do what was asked."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  proc = subprocess.run(["ip", *args], capture_output=True, text=True,
                        timeout=_COMMAND_TIMEOUT_S, check=False)
  if check and proc.returncode != 0:
    raise NetBedError(f"ip {' '.join(args)} failed ({proc.returncode}): "
                      f"{proc.stderr.strip()}")
  return proc


def _missing_packages() -> list[str]:
  return sorted({pkg for tool, pkg in _TOOLS.items()
                 if shutil.which(tool) is None})


def netbed_unavailable_reason() -> str | None:
  """Why a `NetBed` cannot run here, or ``None`` when it can.

  Installs missing tools (iproute2, util-linux) with apt-get as root.

  Raises:
    NetBedError: an installation was possible and failed.
  """
  global _reason
  if _reason is not _NOT_CHECKED:
    return _reason  # type: ignore[return-value]
  if os.geteuid() != 0:
    _reason = ("network namespaces need root: run the suite as root (CI "
               "does) to test several hosts")
    return _reason
  missing = _missing_packages()
  if missing and shutil.which("apt-get") is None:
    _reason = f"tools of {missing} are missing and apt-get is not here"
    return _reason
  if missing:  # Asked again under the lock: another worker may install.
    apt_install.install(_missing_packages, error=NetBedError)
  probe = f"tfdist-{os.getpid()}-probe"
  proc = _ip("netns", "add", probe, check=False)
  if proc.returncode != 0:
    _reason = (f"this machine refuses network namespaces "
               f"(ip netns add: {proc.stderr.strip()})")
    return _reason
  _ip("netns", "del", probe, check=False)
  _reason = None
  return None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _namespaces() -> list[str]:
  proc = _ip("netns", "list", check=False)
  return [line.split()[0] for line in proc.stdout.splitlines() if line.split()]


def _remove_namespace(name: str) -> None:
  """Kills what lives in the marked namespace ``name``, then deletes it."""
  pids = _ip("netns", "pids", name, check=False).stdout.split()
  for pid in pids:
    try:
      os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass
  deadline = time.monotonic() + 10
  while _ip("netns", "pids", name, check=False).stdout.split():
    if time.monotonic() > deadline:
      break
    time.sleep(0.1)
  _ip("netns", "del", name, check=False)


def sweep_leftovers() -> list[str]:
  """Removes marked namespaces of processes that no longer run; their names.

  Namespaces of live processes (another bed running now) and unmarked ones
  are left alone.
  """
  removed = []
  for name in _namespaces():
    match = _MARK.match(name)
    if match and not _alive(int(match.group(1))):
      _remove_namespace(name)
      removed.append(name)
  return removed


class NetBed:
  """Hosts as network namespaces on a private switch, owned by this process.

  Attributes:
    hosts: the host names, in address order.
    rate: the ``tc tbf`` rate of each host's link (e.g. ``"1gbit"``), or
      ``None`` for an unshaped link.
    resolvable: whether each host's hosts file names the other hosts; when
      False a host resolves only itself (a cluster whose node names do not
      resolve).
  """

  def __init__(self, *, hosts: Sequence[str], rate: str | None = None,
               resolvable: bool = True):
    if not hosts or len(set(hosts)) != len(hosts) or len(hosts) > 200:
      raise ValueError(f"hosts: expected 1-200 distinct names, got {hosts!r}")
    self.hosts = tuple(hosts)
    self.rate = rate
    self.resolvable = resolvable
    self._mark = f"tfdist-{os.getpid()}-"
    self._made: list[str] = []
    self._procs: list[subprocess.Popen] = []
    self._dir: str | None = None

  def __enter__(self) -> "NetBed":
    self.start()
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def namespace(self, host: str) -> str:
    """The network namespace of ``host`` (``/run/netns/<name>``)."""
    return self._mark + host

  def address(self, host: str) -> str:
    """``host``'s address on the switch."""
    return f"198.18.0.{_FIRST_HOST + self.hosts.index(host)}"

  def hosts_file(self, host: str) -> str:
    """The file bind-mounted over ``/etc/hosts`` in ``host``."""
    return os.path.join(self._dir, f"hosts.{host}")

  def start(self) -> None:
    """Creates the switch and the hosts.

    Raises:
      NetBedError: the bed is unavailable here or a step failed; whatever was
        made is removed.
    """
    reason = netbed_unavailable_reason()
    if reason is not None:
      raise NetBedError(reason)
    sweep_leftovers()
    atexit.register(self.close)
    self._dir = tempfile.mkdtemp(prefix="tfdist-netbed-")
    try:
      switch = self._add("switch")
      _ip("-n", switch, "link", "add", "br0", "type", "bridge")
      _ip("-n", switch, "link", "set", "br0", "up")
      for i, host in enumerate(self.hosts):
        ns = self._add(host)
        _ip("-n", switch, "link", "add", f"v{i}", "type", "veth", "peer",
            "name", "eth0", "netns", ns)
        _ip("-n", switch, "link", "set", f"v{i}", "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        if self.rate:
          self._shape(ns)
        with open(self.hosts_file(host), "w") as f:
          f.write(self._hosts_text(host))
    except BaseException:
      self.close()
      raise

  def _add(self, name: str) -> str:
    ns = self.namespace(name)
    _ip("netns", "add", ns)
    self._made.append(ns)
    _ip("-n", ns, "link", "set", "lo", "up")
    return ns

  def _shape(self, ns: str) -> None:
    bits = _bits_per_second(self.rate)
    burst = max(64 * 1024, bits // 8 // 250)  # A 4 ms bucket.
    proc = subprocess.run(
        ["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf",
         "rate", self.rate, "burst", str(burst), "latency", "50ms"],
        capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S,
        check=False)
    if proc.returncode != 0:
      raise NetBedError(f"tc tbf {self.rate} failed: {proc.stderr.strip()}")

  def _hosts_text(self, host: str) -> str:
    known = self.hosts if self.resolvable else (host,)
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    lines += [f"{self.address(h)} {h}" for h in known]
    return "\n".join(lines) + "\n"

  def cut(self, host: str) -> None:
    """Takes ``host``'s link to the switch down: its peers hear nothing
    more from it, and it from them."""
    _ip("-n", self.namespace("switch"), "link", "set",
        f"v{self.hosts.index(host)}", "down")

  def command(self, host: str, argv: Sequence[str]) -> list[str]:
    """``argv`` as run inside ``host``."""
    if host not in self.hosts:
      raise ValueError(f"host: expected one of {self.hosts}, got {host!r}")
    return ["nsenter", f"--net=/run/netns/{self.namespace(host)}",
            "unshare", "--uts", "--mount", "sh", "-c", _ENTER, host,
            self.hosts_file(host), *argv]

  def popen(self, host: str, argv: Sequence[str], *,
            env: Mapping[str, str] | None = None,
            **kwargs) -> subprocess.Popen:
    """Starts ``argv`` inside ``host``; the PID is the command's own (each
    step execs the next). It is killed on `close` if still running."""
    proc = subprocess.Popen(self.command(host, argv),
                            env=None if env is None else dict(env), **kwargs)
    self._procs.append(proc)
    return proc

  def run(self, host: str, argv: Sequence[str], *, timeout: float,
          env: Mapping[str, str] | None = None,
          check: bool = False) -> subprocess.CompletedProcess:
    """Runs ``argv`` inside ``host`` to its end (text output), bounded."""
    proc = subprocess.run(self.command(host, argv), capture_output=True,
                          text=True, timeout=timeout, check=False,
                          env=None if env is None else dict(env))
    if check and proc.returncode != 0:
      raise NetBedError(f"{list(argv)} on {host} exited {proc.returncode}: "
                        f"{proc.stderr[-2000:]}")
    return proc

  def close(self) -> None:
    """Kills the processes started in the bed and removes every namespace
    and file it made. Safe to call twice."""
    for proc in self._procs:
      if proc.poll() is None:
        proc.kill()
        try:
          proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
          pass
    self._procs = []
    for ns in reversed(self._made):
      _remove_namespace(ns)
    self._made = []
    if self._dir:
      shutil.rmtree(self._dir, ignore_errors=True)
      self._dir = None


def _bits_per_second(rate: str) -> int:
  match = re.fullmatch(r"(\d+)([kmg]?)bit", rate.lower())
  if not match:
    raise ValueError(f"rate: expected e.g. '1gbit' or '10gbit', got {rate!r}")
  return int(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6,
                                "g": 10**9}[match.group(2)]
