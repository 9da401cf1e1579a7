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
3. **Cluster.** Once enough nodes joined (`Rounds`: all N, or for
   ``--nnodes MIN:MAX`` MAX, or MIN or more after the last call; within
   ``timeout``), the master checks the whole cluster (one chief when there
   is a ps, at most one evaluator, a worker somewhere) and sends each node
   the cluster and its tasks' places, dense in node-rank order, so node 0
   (which holds the rendezvous) holds the chief; a layout that cannot work
   is sent to every node as an error instead.
4. **Watch.** Both sides send a heartbeat every `HEARTBEAT_SECONDS`; silence
   for `SILENCE_SECONDS`, or a closed connection, means the peer is lost. A
   member reports a failed task (``failed``) or that its training tasks
   finished (``done``). A failed task, a lost node or (below MAX) a new one
   ends the round: the master sends every node ``stop``, with the next
   round's number while restarts remain and MIN or more nodes are left
   (they stop their tasks and join again), or for good; once every node
   with training tasks is done, ``finish``. A node that comes back under
   its rank replaces its old, silent connection.

So from a failure anywhere to every node stopping its tasks takes at most
`SILENCE_SECONDS` plus one heartbeat (a launcher that hangs or a cut link)
and a few milliseconds otherwise (a task that fails, a launcher that dies:
its connection closes at once); stopping then takes the launcher's
``grace_seconds``. Node 0's launcher is the one node a job cannot lose.

What to decide is `tfdist.launch.rounds.Rounds`'s; this module carries it
over the network. `tfdist.launch.rounds.Solo` is the rendezvous of one node,
with no network: the launcher runs one supervision loop whatever the number
of nodes.

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
import math
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
from tfdist.launch.rounds import Outbox
from tfdist.launch.rounds import RendezvousError
from tfdist.launch.rounds import Rounds

__all__ = ["Master", "Member", "RendezvousError", "HEARTBEAT_SECONDS",
           "SILENCE_SECONDS", "MAX_MESSAGE_BYTES", "MAX_UNPROVEN"]

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
  flight, a daemon thread per proven member, one that sends.

  Args:
    address: the ``(host, port)`` it listens on.
    nnodes: the most nodes of the job.
    min_nodes: the fewest nodes it runs on (``nnodes`` by default).
    secret: the job's secret.
    timeout: seconds for enough nodes to join, each round.
    max_restarts: how many times all nodes restart together.
    last_call: seconds to wait for more nodes once ``min_nodes`` joined.
    log: where it says that a stranger was turned away (once per address).

  Raises:
    OSError: from the constructor, when the address cannot be listened on.
  """

  def __init__(self, *, address: tuple[str, int], nnodes: int, secret: bytes,
               timeout: float, max_restarts: int = 0,
               min_nodes: int | None = None, last_call: float = 0.0,
               log=None):
    self._rounds = Rounds(min_nodes=min_nodes or nnodes, max_nodes=nnodes,
                          max_restarts=max_restarts, timeout=timeout,
                          last_call=last_call)
    self._nnodes = nnodes
    self._secret = secret
    self._log = log or sys.stderr
    self._lock = threading.Lock()
    self._members: dict[int, _Channel] = {}
    self._heard: dict[int, float] = {}  # Rank -> when it last said anything.
    self._outbox: queue.Queue = queue.Queue()
    self._said: set[str] = set()
    self._threads: list[threading.Thread] = []
    self._beaten = 0.0  # When the last heartbeat went out.
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
    self._gate_thread = threading.Thread(target=self._gate, daemon=True,
                                         name="tfdist-rendezvous-gate")
    self._gate_thread.start()
    for target in (self._heartbeats, self._sender):
      threading.Thread(target=target, daemon=True,
                       name="tfdist-rendezvous").start()

  def close(self) -> None:
    """Stops listening and closes every member's connection, after what was
    sent to it: each gets the end of its stream, then up to
    `_CLOSE_SECONDS` to say goodbye."""
    with self._lock:
      self._rounds.over = True
      members = list(self._members.values())
      threads = list(self._threads)
    self._closed.set()
    self._gate_thread.join(_CLOSE_SECONDS)
    self._listener.close()
    self._outbox.put(None)
    deadline = time.monotonic() + _CLOSE_SECONDS
    while not self._outbox.empty() and time.monotonic() < deadline:
      time.sleep(0.01)  # What was decided reaches the members first.
    for channel in members:
      try:
        channel.sock.shutdown(socket.SHUT_WR)
      except OSError:
        pass
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
      old = self._members.get(rank)
      problem = (f"node rank {rank!r} is not from 0 to {self._nnodes - 1}"
                 if not isinstance(rank, int) or not 0 <= rank < self._nnodes
                 else f"node rank {rank} joined twice" if old is not None
                 and time.monotonic() - self._heard[rank] < SILENCE_SECONDS / 2
                 else None)
      if problem is None:
        # A node that came back replaces its silent old connection.
        self._members[rank] = channel
        self._heard[rank] = time.monotonic()
        if old is not None:
          self._post(self._rounds.lost(rank, f"node {rank} came back"))
        self._post(self._rounds.join(rank, join, first=True))
    if problem:
      self._send(channel, {"kind": "error", "code": 2, "why": problem})
      channel.close()
      return
    if old is not None:
      old.close()
    while True:
      try:
        message = channel.receive(SILENCE_SECONDS)
      except socket.timeout:
        self._lost(rank, channel,
                   f"node {rank} sent nothing for {SILENCE_SECONDS:g} s")
        return
      except (OSError, ValueError) as e:
        self._lost(rank, channel, f"node {rank}'s launcher went away ({e})")
        return
      kind = message["kind"]
      with self._lock:
        if self._members.get(rank) is not channel:
          return  # Replaced by the node's new connection.
        self._heard[rank] = time.monotonic()
        if kind == "join":
          self._post(self._rounds.join(rank, message, first=False))
        elif kind == "failed":
          self._post(self._rounds.failed(rank, message))
        elif kind == "done":
          self._post(self._rounds.done(rank))
      if kind == "bye":
        self._lost(rank, channel, f"node {rank} left")
        return

  def _lost(self, rank: int, channel: _Channel, why: str) -> None:
    with self._lock:
      if self._members.get(rank) is not channel:
        return
      del self._members[rank]
      self._post(self._rounds.lost(rank, why))
    channel.close()

  def _post(self, out: Outbox) -> None:
    """Queues messages in the order decided (called under the lock)."""
    for rank, message in out:
      channel = self._members.get(rank)
      if channel is not None:
        self._outbox.put((channel, message))

  def _sender(self) -> None:
    while True:
      item = self._outbox.get()
      if item is None:
        return
      self._send(*item)

  def _heartbeats(self) -> None:
    while not self._closed.wait(min(HEARTBEAT_SECONDS, _STEP_SECONDS)):
      with self._lock:
        self._post(self._rounds.tick())
        now = time.monotonic()
        if now - self._beaten >= HEARTBEAT_SECONDS:
          self._beaten = now
          self._post([(r, {"kind": "beat"}) for r in self._members])

  @staticmethod
  def _send(channel: _Channel, message: dict) -> None:
    try:
      channel.send(message)
    except OSError:
      pass  # Its reader notices the loss.


class Member:
  """A node launcher's side of the rendezvous.

  Args:
    master: the ``(host, port)`` of node 0's `Master`.
    rank: this node's rank.
    secret: the job's secret.
    timeout: seconds to reach the master and for enough nodes to join.
    stop: once set, every wait here (dialing, proving, `join`) ends within
      `_STEP_SECONDS` with a `RendezvousError`; a launcher's signal handler
      sets it.
    say: where a line for the user goes (a node told to wait).

  Raises:
    RendezvousError: from the constructor, when the master cannot be
      reached within ``timeout``, does not hold the secret, or ``stop`` is
      set.
  """

  def __init__(self, *, master: tuple[str, int], rank: int, secret: bytes,
               timeout: float, stop: threading.Event | None = None,
               say=None):
    self._rank = rank
    self._timeout = timeout
    self._stop = stop = stop or threading.Event()
    self._say = say or (lambda text: print(f"tfdist: {text}", flush=True))
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

  def join(self, *, attempt: int, host: str, jobs: Mapping[str, int],
           evaluator: bool, ports: Sequence[int]) -> dict:
    """Sends this node's tasks; returns the ``cluster`` message of round
    ``attempt`` or a later one (a newcomer joins the round that is on).

    Raises:
      RendezvousError: the layout is refused, the master stops the job or
        goes away, not enough nodes joined in time, or `stop` was set.
    """
    join = {"kind": "join", "rank": self._rank, "attempt": attempt,
            "host": host, "jobs": dict(jobs), "evaluator": evaluator,
            "ports": list(ports)}
    self.send(join)
    deadline = time.monotonic() + self._timeout + SILENCE_SECONDS
    while time.monotonic() < deadline:
      self._check_stop()
      message = self.poll(timeout=_STEP_SECONDS)
      if message is None:
        continue
      kind = message["kind"]
      if kind == "cluster" and message.get("attempt", -1) >= attempt:
        return message
      if kind == "wait":
        self._say(message["why"])
        deadline = math.inf  # Until the job ends or restarts.
      elif kind == "stop" and message.get("restart") is not None:
        attempt = join["attempt"] = message["restart"]  # A waiting node.
        self.send(join)
        deadline = time.monotonic() + self._timeout + SILENCE_SECONDS
      elif kind == "finish":
        raise RendezvousError("the job finished without this node", code=0)
      elif kind in ("error", "stop", "lost"):
        raise RendezvousError(message.get("why", "stopped"),
                              code=message.get("code", 1))
    raise RendezvousError(f"no cluster from the rendezvous within "
                          f"{self._timeout:g} s")

  def _check_stop(self) -> None:
    if self._stop.is_set():
      raise RendezvousError("stopped while waiting in the rendezvous")

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


