"""Joining a ring: who its members are, listening, and the hello exchange.

Every process listens on its own cluster address (on every interface only
when that address is not one of this host's, and it logs so), on a port the
operating system picks or the first free one of a range
(``ports``, or `RING_PORTS_VARIABLE`), publishes it under ``key/rank``
through a `Rendezvous`, connects to its right neighbour and accepts its left
one, through the job's one gate (`tfdist._secret.Gate`): each hello carries
the ring's token, both ranks and a fresh nonce, and only holders of the
job's secret join.

One loop over non-blocking sockets serves the dial and every incoming
connection at once: a stranger (a scanner, random bytes, a half or replayed
hello, a wrong secret, a flood of connections) is dropped without holding up
the real neighbour, within the gate's limits. Every wait is bounded by one
deadline; a neighbour that misses it is named in a `StartupTimeoutError`,
with why connections were dropped meanwhile.

Example::

  members = Members(rank=0, hosts=("10.0.0.1", "10.0.0.2"),
                    names=("worker:0", "worker:1"), source="my cluster")
  deadline = time.monotonic() + 300
  listener = listen(members)
  pair = handshake(listener, members, rendezvous=rendezvous,
                   key="job-1/ring-0", deadline=deadline, timeout_s=300,
                   secret=b"the job's secret")
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import re
import socket
import time
from typing import Mapping, Protocol

from absl import logging

from tfdist import _net
from tfdist import _secret
from tfdist.errors import ConfigError
from tfdist.errors import StartupTimeoutError
from tfdist.ring import wire

__all__ = ["RING_PORTS_VARIABLE", "Rendezvous", "Members", "Neighbours",
           "ring_ports", "listen", "handshake"]

#: The environment variable giving the ports rings may listen on, e.g.
#: ``20000-20100`` (any port the OS picks when unset).
RING_PORTS_VARIABLE = "TFDIST_RING_PORTS"

_RETRY_S = 0.2  # Between dials of a neighbour that refused or dropped one.
_TICK_S = 0.2  # Longest wait in select() and in one rendezvous lookup.


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


def ring_ports(ports: str | None, *, source: str,
               environ: Mapping[str, str] | None = None) -> range | None:
  """The ports a ring may listen on: ``ports``, else `RING_PORTS_VARIABLE`.

  Args:
    ports: ``"FIRST-LAST"`` or one port; ``None`` reads the environment.
    source: where ``ports`` came from, for error messages.
    environ: the environment (``os.environ`` when omitted).

  Returns:
    The ports, or ``None`` for any port the OS picks.

  Raises:
    ConfigError: a malformed range, or ports outside 1-65535.
  """
  field = "ports"
  if ports is None:
    ports = (os.environ if environ is None else environ).get(
        RING_PORTS_VARIABLE)
    field = RING_PORTS_VARIABLE
    source = f"the {RING_PORTS_VARIABLE} environment variable"
    if not ports:
      return None
  match = re.fullmatch(r"\s*(\d{1,5})\s*(?:-\s*(\d{1,5})\s*)?",
                       ports if isinstance(ports, str) else "")
  first = int(match[1]) if match else 0
  last = int(match[2] or first) if match else 0
  if not 1 <= first <= last <= 65535:
    raise ConfigError(field=field, value=ports, source=source,
                      expected="a port or a range FIRST-LAST within 1-65535, "
                               "e.g. 20000-20100")
  return range(first, last + 1)


def _bind(family: int, address: tuple, ports: range | None, *,
          dualstack: bool = False) -> socket.socket:
  """A listener on the first port of ``ports`` free at ``address``.

  ``dualstack``: an IPv6 listener that takes IPv4 connections too.

  Raises:
    OSError: the last port's error (EADDRNOTAVAIL at once: not this host's).
  """
  error = OSError(errno.EADDRINUSE, "no port to try")
  for port in ports or (0,):
    try:
      return socket.create_server((address[0], port) + tuple(address[2:]),
                                  family=family, backlog=_secret.MAX_UNPROVEN,
                                  dualstack_ipv6=dualstack)
    except OSError as e:
      if e.errno == errno.EADDRNOTAVAIL:
        raise
      error = e
  raise error


def listen(members: Members, *, ports: range | None = None,
           ports_source: str = "SocketRing") -> socket.socket:
  """A listening socket on this process's own address, on one of ``ports``.

  The address is this process's host in ``members``. When that is not an
  address of this host's interfaces (NAT, containers), or a non-loopback
  name resolving to loopback here (Debian maps the host's own name to
  127.0.1.1), it listens on every interface instead, and logs so.

  Args:
    members: the ring.
    ports: the ports to try in order; any port the OS picks when ``None``.
    ports_source: where ``ports`` came from, for error messages.

  Raises:
    ConfigError: this process's host does not resolve, or no port of
      ``ports`` is free.
  """
  host = members.hosts[members.rank]
  try:
    family, _, _, _, address = socket.getaddrinfo(
        host, 0, type=socket.SOCK_STREAM)[0]
  except socket.gaierror as e:
    raise _bad_host(members, members.rank, e) from None
  try:
    try:
      if _net.is_loopback(address[0]) and not _net.is_loopback(host):
        raise OSError(errno.EADDRNOTAVAIL, f"{host} resolves to "
                      f"{address[0]} here, which its peers cannot reach")
      return _bind(family, address, ports)
    except OSError as e:
      if e.errno != errno.EADDRNOTAVAIL:
        raise
      why = e
    logging.warning(
        "socket transport: %s's address %s is not one of this host's (%s); "
        "its ring listens on every interface", members.me, host, why)
    if socket.has_dualstack_ipv6():
      return _bind(socket.AF_INET6, ("", 0), ports, dualstack=True)
    return _bind(socket.AF_INET, ("", 0), ports)
  except OSError as e:
    if ports is None:
      raise
    raise ConfigError(
        field="ports", value=f"{ports.start}-{ports.stop - 1}",
        source=ports_source, expected=f"a range with a free port on {host}",
        hint=f"Every port is taken or refused ({e}); widen the range or "
             "free a port") from None


@dataclasses.dataclass(frozen=True)
class Neighbours:
  """A joined ring's two connections and their keys (`tfdist._secret`).

  Attributes:
    left: the blocking socket from the left neighbour.
    right: the blocking socket to the right neighbour.
    left_key: the key of ``left``'s values.
    right_key: the key of ``right``'s values.
  """
  left: socket.socket
  right: socket.socket
  left_key: bytes
  right_key: bytes


def handshake(listener: socket.socket, members: Members, *,
              rendezvous: Rendezvous, key: str, deadline: float,
              timeout_s: float, secret: bytes | None = None) -> Neighbours:
  """Publishes ``listener``'s port and connects both neighbours.

  Closes ``listener`` and every connection it does not return, in any case.

  Args:
    listener: this process's `listen` socket.
    members: the ring.
    rendezvous: where ports are published and looked up.
    key: the ring's prefix in ``rendezvous``; also in its hellos.
    deadline: `time.monotonic` time by which both neighbours must be in.
    timeout_s: the bound ``deadline`` stands for, for error messages.
    secret: the job's secret; ``None`` joins unauthenticated.

  Returns:
    Both neighbours' connections, each proven to hold ``secret``.

  Raises:
    StartupTimeoutError: a neighbour did not publish its port, accept,
      connect or prove its secret by ``deadline``; says why connections
      were dropped meanwhile.
    ConfigError: a neighbour's host that does not resolve.
  """
  join = _Join(members=members, rendezvous=rendezvous, key=key,
               deadline=deadline, timeout_s=timeout_s, secret=secret)
  try:
    return join.run(listener)
  finally:
    join.close()
    listener.close()


class _Join:
  """One `handshake`: `tfdist._secret.Gate`'s loop and this ring's dial,
  bounded by one deadline."""

  def __init__(self, *, members: Members, rendezvous: Rendezvous, key: str,
               deadline: float, timeout_s: float, secret: bytes | None):
    self._members = members
    self._rendezvous = rendezvous
    self._key = key
    self._token = wire.ring_token(key)
    self._deadline = deadline
    self._timeout_s = timeout_s
    self._signed = secret is not None
    self._terms = _secret.Terms(secret=secret or b"", context=key,
                                hello_size=wire.HELLO_SIZE, hello=self._hello,
                                foreign=self._foreign)
    self._gate: _secret.Gate | None = None
    self._dropped: collections.Counter[str] = collections.Counter()
    self._port: int | None = None
    self._address: tuple | None = None
    self._next_dial = 0.0
    self._left: tuple[socket.socket, bytes] | None = None
    self._right: tuple[socket.socket, bytes] | None = None

  def run(self, listener: socket.socket) -> Neighbours:
    members = self._members
    self._gate = gate = _secret.Gate(self._terms, listener=listener,
                                     dropped=self._drop)
    self._rendezvous.publish(f"{self._key}/{members.rank}",
                             str(listener.getsockname()[1]))
    while self._left is None or self._right is None:
      now = time.monotonic()
      if now >= self._deadline:
        raise self._late()
      wait = min(_TICK_S, self._deadline - now)
      if self._right is None and not gate.dialing:
        if self._port is None:
          self._find_port(wait)
          wait = 0.0
        elif now >= self._next_dial:
          gate.dial(*self._address, members.describe(members.right))
        else:
          wait = min(wait, self._next_dial - now)
      for proven in gate.poll(wait):
        pair = (proven.sock, proven.key)
        if proven.dialed:
          self._right = pair
        elif self._left is None:
          self._left = pair
        else:
          proven.sock.close()  # A second proven left: keep the first.
    (left, left_key), (right, right_key) = self._left, self._right
    return Neighbours(left=left, right=right, left_key=left_key,
                      right_key=right_key)

  def close(self) -> None:
    """Closes every connection not handed out (all of them on failure)."""
    if self._gate is not None:
      self._gate.close()
    if self._left is None or self._right is None:
      for pair in (self._left, self._right):
        if pair is not None:
          pair[0].close()

  def _late(self) -> StartupTimeoutError:
    members = self._members
    if self._right is None:
      rank = members.right
      what = ("publish its port" if self._port is None else
              f"accept a connection on port {self._port} and prove the "
              "job's secret")
    else:
      rank, what = members.left, "connect to this worker"
    dropped = "; ".join(f"{n} x {why}" for why, n in self._dropped.items())
    return StartupTimeoutError(
        f"socket transport: {members.me} waited {self._timeout_s:.0f} s for "
        f"{members.describe(rank)} to {what}; is that worker running and at "
        "the same step, with the same job secret, and can this host reach it "
        f"over TCP (a firewall: open a range and set {RING_PORTS_VARIABLE}, "
        "or have every worker use TensorFlow's collectives, as the chief's "
        "first line 'tfdist: gradients cross by the socket ring' says how)?"
        + (f" Dropped meanwhile: {dropped}." if dropped else ""))

  def _drop(self, hello: _secret.Hello | None, why: str) -> None:
    """Counts why a connection was dropped; a dial is tried again soon."""
    if hello is None:
      self._dropped[why] += 1
      return
    who = hello.peer if hello.dialed else f"a connection from {hello.peer}"
    self._dropped[f"{who} {why}"] += 1
    if hello.dialed:
      self._next_dial = time.monotonic() + _RETRY_S

  def _find_port(self, wait: float) -> None:
    rank = self._members.right
    try:
      port = int(self._rendezvous.lookup(f"{self._key}/{rank}", wait))
    except TimeoutError:
      return
    try:
      info = socket.getaddrinfo(self._members.hosts[rank], port,
                                type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
      raise _bad_host(self._members, rank, e) from None
    self._port, self._address = port, (info[0], info[4])

  def _hello(self) -> bytes:
    return wire.hello(self._token, self._members.rank, self._members.size,
                      nonce=_secret.nonce(), signed=self._signed)

  def _foreign(self, hello: bytes, dialed: bool) -> str | None:
    """Why ``hello`` is not its neighbour's of this ring, or ``None``."""
    members = self._members
    rank = members.right if dialed else members.left
    fields = wire.parse_hello(hello)
    if (fields is None or fields.token != self._token
        or fields.size != members.size or fields.rank != rank):
      return (f"sent a hello that is not {members.names[rank]}'s of this "
              "ring (another program, or another ring)")
    if fields.signed != self._signed:
      has = "has a" if fields.signed else "has no"
      mine = "has none" if fields.signed else "has one"
      return (f"{has} job secret and this worker {mine}: set "
              f"{_net.JOB_SECRET_VARIABLE} alike on every worker")
    return None
