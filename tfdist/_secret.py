"""The job's secret at work: one gate that admits only its holders.

A job has two listeners that face the network, node 0's rendezvous
(`tfdist.launch.rendezvous`) and every socket ring (`tfdist.ring.connection`);
one `Gate` proves the peers of both. On each connection:

1. the dialer sends its hello ``D``, with a fresh nonce;
2. the acceptor checks that ``D`` is of its kind (`Terms.foreign`) and
   answers with its own hello ``A``, with a fresh nonce, and
   ``mac(secret, ACCEPT, context, D, A)``;
3. the dialer checks both and sends ``mac(secret, DIAL, context, D, A)``.

Each side's MAC covers the other side's fresh nonce, so a recording does not
pass twice; the role labels keep one side's MAC from serving as the other's,
and ``context`` one gate's from another's. Both sides then hold the
connection's own key, ``mac(secret, VALUES, context, D, A)``.

One set of limits serves both, so strangers, however many or slow, hold no
connection for long and cannot keep a peer out:

* `HELLO_SECONDS` for a connection's whole hello and proof (not per byte);
* at most `MAX_UNPROVEN` accepted connections without proof at once, and no
  more than a quarter of the process's open-file limit (`most_unproven`): a
  newcomer beyond that drops the oldest, silent ones first. A peer proves
  itself within a round trip of being accepted, so it gets in unless more
  strangers than that are accepted meanwhile;
* an ``accept()`` that fails (no descriptor left) is tried again after
  `_ACCEPT_PAUSE_SECONDS`.

One thread drives every connection in flight without blocking
(`Gate.poll`). The secret itself comes from `tfdist._net.job_secret`.
Nothing here imports TensorFlow or other tfdist modules.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import os
import resource
import secrets
import selectors
import socket
import time
from typing import Callable

__all__ = ["ACCEPT", "DIAL", "VALUES", "MAC_SIZE", "NONCE_SIZE",
           "HELLO_SECONDS", "MAX_UNPROVEN", "nonce", "mac", "most_unproven",
           "Terms", "Hello", "Proven", "Gate"]

#: The role labels of `mac`: one side's proof never serves as the other's.
ACCEPT, DIAL, VALUES = b"accept", b"dial", b"values"
#: Bytes of a MAC (HMAC-SHA256) and of a nonce.
MAC_SIZE = hashlib.sha256().digest_size
NONCE_SIZE = 16
#: The bound on a connection's whole hello and proof. A peer needs a round
#: trip; this covers one stalled by a busy machine.
HELLO_SECONDS = 10.0
#: Accepted connections without proof held at once.
MAX_UNPROVEN = 512
#: Newcomers accepted between two rounds of the proofs in flight.
_ACCEPTS_PER_POLL = 64
#: How long to wait before accepting again after ``accept()`` failed.
_ACCEPT_PAUSE_SECONDS = 0.1


def nonce() -> bytes:
  """A fresh random nonce."""
  return secrets.token_bytes(NONCE_SIZE)


def mac(secret: bytes, role: bytes, key: str, *parts: bytes) -> bytes:
  """HMAC-SHA256 under ``secret`` of ``role``, a context ``key`` and ``parts``
  (each length-prefixed, so the concatenation is unambiguous)."""
  h = hmac.new(secret, role, hashlib.sha256)
  for part in (key.encode(), *parts):
    h.update(len(part).to_bytes(4, "big"))
    h.update(part)
  return h.digest()


def most_unproven() -> int:
  """`MAX_UNPROVEN`, at most a quarter of this process's open-file limit."""
  files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
  if files == resource.RLIM_INFINITY:
    return MAX_UNPROVEN
  return max(1, min(MAX_UNPROVEN, files // 4))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Terms:
  """What the connections of one gate say.

  Attributes:
    secret: the job's secret; empty, the handshake runs and proves nothing.
    context: the key of every MAC: one gate's proofs never pass another's.
    hello_size: bytes of each side's hello.
    hello: this side's hello, with a fresh `nonce`.
    foreign: why the other side's hello (given whether this side dialed) is
      not of this gate's kind, said after the peer's name, or ``None``.
  """
  secret: bytes
  context: str
  hello_size: int
  hello: Callable[[], bytes]
  foreign: Callable[[bytes, bool], str | None]


@dataclasses.dataclass(eq=False)
class Hello:
  """One connection during its hello and proof.

  Attributes:
    sock: its non-blocking socket.
    peer: the name of the peer it dialed, or the address it came from.
    dialed: whether this side dialed.
    expires: `time.monotonic` time by which it must be proven.
    refused: set when its hello or proof was not this job's (not merely
      late, closed or failed).
  """
  sock: socket.socket
  peer: str
  dialed: bool
  expires: float
  refused: bool = False
  connecting: bool = False
  mine: bytes = b""  # The hello this side sent.
  theirs: bytes = b""  # The hello the other side sent.
  data: bytearray = dataclasses.field(default_factory=bytearray)


@dataclasses.dataclass(frozen=True)
class Proven:
  """A connection whose peer proved the secret.

  Attributes:
    sock: its socket, now blocking.
    key: the connection's own key (``mac(secret, VALUES, ...)``).
    peer: as in `Hello`.
    dialed: whether this side dialed.
    expires: when its hello's bound ends (a message due with the proof,
      such as the rendezvous's join, keeps to it).
  """
  sock: socket.socket
  key: bytes
  peer: str
  dialed: bool
  expires: float


class Gate:
  """The connections of one listener, and this side's dials, until proven.

  Args:
    terms: what the connections say.
    listener: the listening socket whose newcomers it takes (left open);
      ``None`` for a gate that only dials.
    dropped: told of each connection dropped (its `Hello`) and why, a
      phrase after the peer's name (``"closed the connection during the
      hello"``); of an ``accept()`` that failed with ``None`` and a whole
      sentence.
  """

  def __init__(self, terms: Terms, *, listener: socket.socket | None = None,
               dropped: Callable[[Hello | None, str], None]):
    self._terms = terms
    self._listener = listener
    self._dropped = dropped
    self._most = most_unproven()
    self._selector = selectors.DefaultSelector()
    self._pending: dict[socket.socket, Hello] = {}  # Oldest first.
    self._listening = False
    self._resume = 0.0  # When to accept again.
    if listener is not None:
      listener.setblocking(False)

  @property
  def dialing(self) -> bool:
    """Whether a dial of this side is in flight."""
    return any(h.dialed for h in self._pending.values())

  def dial(self, family: int, address: tuple, peer: str) -> None:
    """Dials ``address`` without blocking; `poll` proves it."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    hello = Hello(sock=sock, peer=peer, dialed=True, connecting=True,
                  expires=time.monotonic() + HELLO_SECONDS)
    code = sock.connect_ex(address)
    if code not in (0, errno.EINPROGRESS):
      sock.close()
      self._dropped(hello, f"could not be reached ({os.strerror(code)})")
      return
    self._pending[sock] = hello
    self._selector.register(sock, selectors.EVENT_WRITE)

  def poll(self, timeout: float) -> list[Proven]:
    """Moves every connection on for up to ``timeout`` s; those proven."""
    now = time.monotonic()
    for hello in [h for h in self._pending.values() if now >= h.expires]:
      self._drop(hello, f"did not finish its hello within {HELLO_SECONDS:g} s")
    if self._listener is not None and self._listening != (now >= self._resume):
      self._listening = not self._listening
      if self._listening:
        self._selector.register(self._listener, selectors.EVENT_READ)
      else:
        self._selector.unregister(self._listener)
    if self._listener is not None and not self._listening:
      timeout = min(timeout, self._resume - now)
    ready = self._selector.select(max(0.0, timeout))
    proven = []
    for key, _ in ready:  # Proofs first: accepting may drop the oldest.
      hello = self._pending.get(key.fileobj)
      if hello is not None and (done := self._serve(hello)) is not None:
        proven.append(done)
    if any(key.fileobj is self._listener for key, _ in ready):
      self._accept()
    return proven

  def close(self) -> None:
    """Closes every connection not proven (not the listener)."""
    for hello in list(self._pending.values()):
      self._drop(hello, None)
    self._selector.close()

  def _accept(self) -> None:
    for _ in range(_ACCEPTS_PER_POLL):
      try:
        sock, address = self._listener.accept()
      except BlockingIOError:
        return
      except OSError as e:  # Out of descriptors, say: pause, then again.
        self._resume = time.monotonic() + _ACCEPT_PAUSE_SECONDS
        self._dropped(None, f"accept() failed ({e}); trying again every "
                            f"{_ACCEPT_PAUSE_SECONDS:g} s")
        return
      unproven = [h for h in self._pending.values() if not h.dialed]
      if len(unproven) >= self._most:
        silent = [h for h in unproven if not h.theirs] or unproven
        self._drop(silent[0], f"was the oldest of more than {self._most} "
                   "connections without proof")
      sock.setblocking(False)
      self._pending[sock] = Hello(sock=sock, peer=str(address[0]),
                                  dialed=False,
                                  expires=time.monotonic() + HELLO_SECONDS)
      self._selector.register(sock, selectors.EVENT_READ)

  def _serve(self, hello: Hello) -> Proven | None:
    """Moves ``hello`` on by what its socket allows."""
    sock, size = hello.sock, self._terms.hello_size
    if hello.connecting:
      code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
      if code:
        self._drop(hello, f"could not be reached ({os.strerror(code)})")
        return None
      hello.connecting, hello.mine = False, self._terms.hello()
      if self._send(hello, hello.mine):
        self._selector.modify(sock, selectors.EVENT_READ)
      return None
    need = (size + MAC_SIZE if hello.dialed else
            MAC_SIZE if hello.theirs else size)
    try:
      chunk = sock.recv(need - len(hello.data))
    except BlockingIOError:
      return None
    except OSError:
      chunk = b""
    if not chunk:
      self._drop(hello, "closed the connection during the hello")
      return None
    hello.data += chunk
    if len(hello.data) < need:
      return None
    data, hello.data = bytes(hello.data), bytearray()
    if hello.dialed:  # The acceptor's hello and proof came.
      theirs, proof = data[:size], data[size:]
      why = self._terms.foreign(theirs, True)
      if why is None and not hmac.compare_digest(
          proof, self._mac(ACCEPT, hello.mine, theirs)):
        why = "answered without the job's secret (a wrong secret)"
      if why:
        return self._refuse(hello, why)
      if not self._send(hello, self._mac(DIAL, hello.mine, theirs)):
        return None
      return self._hand_out(hello, hello.mine, theirs)
    if not hello.theirs:  # The dialer's hello came: answer with a proof.
      why = self._terms.foreign(data, False)
      if why:
        return self._refuse(hello, why)
      hello.theirs, hello.mine = data, self._terms.hello()
      self._send(hello, hello.mine + self._mac(ACCEPT, data, hello.mine))
      return None
    if not hmac.compare_digest(data, self._mac(DIAL, hello.theirs,
                                               hello.mine)):
      return self._refuse(hello, "came without the job's secret (a wrong "
                          "secret, or a replayed hello)")
    return self._hand_out(hello, hello.theirs, hello.mine)

  def _mac(self, role: bytes, dial: bytes, accept: bytes) -> bytes:
    return mac(self._terms.secret, role, self._terms.context, dial, accept)

  def _send(self, hello: Hello, data: bytes) -> bool:
    try:
      if hello.sock.send(data) == len(data):  # Small, into an empty buffer.
        return True
    except OSError:
      pass
    self._drop(hello, "failed during the hello")
    return False

  def _refuse(self, hello: Hello, why: str) -> None:
    hello.refused = True
    self._drop(hello, why)

  def _drop(self, hello: Hello, why: str | None) -> None:
    """Closes ``hello``'s connection and says ``why`` (unless ``None``)."""
    del self._pending[hello.sock]
    self._selector.unregister(hello.sock)
    hello.sock.close()
    if why:
      self._dropped(hello, why)

  def _hand_out(self, hello: Hello, dial: bytes, accept: bytes) -> Proven:
    del self._pending[hello.sock]
    self._selector.unregister(hello.sock)
    hello.sock.setblocking(True)
    return Proven(sock=hello.sock, key=self._mac(VALUES, dial, accept),
                  peer=hello.peer, dialed=hello.dialed, expires=hello.expires)
