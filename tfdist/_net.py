"""Ports, addresses and child environments: one place for the network.

The launcher, the bench, the start-up bound and the tests pick ports, test
reachability, decide whether a host is this machine and build child
environments here, one way. Nothing here imports TensorFlow or other tfdist
modules.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import threading
import time
from typing import Mapping

__all__ = ["JOB_SECRET_VARIABLE", "job_secret", "family", "free_ports",
           "port_problem", "lookup", "LOOKUP_TIMEOUT_SECONDS", "reachable",
           "grpc_answers", "is_local", "is_loopback", "split_address",
           "child_env", "cluster_tf_configs", "worker_tf_configs", "REPO_ROOT"]

#: The directory holding the ``tfdist`` package (a checkout or site-packages).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: The bound on one host name lookup (a resolver that does not answer).
LOOKUP_TIMEOUT_SECONDS = 5.0

#: The environment variable that carries a job's shared secret to its tasks.
#: An environment variable, not an argument, so it never shows in ``ps``.
JOB_SECRET_VARIABLE = "TFDIST_JOB_SECRET"


def job_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
  """The job's shared secret from `JOB_SECRET_VARIABLE`, or ``None``."""
  value = (os.environ if environ is None else environ).get(JOB_SECRET_VARIABLE)
  return value.encode() if value else None


def family(host: str) -> socket.AddressFamily:
  """The socket family of an address: IPv6 if it has a colon (brackets or
  not), else IPv4."""
  return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
  """``n`` distinct ports free on ``host`` a moment ago.

  The sockets are held open together so the ports differ; another process
  can still take one before it is used, which callers report clearly.
  """
  socks = []
  try:
    for _ in range(n):
      s = socket.socket(family(host))
      s.bind((host, 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def port_problem(host: str, port: int) -> str | None:
  """Why a TensorFlow server could not listen on ``port`` now, or ``None``.

  TensorFlow's gRPC server listens on every interface (``[::]``, else
  ``0.0.0.0``) with ``SO_REUSEADDR`` and ``SO_REUSEPORT``, whatever host its
  TF_CONFIG names. So the check binds the wildcard address the same way: a
  port left in TIME_WAIT by an earlier run (a requeue, a re-run within a
  minute) is free, and a port that any process listens on, on any address, is
  taken, also when that process set ``SO_REUSEPORT`` as gRPC does (read from
  ``/proc/net/tcp*``, where the kernel would let a second gRPC server share it).

  Args:
    host: the address the task is reached at; with ``port`` 0 the question
      is whether ``host`` is an address of this machine at all.
    port: the port, or 0.

  Returns:
    A sentence saying why, or ``None``.
  """
  if not port:
    with socket.socket(family(host), socket.SOCK_STREAM) as s:
      try:
        s.bind((host, 0))
      except OSError as e:
        return e.strerror or str(e)
    return None
  if port in _listening_ports():
    return f"another process listens on port {port}"
  for any_address in ("::", "0.0.0.0"):
    try:
      s = socket.socket(family(any_address), socket.SOCK_STREAM)
    except OSError:
      continue  # No IPv6 here: TensorFlow falls back to IPv4 too.
    with s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind((any_address, port))
        return None
      except OSError as e:
        if e.errno == errno.EADDRINUSE:
          return f"port {port} is in use"
        if any_address == "::":
          continue
        return e.strerror or str(e)
  return None


def _listening_ports() -> set[int]:
  """Ports some socket of this network namespace listens on (TCP), from
  ``/proc/net/tcp`` and ``tcp6``; empty where they do not exist."""
  ports = set()
  for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
      with open(name) as f:
        next(f, None)
        for line in f:
          fields = line.split()
          if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN.
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    except OSError:
      continue
  return ports


def lookup(host: str, timeout: float = LOOKUP_TIMEOUT_SECONDS
           ) -> tuple[list[str], str | None]:
  """``(addresses, None)``, or ``([], why)`` when ``host`` does not resolve
  within ``timeout`` seconds."""
  try:
    return [str(ipaddress.ip_address(host))], None
  except ValueError:
    pass
  result: dict = {}

  def work() -> None:
    try:
      infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
      result["addresses"] = sorted({i[4][0] for i in infos})
    except (OSError, UnicodeError) as e:
      result["error"] = (f"{e.strerror} (getaddrinfo)"
                         if getattr(e, "strerror", None) else str(e))

  thread = threading.Thread(target=work, daemon=True, name="tfdist-lookup")
  thread.start()
  thread.join(timeout)
  if "addresses" in result and result["addresses"]:
    return result["addresses"], None
  return [], result.get("error", f"no answer within {timeout:g} s")


def split_address(address: str) -> tuple[str, int]:
  """``host:port`` (IPv6 hosts in brackets) as ``(host, port)``, unbracketed.

  Raises:
    ValueError: no port, or a port that is not a number.
  """
  host, port = address.rsplit(":", 1)
  return host.strip("[]"), int(port)


def reachable(address: str, timeout: float = 1.0) -> bool:
  """Whether a TCP connection to ``host:port`` opens within ``timeout`` s."""
  try:
    with socket.create_connection(split_address(address), timeout=timeout):
      return True
  except (OSError, ValueError):
    return False


# HTTP/2's client preface and an empty SETTINGS frame: what a gRPC client
# sends first. A gRPC server answers with its own SETTINGS frame at once.
_H2_PREFACE = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
               + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
_H2_SETTINGS = 4  # The frame type, byte 3 of a frame header.


def grpc_answers(address: str, timeout: float = 1.0) -> bool:
  """Whether a gRPC (HTTP/2) server answers at ``host:port`` within ``timeout``.

  Stricter than `reachable`: a listening socket nobody serves (one a dead
  process's child inherited) accepts connections but never answers, and a
  probe of a free loopback port can connect to itself (TCP simultaneous
  open), which echoes the probe's own bytes; neither counts.
  """
  deadline = time.monotonic() + timeout
  try:
    with socket.create_connection(split_address(address),
                                  timeout=timeout) as conn:
      if conn.getsockname() == conn.getpeername():
        return False  # Connected to itself.
      conn.sendall(_H2_PREFACE)
      header = b""
      while len(header) < 9:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        part = conn.recv(9 - len(header))
        if not part:
          return False
        header += part
      return header[3] == _H2_SETTINGS
  except (OSError, ValueError):
    return False


def is_loopback(host: str) -> bool:
  """Whether ``host`` is ``localhost`` or a loopback address."""
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return host == "localhost"


def host_addresses() -> list[str]:
  """This machine's addresses other than loopback and IPv6 link-local:
  where a server listening on every interface can be reached from.

  Read from Linux's ``/proc/net/fib_trie`` and ``/proc/net/if_inet6``;
  elsewhere, what the host's name resolves to.
  """
  found: list[str] = []
  try:
    with open("/proc/net/fib_trie", encoding="ascii") as f:
      last = None
      for line in f:
        parts = line.split()
        if parts[:1] == ["|--"]:
          last = parts[1]
        elif parts[-2:] == ["host", "LOCAL"] and last:
          found.append(last)
    with open("/proc/net/if_inet6", encoding="ascii") as f:
      for line in f:
        address, _, _, scope, *_ = line.split()
        if scope == "00":  # Global; 20 is link-local, 10 loopback.
          found.append(str(ipaddress.IPv6Address(int(address, 16))))
  except OSError:
    found = list(lookup(socket.gethostname())[0])
  return sorted({a for a in found if not is_loopback(a)})


def is_local(host: str) -> bool:
  """Whether ``host`` names this machine.

  True for loopback, this host's short name and FQDN (in any case), and any
  name or address that resolves to an address of this machine: one a socket
  can bind to. A name that does not resolve within a few seconds is not local.
  """
  host = host.strip("[]")
  if is_loopback(host):
    return True
  names = {socket.gethostname().lower(), socket.getfqdn().lower()}
  if host.rstrip(".").lower() in names:
    return True
  addresses, _ = lookup(host)
  for address in addresses:
    with socket.socket(family(address), socket.SOCK_DGRAM) as s:
      try:
        s.bind((address, 0))
        return True
      except OSError:
        continue
  return False


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
  """This process's environment without cluster variables, tfdist importable.

  TF_CONFIG and SLURM variables are dropped so a child resolves only the
  cluster it is given; ``extra`` is applied last.
  """
  env = {k: v for k, v in os.environ.items()
         if k != "TF_CONFIG" and not k.startswith(("SLURM_", "SLURMD_"))}
  env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONUNBUFFERED"] = "1"
  env.update(extra or {})
  return env


def cluster_tf_configs(jobs: Mapping[str, int], *, host: str = "127.0.0.1",
                       port_base: int | None = None) -> list[dict]:
  """One TF_CONFIG per task of a cluster on ``host``, in ``jobs`` order.

  Args:
    jobs: job name to task count, e.g. ``{"chief": 1, "worker": 2, "ps": 1}``;
      jobs with no tasks are left out.
    host: the address every task listens on (IPv6 without brackets).
    port_base: consecutive ports from this one; free ports when ``None``.

  Returns:
    ``{"cluster": ..., "task": {"type": job, "index": i}}`` dicts, one per
    task, jobs in ``jobs`` order.
  """
  jobs = {job: count for job, count in jobs.items() if count}
  n = sum(jobs.values())
  ports = iter(range(port_base, port_base + n) if port_base is not None
               else free_ports(n, host))
  where = f"[{host}]" if ":" in host else host
  cluster = {job: [f"{where}:{next(ports)}" for _ in range(count)]
             for job, count in jobs.items()}
  return [{"cluster": cluster, "task": {"type": job, "index": i}}
          for job, count in jobs.items() for i in range(count)]


def worker_tf_configs(n: int, host: str = "127.0.0.1") -> list[str]:
  """TF_CONFIG texts of an ``n``-worker cluster on free ports, by task."""
  return [json.dumps(c) for c in cluster_tf_configs({"worker": n}, host=host)]
