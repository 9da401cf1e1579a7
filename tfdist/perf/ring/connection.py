"""Joining a ring: who its members are, listening, and the hello exchange.

Every process listens on a port the operating system picks (port 0),
publishes it under ``key/rank`` through a `Rendezvous`, connects to its
right neighbour and accepts its left one; a hello (`tfdist.perf.ring.wire`:
magic, ring token, rank, size) goes each way and is checked. A stray
connection is dropped and waited past. Every wait is bounded by one
deadline; a neighbour that misses it is named in a `StartupTimeoutError`.

Example::

  members = Members(rank=0, hosts=("10.0.0.1", "10.0.0.2"),
                    names=("worker:0", "worker:1"), source="my cluster")
  deadline = time.monotonic() + 300
  listener = listen(members)
  left, right = handshake(listener, members, rendezvous=rendezvous,
                          key="job-1/ring-0", deadline=deadline,
                          timeout_s=300)
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Protocol

from tfdist import _net
from tfdist.errors import ConfigError
from tfdist.errors import StartupTimeoutError
from tfdist.perf.ring import wire

__all__ = ["Rendezvous", "Members", "listen", "handshake"]


class Rendezvous(Protocol):
  """Where ring members publish their listening ports and find each other's."""

  def publish(self, key: str, value: str) -> None:
    """Makes ``value`` visible to every member under ``key``."""

  def lookup(self, key: str, timeout_s: float) -> str:
    """The value under ``key``, waiting at most ``timeout_s`` for it.

    Raises:
      TimeoutError: nobody published ``key`` in time.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class Members:
  """The processes of a ring, by rank, and this process's place among them.

  Attributes:
    rank: this process's position, 0 to ``len(hosts) - 1``.
    hosts: every member's host name or address, by rank.
    names: how errors name each member (e.g. ``"worker:1"``), by rank.
    source: where the hosts came from, for error messages.

  Raises:
    ConfigError: a rank out of range, or no hosts.
  """
  rank: int
  hosts: tuple[str, ...]
  names: tuple[str, ...]
  source: str

  def __post_init__(self):
    if not self.hosts or not 0 <= self.rank < len(self.hosts):
      raise ConfigError(field="rank", value=self.rank, source=self.source,
                        expected=f"0 to {len(self.hosts) - 1}, one per host")

  @property
  def size(self) -> int:
    return len(self.hosts)

  @property
  def left(self) -> int:
    """The rank this process receives from."""
    return (self.rank - 1) % self.size

  @property
  def right(self) -> int:
    """The rank this process sends to."""
    return (self.rank + 1) % self.size

  @property
  def me(self) -> str:
    """This process's name."""
    return self.names[self.rank]

  def describe(self, rank: int) -> str:
    """``rank``'s name and host, e.g. ``worker:1 (10.0.0.2)``."""
    return f"{self.names[rank]} ({self.hosts[rank]})"


def _bad_host(members: Members, rank: int, error: Exception) -> ConfigError:
  return ConfigError(
      field=f"address of {members.names[rank]}", value=members.hosts[rank],
      source=members.source, expected="a host name this process can resolve",
      hint=f"Fix the cluster's addresses ({error})")


def listen(members: Members) -> socket.socket:
  """A listening socket for this process, on a port the OS picks.

  Raises:
    ConfigError: this process's loopback host does not resolve.
  """
  host = members.hosts[members.rank]
  # A loopback cluster listens on loopback only; otherwise on every
  # interface, as TensorFlow's gRPC server does, since the name peers use
  # may not be an address of this host's own interfaces (NAT, containers).
  if _net.is_loopback(host):
    try:
      infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
      raise _bad_host(members, members.rank, e) from None
    family, _, _, _, address = infos[0]
    return socket.create_server(address, family=family, backlog=8)
  if socket.has_dualstack_ipv6():
    return socket.create_server(("", 0), family=socket.AF_INET6,
                                dualstack_ipv6=True, backlog=8)
  return socket.create_server(("", 0), backlog=8)


def handshake(listener: socket.socket, members: Members, *,
              rendezvous: Rendezvous, key: str, deadline: float,
              timeout_s: float) -> tuple[socket.socket, socket.socket]:
  """Publishes ``listener``'s port and connects both neighbours.

  Closes ``listener`` in any case, and the neighbours' sockets on failure.

  Args:
    listener: this process's `listen` socket.
    members: the ring.
    rendezvous: where ports are published and looked up.
    key: the ring's prefix in ``rendezvous``; also its hello token.
    deadline: `time.monotonic` time by which both neighbours must be in.
    timeout_s: the bound ``deadline`` stands for, for error messages.

  Returns:
    ``(left, right)``: the blocking sockets from the left neighbour and to
    the right one.

  Raises:
    StartupTimeoutError: a neighbour did not publish its port, accept,
      connect or answer by ``deadline``.
    ConfigError: a neighbour's host that does not resolve.
  """
  join = _Join(members=members, rendezvous=rendezvous, key=key,
               deadline=deadline, timeout_s=timeout_s)
  right = left = None
  try:
    port = listener.getsockname()[1]
    rendezvous.publish(f"{key}/{members.rank}", str(port))
    right = join.dial(members.right)
    left = join.accept(listener, members.left)
    # The right neighbour's answer: it accepted this connection as ours.
    if join.read_hello(right, join.remaining(
        members.right, "answer")) != join.hello(members.right):
      raise join.late(members.right, "answer this worker's hello")
  except BaseException:
    for s in (right, left):
      if s is not None:
        s.close()
    raise
  finally:
    listener.close()
  return left, right


class _Join:
  """One `handshake`'s steps, all bounded by its deadline."""

  def __init__(self, *, members: Members, rendezvous: Rendezvous, key: str,
               deadline: float, timeout_s: float):
    self._members = members
    self._rendezvous = rendezvous
    self._key = key
    self._token = wire.ring_token(key)
    self._deadline = deadline
    self._timeout_s = timeout_s

  def late(self, rank: int, what: str) -> StartupTimeoutError:
    return StartupTimeoutError(
        f"socket transport: {self._members.me} waited "
        f"{self._timeout_s:.0f} s for {self._members.describe(rank)} to "
        f"{what}; is that worker running and at the same step, and can "
        "this host reach it on TCP ports the OS picks?")

  def remaining(self, rank: int, what: str) -> float:
    """Seconds to the deadline; raises `late` past it."""
    left = self._deadline - time.monotonic()
    if left <= 0:
      raise self.late(rank, what)
    return left

  def hello(self, rank: int) -> bytes:
    return wire.hello(self._token, rank, self._members.size)

  def dial(self, rank: int) -> socket.socket:
    """Connects to ``rank`` (the right neighbour) and sends the hello."""
    what = "publish its port"
    try:
      port = int(self._rendezvous.lookup(f"{self._key}/{rank}",
                                         self.remaining(rank, what)))
    except TimeoutError:
      raise self.late(rank, what) from None
    while True:
      left = self.remaining(rank, f"accept a connection on port {port}")
      try:
        conn = socket.create_connection((self._members.hosts[rank], port),
                                        timeout=min(left, 10.0))
      except socket.gaierror as e:
        raise _bad_host(self._members, rank, e) from None
      except OSError:  # Refused or unreachable for now: retry until the end.
        time.sleep(min(0.2, max(0.0, self._deadline - time.monotonic())))
        continue
      try:
        conn.sendall(self.hello(self._members.rank))
      except OSError:
        conn.close()
        continue
      return conn

  def read_hello(self, conn: socket.socket, timeout_s: float) -> bytes:
    """Up to a hello's bytes from ``conn``; fewer when it ends or stalls."""
    conn.settimeout(max(0.01, min(timeout_s, 10.0)))
    data = b""
    try:
      while len(data) < wire.HELLO_SIZE:
        chunk = conn.recv(wire.HELLO_SIZE - len(data))
        if not chunk:
          break
        data += chunk
    except OSError:
      pass
    return data

  def accept(self, listener: socket.socket, rank: int) -> socket.socket:
    """Accepts ``rank`` (the left neighbour), checks its hello, answers."""
    while True:
      left = self.remaining(rank, "connect to this worker")
      listener.settimeout(left)
      try:
        conn, _ = listener.accept()
      except socket.timeout:
        continue  # remaining() raises on the next turn.
      if self.read_hello(conn, left) == self.hello(rank):
        try:
          conn.sendall(self.hello(self._members.rank))
          return conn
        except OSError:
          pass
      conn.close()  # Not our neighbour (a stale or stray connection).
