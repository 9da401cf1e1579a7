"""The multi-node rendezvous: node 0 hands every node its part of one cluster.

``tfdist launch --nnodes N`` runs one launcher per node. Node 0's launcher
also runs a `Master` on ``--master-addr:--master-port`` (it listens on that
address only); every launcher, node 0's included, joins it as a `Member`:

1. **Proof of membership.** The member dials, sends a fresh nonce ``D``; the
   master answers with its own nonce ``A`` and ``mac(secret, ACCEPT, D, A)``;
   the member checks it and sends ``mac(secret, DIAL, D, A)``
   (`tfdist._secret`). Each side's proof covers the other's fresh nonce, so a
   recording does not pass twice. Every later message is length-prefixed
   JSON followed by an HMAC-SHA256 tag under the connection's own key
   (``mac(secret, VALUES, D, A)``) and the message's sequence number in its
   direction: a message that was altered, replayed, reordered or sent by
   anyone without the secret ends that connection. A connection that fails
   the proof is dropped and logged once; the job goes on. One thread runs
   every proof in flight (a selector, not a thread per connection), each
   under one deadline for its whole hello, proof and join message
   (`_HANDSHAKE_SECONDS`), at most `MAX_UNPROVEN` at once: a newcomer beyond
   that drops the oldest. An ``accept()`` that fails (no descriptors left)
   is tried again after a pause. So strangers, however many and however
   slow, hold no connection for long and cannot stop the master.
2. **Join.** Each member sends its node rank, the address the others should
   dial it at, and its tasks (chief, workers, ps, evaluator) with ports it
   picked free on its own host.
3. **Cluster.** Once all N joined (within ``timeout``), the master checks the
   whole cluster (one chief when there is a ps, at most one evaluator, a
   worker somewhere) and sends each node the cluster and its tasks' places;
   a layout that cannot work is sent to every node as an error instead.
4. **Watch.** Both sides send a heartbeat every `HEARTBEAT_SECONDS`; silence
   for `SILENCE_SECONDS`, or a closed connection, means the peer is lost. A
   member reports a failed task (``failed``) or that its training tasks
   finished (``done``); the master answers every node with ``stop`` (the
   exit code, and whether all nodes restart together) or, once every node
   with training tasks is done, ``finish``.

So from a failure anywhere to every node stopping its tasks takes at most
`SILENCE_SECONDS` plus one heartbeat (a launcher that hangs) and a few
milliseconds otherwise (a task that fails, a launcher that dies: its
connection closes at once); stopping then takes the launcher's
``grace_seconds``.

The secret (`tfdist._net.JOB_SECRET_VARIABLE` in the environment, or a file)
is never sent, and never appears on a command line. Every wait is bounded,
and a member's end once its ``stop`` event is set (by the launcher's signal
handler); every message is capped at `MAX_MESSAGE_BYTES`. No TensorFlow
here.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import queue
import resource
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Any, Mapping, Sequence

from tfdist import _secret

__all__ = ["Master", "Member", "RendezvousError", "layout_problem",
           "HEARTBEAT_SECONDS", "SILENCE_SECONDS", "MAX_MESSAGE_BYTES",
           "MAX_UNPROVEN"]

#: How often each side says it is alive.
HEARTBEAT_SECONDS = 1.0
#: Silence after which a peer counts as lost.
SILENCE_SECONDS = 10.0
#: The largest message accepted (a cluster of thousands of tasks fits).
MAX_MESSAGE_BYTES = 1 << 20
#: The bound on a whole proof of membership and join message.
_HANDSHAKE_SECONDS = 5.0
#: Connections the master holds before they prove the secret; a newcomer
#: beyond it drops the oldest. A member proves itself within a round trip of
#: being accepted, so it gets in unless more than this many strangers are
#: accepted in that time. At most a quarter of the open-file limit.
MAX_UNPROVEN = 512
#: Newcomers the master accepts between two rounds of the proofs in flight.
_ACCEPTS_PER_ROUND = 64
#: How long the master waits to accept again after ``accept()`` failed.
_ACCEPT_PAUSE_SECONDS = 0.1
#: How often every wait looks at its stop event (and the master at close).
_STEP_SECONDS = 0.2
_HELLO = b"TFDR"
#: How long a closing master waits for its members to say goodbye.
_CLOSE_SECONDS = 2.0
_CONTEXT = "tfdist-rendezvous"
_JOB_ORDER = ("chief", "worker", "ps")


class RendezvousError(Exception):
  """The rendezvous failed; ``str()`` is one line for the user.

  Attributes:
    code: the exit code the launcher should end with (2: a layout or input
      that cannot work; 1: a node lost or not joining).
  """

  def __init__(self, message: str, *, code: int = 1):
    super().__init__(message)
    self.code = code


class _Channel:
  """One authenticated connection: sealed, numbered messages both ways."""

  def __init__(self, sock: socket.socket, key: bytes, *, dialer: bool):
    self.sock = sock
    self._key = key
    # Each direction's tags carry its own label: one side's tag never
    # passes as the other's.
    self._labels = ((_secret.DIAL, _secret.ACCEPT) if dialer
                    else (_secret.ACCEPT, _secret.DIAL))
    self._sent = 0
    self._received = 0
    self._send_lock = threading.Lock()

  def send(self, message: Mapping[str, Any]) -> None:
    body = json.dumps(message).encode()
    with self._send_lock:
      tag = self._tag(self._labels[0], self._sent, body)
      self._sent += 1
      self.sock.sendall(struct.pack(">I", len(body)) + body + tag)

  def receive(self, timeout: float) -> dict:
    """The next message, whole within ``timeout`` s; raises ``OSError``
    (``TimeoutError`` when late) on a closed, silent or forged
    connection."""
    deadline = time.monotonic() + timeout
    size = struct.unpack(">I", _read(self.sock, 4, deadline))[0]
    if size > MAX_MESSAGE_BYTES:
      raise OSError(f"a message of {size} bytes (more than "
                    f"{MAX_MESSAGE_BYTES})")
    body = _read(self.sock, size, deadline)
    tag = _read(self.sock, _secret.MAC_SIZE, deadline)
    want = self._tag(self._labels[1], self._received, body)
    if not hmac.compare_digest(tag, want):
      raise OSError("a message failed its authentication (altered, replayed "
                    "or not sent by a member of this job)")
    self._received += 1
    message = json.loads(body)
    if not isinstance(message, dict) or "kind" not in message:
      raise OSError("a message without a kind")
    return message

  def _tag(self, direction: bytes, number: int, body: bytes) -> bytes:
    return _secret.mac(self._key, direction, _CONTEXT,
                       number.to_bytes(8, "big"), body)

  def close(self) -> None:
    try:
      self.sock.close()
    except OSError:
      pass


def _read(sock: socket.socket, n: int, deadline: float,
          stop: threading.Event | None = None) -> bytes:
  """``n`` bytes, all by monotonic ``deadline`` (not a timeout per byte);
  ``TimeoutError`` when late or once ``stop`` is set."""
  data = bytearray()
  while len(data) < n:
    left = deadline - time.monotonic()
    if left <= 0 or (stop is not None and stop.is_set()):
      raise TimeoutError(f"{len(data)} of {n} bytes in time")
    sock.settimeout(left if stop is None else min(left, _STEP_SECONDS))
    try:
      chunk = sock.recv(n - len(data))
    except TimeoutError:
      continue
    if not chunk:
      raise OSError("the connection closed")
    data += chunk
  return bytes(data)


class _Refused(OSError):
  """The master failed its proof: it does not hold this job's secret."""


def _dial_proof(sock: socket.socket, secret: bytes,
                stop: threading.Event) -> _Channel:
  """The member's side of the proof of membership."""
  deadline = time.monotonic() + _HANDSHAKE_SECONDS
  mine = _secret.nonce()
  sock.settimeout(_HANDSHAKE_SECONDS)
  sock.sendall(_HELLO + mine)
  answer = _read(sock, _secret.NONCE_SIZE + _secret.MAC_SIZE, deadline, stop)
  theirs, proof = answer[:_secret.NONCE_SIZE], answer[_secret.NONCE_SIZE:]
  if not hmac.compare_digest(
      proof, _secret.mac(secret, _secret.ACCEPT, _CONTEXT, mine, theirs)):
    raise _Refused("the master did not prove it holds this job's secret")
  sock.sendall(_secret.mac(secret, _secret.DIAL, _CONTEXT, mine, theirs))
  return _Channel(sock, _secret.mac(secret, _secret.VALUES, _CONTEXT, mine,
                                    theirs), dialer=True)


def _connect(address: tuple[str, int], deadline: float,
             stop: threading.Event) -> socket.socket:
  """A socket connected to ``address`` by ``deadline``, dialed without
  blocking so that ``stop`` ends the wait; ``OSError`` otherwise."""
  family, kind, proto, _, where = socket.getaddrinfo(
      *address, type=socket.SOCK_STREAM)[0]
  sock = socket.socket(family, kind, proto)
  try:
    sock.setblocking(False)
    code = sock.connect_ex(where)
    with selectors.DefaultSelector() as waiting:
      waiting.register(sock, selectors.EVENT_WRITE)
      while code in (errno.EINPROGRESS, errno.EALREADY, errno.EAGAIN):
        left = deadline - time.monotonic()
        if left <= 0 or stop.is_set():
          raise TimeoutError("no answer to the connection in time")
        if waiting.select(min(left, _STEP_SECONDS)):
          code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
      raise OSError(code, os.strerror(code))
  except BaseException:
    sock.close()
    raise
  sock.setblocking(True)
  return sock


def layout_problem(joins: Mapping[int, Mapping[str, Any]]) -> str | None:
  """Why the nodes' tasks make no cluster, or ``None``.

  Args:
    joins: node rank -> its join message (``jobs``: job -> count,
      ``evaluator``: bool).
  """
  def where(job: str) -> list[int]:
    return [r for r, j in sorted(joins.items()) if j["jobs"].get(job)]
  total = {job: sum(j["jobs"].get(job, 0) for j in joins.values())
           for job in _JOB_ORDER}
  if not total["worker"]:
    return "no node runs a worker task: give one node --workers 1 or more"
  if total["chief"] > 1:
    return (f"{total['chief']} chief tasks (nodes {where('chief')}): give "
            "exactly one node --chief")
  if total["ps"] and not total["chief"]:
    return (f"ps tasks on nodes {where('ps')} but no chief: give one node "
            "--chief (the ParameterServerStrategy coordinator)")
  evaluators = [r for r, j in sorted(joins.items()) if j.get("evaluator")]
  if len(evaluators) > 1:
    return (f"evaluators on nodes {evaluators}: give at most one node "
            "--evaluator")
  return None


def _cluster(joins: Mapping[int, Mapping[str, Any]]) -> tuple[dict, dict]:
  """The cluster spec, and node rank -> its tasks' (type, index), in order."""
  cluster: dict[str, list[str]] = {job: [] for job in _JOB_ORDER}
  places: dict[int, list[tuple[str, int]]] = {}
  for rank, join in sorted(joins.items()):
    ports = iter(join["ports"])
    host = join["host"]
    where = f"[{host}]" if ":" in host else host
    places[rank] = []
    for job in _JOB_ORDER:
      for _ in range(join["jobs"].get(job, 0)):
        places[rank].append((job, len(cluster[job])))
        cluster[job].append(f"{where}:{next(ports)}")
    if join.get("evaluator"):
      places[rank].append(("evaluator", 0))
  return {job: tasks for job, tasks in cluster.items() if tasks}, places


class _Unproven:
  """A connection the master holds until it proves the secret."""

  __slots__ = ("sock", "peer", "deadline", "data", "nonces")

  def __init__(self, sock: socket.socket, peer: str):
    self.sock, self.peer = sock, peer
    self.deadline = time.monotonic() + _HANDSHAKE_SECONDS
    self.data = bytearray()
    self.nonces: tuple[bytes, bytes] | None = None  # Theirs, mine.


def _accept_step(hello: _Unproven, secret: bytes) -> _Channel | None:
  """The master's side of the proof of membership, one readable socket at a
  time without blocking: its channel once proven, else ``None``; raises
  ``OSError`` when it fails."""
  need = (len(_HELLO) + _secret.NONCE_SIZE if hello.nonces is None
          else _secret.MAC_SIZE)
  try:
    chunk = hello.sock.recv(need - len(hello.data))
  except BlockingIOError:
    return None
  if not chunk:
    raise OSError("the connection closed")
  hello.data += chunk
  if len(hello.data) < need:
    return None
  data, hello.data = bytes(hello.data), bytearray()
  if hello.nonces is None:
    if data[:len(_HELLO)] != _HELLO:
      raise OSError("not a tfdist rendezvous hello")
    theirs, mine = data[len(_HELLO):], _secret.nonce()
    answer = mine + _secret.mac(secret, _secret.ACCEPT, _CONTEXT, theirs, mine)
    if hello.sock.send(answer) != len(answer):  # A fresh socket takes it.
      raise OSError("it did not take the answer")
    hello.nonces = theirs, mine
    return None
  theirs, mine = hello.nonces
  if not hmac.compare_digest(
      data, _secret.mac(secret, _secret.DIAL, _CONTEXT, theirs, mine)):
    raise OSError("it did not prove it holds this job's secret")
  return _Channel(hello.sock, _secret.mac(secret, _secret.VALUES, _CONTEXT,
                                          theirs, mine), dialer=False)


class Master:
  """Node 0's rendezvous server: one thread for every proof of membership in
  flight, a daemon thread per proven member.

  Args:
    address: the ``(host, port)`` it listens on.
    nnodes: the nodes that must join.
    secret: the job's secret.
    timeout: seconds for every node to join, each attempt.
    max_restarts: how many times all nodes restart together after a failure.
    log: where it says that a stranger was turned away (once per address).

  Raises:
    OSError: from the constructor, when the address cannot be listened on.
  """

  def __init__(self, *, address: tuple[str, int], nnodes: int, secret: bytes,
               timeout: float, max_restarts: int = 0, log=None):
    self._nnodes = nnodes
    self._secret = secret
    self._timeout = timeout
    self._max_restarts = max_restarts
    self._log = log or sys.stderr
    self._lock = threading.Lock()
    self._members: dict[int, _Channel] = {}
    self._joins: dict[int, dict] = {}
    self._done: set[int] = set()
    self._attempt = 0
    self._over = False
    self._said: set[str] = set()
    self._threads: list[threading.Thread] = []
    self._closed = threading.Event()
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    self._most_unproven = (MAX_UNPROVEN if files == resource.RLIM_INFINITY
                           else max(1, min(MAX_UNPROVEN, files // 4)))
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    self._listener = socket.socket(family, socket.SOCK_STREAM)
    self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      self._listener.bind(address)
      self._listener.listen(1024)
      self._listener.setblocking(False)
    except OSError:
      self._listener.close()
      raise
    self._deadline = time.monotonic() + timeout
    self._gate_thread = threading.Thread(target=self._gate, daemon=True,
                                         name="tfdist-rendezvous-gate")
    self._gate_thread.start()
    threading.Thread(target=self._heartbeats, daemon=True,
                     name="tfdist-rendezvous").start()

  def close(self) -> None:
    """Stops listening and closes every member's connection, after what was
    sent to it: each gets the end of its stream, then up to
    `_CLOSE_SECONDS` to say goodbye."""
    with self._lock:
      self._over = True
      members = list(self._members.values())
      threads = list(self._threads)
    self._closed.set()
    self._gate_thread.join(_CLOSE_SECONDS)
    self._listener.close()
    for channel in members:
      try:
        channel.sock.shutdown(socket.SHUT_WR)
      except OSError:
        pass
    deadline = time.monotonic() + _CLOSE_SECONDS
    for thread in threads:
      thread.join(max(0.0, deadline - time.monotonic()))
    for channel in members:
      channel.close()

  def _gate(self) -> None:
    """Accepts connections and runs their proofs, oldest first in
    ``pending`` (by descriptor); a proven one goes on in `_serve`."""
    pending: dict[int, _Unproven] = {}
    selector = selectors.DefaultSelector()
    resume, listening = 0.0, False
    try:
      while not self._closed.is_set():
        now = time.monotonic()
        while pending and next(iter(pending.values())).deadline <= now:
          self._drop(selector, pending, next(iter(pending)),
                     f"no proof within {_HANDSHAKE_SECONDS:g} s")
        if not listening and now >= resume:
          selector.register(self._listener, selectors.EVENT_READ)
          listening = True
        elif listening and now < resume:
          selector.unregister(self._listener)
          listening = False
        ready = [key.fd for key, _ in selector.select(_STEP_SECONDS)]
        for fd in ready:  # Proofs first: accepting may drop the oldest.
          hello = pending.get(fd)
          if hello is None:
            continue
          try:
            channel = _accept_step(hello, self._secret)
          except OSError as e:
            self._drop(selector, pending, fd, str(e))
            continue
          if channel is not None:
            selector.unregister(pending.pop(fd).sock)
            hello.sock.setblocking(True)
            thread = threading.Thread(
                target=self._serve, args=(channel, hello.peer, hello.deadline),
                daemon=True, name="tfdist-rendezvous-member")
            with self._lock:
              self._threads.append(thread)
            thread.start()
        if self._listener.fileno() in ready:
          resume = self._accept(selector, pending)
    finally:
      for hello in pending.values():
        hello.sock.close()
      selector.close()
      self._listener.close()

  def _accept(self, selector: selectors.BaseSelector,
              pending: dict[int, _Unproven]) -> float:
    """Takes newcomers; returns when to accept again (``accept()`` failed:
    no descriptors left, say; the loop goes on after a pause)."""
    for _ in range(_ACCEPTS_PER_ROUND):
      try:
        sock, peer = self._listener.accept()
      except BlockingIOError:
        break
      except OSError as e:
        self._say_once(f"accept {e.errno}", f"accept() failed ({e}); trying "
                       f"again every {_ACCEPT_PAUSE_SECONDS:g} s")
        return time.monotonic() + _ACCEPT_PAUSE_SECONDS
      if len(pending) >= self._most_unproven:
        self._drop(selector, pending, next(iter(pending)),
                   f"more than {self._most_unproven} connections without "
                   "proof: dropped the oldest")
      sock.setblocking(False)
      pending[sock.fileno()] = _Unproven(sock, peer[0])
      selector.register(sock, selectors.EVENT_READ)
    return 0.0

  def _drop(self, selector: selectors.BaseSelector,
            pending: dict[int, _Unproven], fd: int, why: str) -> None:
    hello = pending.pop(fd)
    selector.unregister(hello.sock)
    hello.sock.close()
    self._stranger(hello.peer, why)

  def _say_once(self, key: str, text: str) -> None:
    with self._lock:
      if key in self._said:
        return
      self._said.add(key)
    print(f"tfdist: rendezvous: {text}", file=self._log, flush=True)

  def _stranger(self, peer: str, why: str) -> None:
    self._say_once(peer, f"turned away a connection from {peer}: {why}")

  def _serve(self, channel: _Channel, peer: str, deadline: float) -> None:
    try:
      join = channel.receive(max(0.0, deadline - time.monotonic()))
    except (OSError, ValueError) as e:
      channel.close()
      self._stranger(peer, str(e))
      return
    rank = join.get("rank")
    with self._lock:
      problem = (f"node rank {rank!r} is not from 0 to {self._nnodes - 1}"
                 if not isinstance(rank, int) or not 0 <= rank < self._nnodes
                 else f"node rank {rank} joined twice"
                 if rank in self._members else None)
      if problem is None:
        self._members[rank] = channel
    if problem:
      self._send(channel, {"kind": "error", "code": 2, "why": problem})
      channel.close()
      return
    self._on_join(rank, join)
    while True:
      try:
        message = channel.receive(SILENCE_SECONDS)
      except socket.timeout:
        self._lost(rank, f"node {rank} sent nothing for {SILENCE_SECONDS:g} s")
        return
      except (OSError, ValueError) as e:
        self._lost(rank, f"node {rank}'s launcher went away ({e})")
        return
      kind = message["kind"]
      if kind == "join":
        self._on_join(rank, message)
      elif kind == "failed":
        self._on_failed(rank, message)
      elif kind == "done":
        self._on_done(rank)
      elif kind == "bye":
        channel.close()
        return

  def _on_join(self, rank: int, join: dict) -> None:
    with self._lock:
      if join.get("attempt") != self._attempt:
        return  # A join from before a restart.
      self._joins[rank] = join
      if len(self._joins) < self._nnodes:
        return
      joins, members = dict(self._joins), dict(self._members)
    problem = layout_problem(joins)
    if problem:
      self._broadcast({"kind": "error", "code": 2, "why": problem},
                      members)
      return
    cluster, places = _cluster(joins)
    for r, channel in members.items():
      self._send(channel, {"kind": "cluster", "attempt": self._attempt,
                           "cluster": cluster, "places": places[r],
                           "trainers": _trainer_nodes(joins)})

  def _on_failed(self, rank: int, message: dict) -> None:
    with self._lock:
      if self._over or message.get("attempt") != self._attempt:
        return  # Already stopping, or a failure from before a restart.
      restart = self._attempt < self._max_restarts
      if restart:
        self._attempt += 1
        self._joins, self._done = {}, set()
        self._deadline = time.monotonic() + self._timeout
      else:
        self._over = True
      members = dict(self._members)
    self._broadcast({
        "kind": "stop", "code": message.get("code", 1),
        "why": f"task {message.get('role')} on node {rank} failed",
        "restart": self._attempt if restart else None}, members)

  def _on_done(self, rank: int) -> None:
    with self._lock:
      self._done.add(rank)
      trainers = _trainer_nodes(self._joins)
      finished = set(trainers) <= self._done and not self._over
      if finished:
        self._over = True
      members = dict(self._members)
    if finished:
      self._broadcast({"kind": "finish"}, members)

  def _lost(self, rank: int, why: str) -> None:
    with self._lock:
      self._members.pop(rank, None)
      if self._over:
        return
      self._over = True
      members = dict(self._members)
    self._broadcast({"kind": "stop", "code": 1, "why": why, "restart": None},
                    members)

  def _heartbeats(self) -> None:
    while True:
      time.sleep(HEARTBEAT_SECONDS)
      if self._listener.fileno() < 0:
        return  # Closed.
      with self._lock:
        members = dict(self._members)
        waiting = (len(self._joins) < self._nnodes and not self._over
                   and time.monotonic() > self._deadline)
        if waiting:
          self._over = True
          missing = sorted(set(range(self._nnodes)) - set(self._joins))
      if waiting:
        self._broadcast({"kind": "error", "code": 1, "why": (
            f"nodes {missing} did not join the rendezvous within "
            f"{self._timeout:g} s")}, members)
      self._broadcast({"kind": "beat"}, members)

  def _broadcast(self, message: dict, members: Mapping[int, _Channel]) -> None:
    # Node 0 (this process) last: it may end as soon as it reads its copy.
    for _, channel in sorted(members.items(), reverse=True):
      self._send(channel, message)

  @staticmethod
  def _send(channel: _Channel, message: dict) -> None:
    try:
      channel.send(message)
    except OSError:
      pass  # Its reader notices the loss.


def _trainer_nodes(joins: Mapping[int, Mapping[str, Any]]) -> list[int]:
  """Nodes running training tasks: chief and, without ps, workers."""
  servers = any(j["jobs"].get("ps") for j in joins.values())
  return sorted(r for r, j in joins.items()
                if j["jobs"].get("chief")
                or (j["jobs"].get("worker") and not servers))


class Member:
  """A node launcher's side of the rendezvous.

  Args:
    master: the ``(host, port)`` of node 0's `Master`.
    rank: this node's rank.
    secret: the job's secret.
    timeout: seconds to reach the master and for all nodes to join.
    stop: once set, every wait here (dialing, proving, `join`) ends within
      `_STEP_SECONDS` with a `RendezvousError`; a launcher's signal handler
      sets it.

  Raises:
    RendezvousError: from the constructor, when the master cannot be
      reached within ``timeout``, does not hold the secret, or ``stop`` is
      set.
  """

  def __init__(self, *, master: tuple[str, int], rank: int, secret: bytes,
               timeout: float, stop: threading.Event | None = None):
    self._rank = rank
    self._timeout = timeout
    self._stop = stop = stop or threading.Event()
    self._inbox: queue.Queue = queue.Queue()
    where = f"{master[0]}:{master[1]}"
    deadline = time.monotonic() + timeout
    while True:  # Dial until proven: a flood may drop a connection.
      self._check_stop()
      try:
        sock = _connect(master, deadline, stop)
      except OSError as e:
        error = e
      else:
        try:
          self._channel = _dial_proof(sock, secret, stop)
          break
        except _Refused as e:
          sock.close()
          raise RendezvousError(
              f"the rendezvous at {where} refused this node: {e}; every "
              "node needs the same job secret") from None
        except OSError as e:
          sock.close()
          error = e
      self._check_stop()
      if time.monotonic() > deadline:
        raise RendezvousError(
            f"could not reach the rendezvous at {where} within {timeout:g} s "
            f"({error}); is node 0's launcher running, and "
            "--master-addr/--master-port the same on every node?") from None
      stop.wait(0.5)
    #: The address the master sees this node at.
    self.local_address = sock.getsockname()[0]
    self._last = time.monotonic()
    self._alive = True
    threading.Thread(target=self._read, daemon=True,
                     name="tfdist-rendezvous-reader").start()
    threading.Thread(target=self._beat, daemon=True,
                     name="tfdist-rendezvous-beat").start()

  def _check_stop(self) -> None:
    if self._stop.is_set():
      raise RendezvousError("stopped while waiting in the rendezvous")

  def join(self, *, attempt: int, host: str, jobs: Mapping[str, int],
           evaluator: bool, ports: Sequence[int]) -> dict:
    """Sends this node's tasks; returns the ``cluster`` message.

    Raises:
      RendezvousError: the layout is refused, the master stops the job or
        goes away, not every node joined in time, or ``stop`` was set.
    """
    self.send({"kind": "join", "rank": self._rank, "attempt": attempt,
               "host": host, "jobs": dict(jobs), "evaluator": evaluator,
               "ports": list(ports)})
    deadline = time.monotonic() + self._timeout + SILENCE_SECONDS
    while time.monotonic() < deadline:
      self._check_stop()
      message = self.poll(timeout=_STEP_SECONDS)
      if message is None:
        continue
      if message["kind"] == "cluster" and message.get("attempt") == attempt:
        return message
      if message["kind"] in ("error", "stop", "lost"):
        raise RendezvousError(message.get("why", "stopped"),
                              code=message.get("code", 1))
    raise RendezvousError(f"no cluster from the rendezvous within "
                          f"{self._timeout:g} s")

  def send(self, message: Mapping[str, Any]) -> None:
    try:
      self._channel.send(message)
    except OSError:
      pass  # The reader reports the loss.

  def poll(self, timeout: float = 0.0) -> dict | None:
    """The next message from the master other than a heartbeat, or
    ``None``; ``{"kind": "lost", ...}`` once the master is gone."""
    end = time.monotonic() + timeout
    while True:
      try:
        message = self._inbox.get(timeout=max(0.0, end - time.monotonic()))
      except queue.Empty:
        if self._alive and time.monotonic() - self._last > SILENCE_SECONDS:
          self._alive = False
          return {"kind": "lost", "code": 1, "why": (
              f"the rendezvous on node 0 sent nothing for "
              f"{SILENCE_SECONDS:g} s")}
        return None
      if message["kind"] != "beat":
        return message

  def _read(self) -> None:
    while True:
      try:
        message = self._channel.receive(SILENCE_SECONDS)
      except (OSError, ValueError) as e:
        if self._alive:
          self._alive = False
          self._inbox.put({"kind": "lost", "code": 1, "why": (
              f"lost the rendezvous on node 0 ({e})")})
        return
      self._last = time.monotonic()
      self._inbox.put(message)

  def _beat(self) -> None:
    while self._alive:
      time.sleep(HEARTBEAT_SECONDS)
      self.send({"kind": "beat"})

  def close(self) -> None:
    """Says goodbye and closes the connection."""
    self.send({"kind": "bye"})
    self._alive = False
    self._channel.close()
