"""The multi-node rendezvous: node 0 hands every node its part of one cluster.

``tfdist launch --nnodes N`` runs one launcher per node. Node 0's launcher
also runs a `Master` on ``--master-addr:--master-port`` (it listens on that
address only); every launcher, node 0's included, joins it as a `Member`:

1. **Proof of membership.** The member dials and both prove the job's
   secret through the job's one gate (`tfdist._secret.Gate`, which the
   socket ring uses too): challenge and response with fresh nonces both
   ways. Every later message is length-prefixed JSON followed by an
   HMAC-SHA256 tag under the connection's own key and the message's
   sequence number in its direction: a message that was altered, replayed,
   reordered or sent by anyone without the secret ends that connection. A
   connection that fails the proof is dropped and logged once; the job
   goes on. The gate's limits hold: one deadline for the whole hello and
   proof, which the join message keeps to as well, and a cap on the
   connections without proof, so strangers, however many and however slow,
   hold no connection for long and cannot stop the master.
2. **Join.** Each member sends its node rank, the address the others should
   dial it at, and its tasks (chief, workers, ps, evaluator) with ports it
   picked free on its own host.
   A node whose ``--nnodes`` or ``--run-id`` differs from node 0's, or
   that runs another release or script (`fingerprint`), is refused.
3. **Cluster.** Once enough nodes joined (`Rounds`: all N, or for
   ``--nnodes MIN:MAX`` MAX, or MIN or more at the last call; within
   ``timeout``), the master checks the whole cluster (one chief when there
   is a ps, at most one evaluator, a worker somewhere) and sends each node
   the cluster and its tasks' places, dense in node-rank order, so node 0
   (which holds the rendezvous) holds the chief; a layout that cannot work
   is sent to every node as an error instead.
4. **Watch.** Both sides send a heartbeat every `HEARTBEAT_SECONDS`; silence
   for `SILENCE_SECONDS`, or a closed connection, means the peer is lost (a
   silent node is told so, should it wake). A member reports a failed task
   (``failed``) or that its training tasks finished (``done``). A failed
   task, a lost node or (below MAX) a new one ends the round (a change of
   members once it settled, `SETTLE_SECONDS`): the master
   sends every node ``stop``, with the next round's number (they stop their
   tasks and join again) or for good; once every node with training tasks
   is done, ``finish``. A node that comes back under its rank replaces its
   old, silent connection.

So from a failure anywhere to every node stopping its tasks takes at most
`SILENCE_SECONDS` plus one heartbeat (a launcher that hangs or a cut link)
and a few milliseconds otherwise (a task that fails, a launcher that dies:
its connection closes at once), plus `SETTLE_SECONDS` for a change of
members in an elastic job; stopping then takes the launcher's
``grace_seconds``. Node 0's launcher is the one node a job cannot lose.

What to decide is `tfdist.launch.rounds.Rounds`'s; this module carries it
over the network, one row of `tfdist.launch.members`.

The secret (`tfdist._net.JOB_SECRET_VARIABLE` in the environment, or a file)
is never sent, and never appears on a command line. Every wait is bounded,
and a member's end once its ``stop`` event is set (by the launcher's signal
handler); every message is capped at `MAX_MESSAGE_BYTES`. No TensorFlow
here.
"""

from __future__ import annotations

import hmac
import json
import math
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from tfdist import _net
from tfdist import _secret
from tfdist.launch import fingerprint
from tfdist.launch import rounds
from tfdist.launch.rounds import Outbox
from tfdist.launch.rounds import RendezvousError
from tfdist.launch.rounds import Rounds
from tfdist.launch.rounds import disagreement

__all__ = ["Master", "Member", "RendezvousError", "HEARTBEAT_SECONDS",
           "SILENCE_SECONDS", "PEER_GRACE_SECONDS", "SETTLE_SECONDS",
           "MAX_MESSAGE_BYTES"]

#: How often each side says it is alive.
HEARTBEAT_SECONDS = 1.0
#: Silence after which a peer counts as lost.
SILENCE_SECONDS = 10.0
#: How long a task's failure on a lost peer waits for that peer's node to be
#: found lost (its silence, and two heartbeats more): then the restart is a
#: change of members, free, not a failure (`Rounds`).
PEER_GRACE_SECONDS = SILENCE_SECONDS + 2 * HEARTBEAT_SECONDS
#: How long a change of members settles in an elastic job before it
#: restarts the round (`Rounds`): nodes lost to silence are found within one
#: heartbeat of each other (their last messages were), closed connections
#: within milliseconds, so a burst of losses (launchers killed at once, a
#: switch that drops a rack) or of returns is one restart.
SETTLE_SECONDS = 2 * HEARTBEAT_SECONDS
#: The largest message accepted (a cluster of thousands of tasks fits).
MAX_MESSAGE_BYTES = 1 << 20
#: How often every wait looks at its stop event (and the master at close).
_STEP_SECONDS = 0.2
_HELLO = b"TFDR"
#: How long a member waits to dial again after a failed try.
_REDIAL_SECONDS = 0.5
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


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
  """``n`` bytes, all by monotonic ``deadline`` (not a timeout per byte);
  ``TimeoutError`` when late. Bytes that came in time count after it too:
  a process stopped (SIGSTOP) and continued reads what reached it
  meanwhile."""
  data = bytearray()
  while len(data) < n:
    sock.settimeout(max(0.0, deadline - time.monotonic()))
    try:
      chunk = sock.recv(n - len(data))
    except BlockingIOError:  # Past the deadline, and nothing more came.
      raise TimeoutError(f"{len(data)} of {n} bytes in time") from None
    if not chunk:
      raise OSError("the connection closed")
    data += chunk
  return bytes(data)


def _terms(secret: bytes) -> _secret.Terms:
  """The rendezvous's hellos: `_HELLO` and a fresh nonce, each way."""
  return _secret.Terms(
      secret=secret, context=_CONTEXT,
      hello_size=len(_HELLO) + _secret.NONCE_SIZE,
      hello=lambda: _HELLO + _secret.nonce(),
      foreign=lambda hello, dialed: None if hello.startswith(_HELLO)
      else "sent no tfdist rendezvous hello")


class Master:
  """Node 0's rendezvous server: one thread for every proof of membership in
  flight, a daemon thread per proven member, one that sends.

  Args:
    address: the ``(host, port)`` it listens on.
    nnodes: the most nodes of the job.
    min_nodes: the fewest nodes it runs on (``nnodes`` by default).
    secret: the job's secret.
    timeout: seconds for enough nodes to join, each round.
    max_restarts: how many task failures all nodes restart after.
    last_call: seconds each round waits for more nodes once
      ``min_nodes`` joined.
    agree: job settings (flag -> value) every node must share with node 0;
      a node whose differ is refused, naming both values.
    node: what node 0 runs (`tfdist.launch.fingerprint.take`): a node that
      runs another release or script is refused, one with other arguments
      is warned about; ``None`` compares nothing.
    say: says a line (after ``tfdist: ``, as `Console.say` does; to stderr
      when ``None``) that a stranger was turned away (once per address),
      that a node was refused or warned about.
    on_report: ``on_report(rank, message)`` for a node's answer to a stall
      report's ``ask`` (`tfdist.launch.stall.Flight.merge`); ``None`` drops.

  Raises:
    OSError: from the constructor, when the address cannot be listened on.
  """

  def __init__(self, *, address: tuple[str, int], nnodes: int, secret: bytes,
               timeout: float, max_restarts: int = 0,
               min_nodes: int | None = None, last_call: float = 0.0,
               agree: Mapping[str, Any] | None = None,
               node: Mapping[str, Any] | None = None,
               say: Callable[[str], None] | None = None,
               on_report: Callable[[int, dict], None] | None = None):
    self._rounds = Rounds(min_nodes=min_nodes or nnodes, max_nodes=nnodes,
                          max_restarts=max_restarts, timeout=timeout,
                          last_call=last_call, peer_grace=PEER_GRACE_SECONDS,
                          settle=SETTLE_SECONDS)
    self._nnodes = nnodes
    self._agree = dict(agree or {})
    self._node = node
    self._say = say or (lambda text: sys.stderr.write(f"tfdist: {text}\n"))
    self._on_report = on_report
    self._lock = threading.Lock()
    self._members: dict[int, _Channel] = {}
    self._heard: dict[int, float] = {}  # Rank -> when it last said anything.
    self._outbox: queue.Queue = queue.Queue()
    self._said: set[str] = set()
    self._threads: list[threading.Thread] = []
    self._beaten = 0.0  # When the last heartbeat went out.
    self._closed = threading.Event()
    self._listener = socket.socket(_net.family(address[0]),
                                   socket.SOCK_STREAM)
    self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      self._listener.bind(address)
      self._listener.listen(1024)
    except OSError:
      self._listener.close()
      raise
    self._gate = _secret.Gate(_terms(secret), listener=self._listener,
                              dropped=self._turned_away)
    self._gate_thread = threading.Thread(target=self._admit, daemon=True,
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

  def _admit(self) -> None:
    """Runs the gate; a proven connection goes on in `_serve`."""
    try:
      while not self._closed.is_set():
        for proven in self._gate.poll(_STEP_SECONDS):
          channel = _Channel(proven.sock, proven.key, dialer=False)
          thread = threading.Thread(
              target=self._serve, args=(channel, proven.peer, proven.expires),
              daemon=True, name="tfdist-rendezvous-member")
          with self._lock:
            self._threads.append(thread)
          thread.start()
    finally:
      self._gate.close()
      self._listener.close()

  def _turned_away(self, hello: _secret.Hello | None, why: str) -> None:
    if hello is None:  # accept() failed.
      self._say_once(why, why)
    else:
      self._stranger(hello.peer, f"it {why}")

  def _say_once(self, key: str, text: str) -> None:
    with self._lock:
      if key in self._said:
        return
      self._said.add(key)
    self._say(f"rendezvous: {text}")

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
    refused = warning = None
    if isinstance(rank, int):
      refused = disagreement(self._agree, join.get("agree", {}), rank=rank)
    known = isinstance(rank, int) and 0 <= rank < self._nnodes
    if known and not refused and self._node is not None:
      refused, warning = fingerprint.compare(self._node, join.get("node"),
                                             rank=rank)
    if refused:
      self._say_once(f"refused {rank} {refused}",
                     f"refused node {rank}: {refused}")
    elif warning:
      self._say_once(f"warned {rank} {warning}", f"warning: {warning}")
    with self._lock:
      old = self._members.get(rank)
      problem = (f"node 0 refused this node: {refused}" if refused
                 else f"node rank {rank!r} is not from 0 to {self._nnodes - 1}"
                 if not known
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
        why = f"node {rank} sent nothing for {SILENCE_SECONDS:g} s"
        # Said first, should it wake: its launcher leaves instead of
        # taking node 0 for lost.
        self._send(channel, {"kind": "error", "code": 1,
                             "why": f"node 0 dropped this node: {why}"})
        self._lost(rank, channel, why)
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
        elif kind == "ask":  # A stall report: every node answers node 0.
          self._post([(r, {**message, "nodes": sorted(self._members)})
                      for r in self._members])
      if kind == "bye":
        self._lost(rank, channel, f"node {rank} left")
        return
      if kind == "report" and self._on_report is not None:
        self._on_report(rank, message)

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
    node: what this node runs (`tfdist.launch.fingerprint.take`), sent
      with every join for node 0 to compare.
    agree: this node's job settings (flag -> value), sent with every join
      for node 0 to compare (`Master`'s ``agree``).
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
               timeout: float, node: Mapping[str, Any] | None = None,
               agree: Mapping[str, Any] | None = None,
               stop: threading.Event | None = None, say=None):
    self._rank = rank
    self._node = dict(node or {})
    self._agree = dict(agree or {})
    self._timeout = timeout
    self._stop = stop or threading.Event()
    self._say = say or (lambda text: print(f"tfdist: {text}", flush=True))
    self._inbox: queue.Queue = queue.Queue()
    proven = self._dial(master, secret, timeout)
    self._channel = _Channel(proven.sock, proven.key, dialer=True)
    #: The address the master sees this node at.
    self.local_address = proven.sock.getsockname()[0]
    self._alive = True
    threading.Thread(target=self._read, daemon=True,
                     name="tfdist-rendezvous-reader").start()
    threading.Thread(target=self._beat, daemon=True,
                     name="tfdist-rendezvous-beat").start()

  def _dial(self, master: tuple[str, int], secret: bytes,
            timeout: float) -> _secret.Proven:
    """A connection to the master, both sides proven, within ``timeout``.

    Dials again after a failed try (a flood may drop a connection), not
    after a refusal: a master without this job's secret.
    """
    where = f"{master[0]}:{master[1]}"
    deadline = time.monotonic() + timeout
    failed: list[tuple[_secret.Hello, str]] = []
    gate = _secret.Gate(_terms(secret),
                        dropped=lambda hello, why: failed.append((hello, why)))
    why, again = "no answer", 0.0
    try:
      while True:
        self._check_stop()
        now = time.monotonic()
        if now > deadline:
          raise RendezvousError(
              f"could not reach the rendezvous at {where} within "
              f"{timeout:g} s (last try: {why}); is node 0's launcher "
              "running, and --master-addr/--master-port the same on every "
              "node?")
        if not gate.dialing and now >= again:
          try:
            family, _, _, _, address = socket.getaddrinfo(
                *master, type=socket.SOCK_STREAM)[0]
            gate.dial(family, address, where)
          except OSError as e:
            why, again = str(e), now + _REDIAL_SECONDS
        for proven in gate.poll(_STEP_SECONDS):
          return proven
        for hello, what in failed:
          if hello.refused:
            raise RendezvousError(
                f"the rendezvous at {where} refused this node: it {what}; "
                "every node needs the same job secret")
          why, again = what, time.monotonic() + _REDIAL_SECONDS
        failed.clear()
    finally:
      gate.close()

  def join(self, *, attempt: int, host: str, jobs: Mapping[str, int],
           evaluator: bool, ports: Sequence[int]) -> rounds.Cluster:
    """Sends this node's tasks; returns the `rounds.Cluster` of round
    ``attempt`` or a later one. Told to wait (the job is full, or went on
    without this node at a last call), it waits for the next restart, or
    the job's end: no deadline then.

    Raises:
      RendezvousError: the layout is refused, the master stops the job or
        goes away, not enough nodes joined in time, or `stop` was set.
    """
    join = {"kind": "join", "rank": self._rank, "attempt": attempt,
            "host": host, "jobs": dict(jobs), "evaluator": evaluator,
            "ports": list(ports), "node": self._node, "agree": self._agree}
    self.send(join)
    deadline = time.monotonic() + self._timeout + SILENCE_SECONDS
    while time.monotonic() < deadline:
      self._check_stop()
      message = self.poll(timeout=_STEP_SECONDS)
      if isinstance(message, rounds.Cluster) and message.attempt >= attempt:
        return message
      if isinstance(message, rounds.Wait):
        self._say(message.why)
        deadline = math.inf  # Until the job ends or restarts.
      elif isinstance(message, rounds.Stop) and message.restart is not None:
        attempt = join["attempt"] = message.restart  # A waiting node.
        self.send(join)
        deadline = time.monotonic() + self._timeout + SILENCE_SECONDS
      elif isinstance(message, rounds.Finish):
        raise RendezvousError("the job finished without this node", code=0)
      elif isinstance(message, rounds.Stop):
        raise RendezvousError(message.why, code=message.code)
    raise RendezvousError(f"no cluster from the rendezvous within "
                          f"{self._timeout:g} s")

  def _check_stop(self) -> None:
    if self._stop.is_set():
      raise RendezvousError("stopped while waiting in the rendezvous")

  def send(self, message: Any) -> None:
    """Sends a typed message (`rounds.wire`), or a dict as it is."""
    try:
      self._channel.send(message if isinstance(message, Mapping)
                         else rounds.wire(message))
    except OSError:
      pass  # The reader reports the loss.

  def poll(self, timeout: float = 0.0) -> Any:
    """The next typed message from the master (`rounds.typed`), or
    ``None``; a `rounds.Stop` once the master is gone."""
    end = time.monotonic() + timeout
    while True:
      try:
        message = self._inbox.get(timeout=max(0.0, end - time.monotonic()))
      except queue.Empty:
        return None
      if message["kind"] != "beat":
        return rounds.typed(message)

  def _read(self) -> None:
    """Queues the master's messages, then ``lost`` (the reader alone
    judges silence: what came before it is read first)."""
    while True:
      try:
        message = self._channel.receive(SILENCE_SECONDS)
      except (OSError, ValueError) as e:
        if self._alive:
          self._alive = False
          why = (f"the rendezvous on node 0 sent nothing for "
                 f"{SILENCE_SECONDS:g} s" if isinstance(e, TimeoutError)
                 else f"lost the rendezvous on node 0 ({e})")
          self._inbox.put({"kind": "lost", "code": 1, "why": why})
        return
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


