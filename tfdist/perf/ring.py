"""Ring all-reduce of float32 numpy buffers over plain TCP sockets.

`SocketRing` sums one float32 buffer over ``n`` processes the way Baidu's and
Horovod's ring all-reduce does: the buffer is cut into ``n`` segments; in
``n - 1`` reduce-scatter steps each process sends one segment to its right
neighbour and adds the segment received from its left one, so each ends up
owning one fully summed segment; in ``n - 1`` all-gather steps the owned
segments travel round the ring. Each process sends and receives
``2 (n - 1) / n`` of the buffer, the least any all-reduce can.

* **Accumulation** is float32. The wire dtype (``float32``, ``float16`` or
  ``bfloat16``) is only what crosses the socket: a received partial sum is
  widened before it is added. The owner of a segment rounds its sum to the
  wire dtype once and keeps that rounded value too, so every process ends
  with the same bits.
* **Pipelining**: a step moves its segment in blocks of ``block_bytes``; one
  thread writes to the right neighbour and reads from the left with
  non-blocking sockets, encoding a block just before it is sent and adding
  a block as soon as it is in, so the working set stays in cache. No
  threads, no hand-offs: an all-reduce of a few values takes about two
  round trips.
* **In place**: ``out=data`` sums into the input (no output buffer; what
  the TensorFlow glue does with its packed gradients).
* **Connection**: every process listens on a port the operating system picks
  (port 0), publishes it under ``key/rank`` through a `Rendezvous`, connects
  to its right neighbour and accepts its left one; a hello (magic, ring
  token, rank) goes each way and is checked. A stray connection is dropped
  and waited past.
* **Ordering check**: every all-reduce starts with a header (call number,
  length, wire dtype, a caller's tag) that must match the left neighbour's,
  so processes that call in a different order fail loudly instead of adding
  unrelated numbers.
* **Timeouts**: connecting is bounded by ``connect_timeout_s``; during an
  all-reduce a peer that sends nothing (or takes nothing) for ``timeout_s``
  is declared lost. A closed connection is noticed at once. Every socket
  call is bounded, so nothing waits forever. After a failure the ring is
  closed and every later call raises the same error.

Pure Python, numpy and ``ml_dtypes`` (for bfloat16, a TensorFlow
dependency); no TensorFlow here (`tfdist.perf.transport` connects it to a
strategy).

Example (one process per rank; ``rendezvous`` shared, e.g. TensorFlow's
coordination service)::

  ring = SocketRing(rank=r, hosts=["10.0.0.1", "10.0.0.2"],
                    rendezvous=rendezvous, key="job-1/ring-0")
  total = ring.all_reduce(np.ones(1000, np.float32), wire="bfloat16")
"""

from __future__ import annotations

import ipaddress
import select
import socket
import struct
import threading
import time
import zlib
from typing import Any, Callable, Protocol, Sequence

import ml_dtypes
import numpy as np

from tfdist.errors import ConfigError
from tfdist.errors import StartupTimeoutError
from tfdist.errors import WorkerLostError

__all__ = ["Rendezvous", "SocketRing", "WIRE_DTYPES", "DEFAULT_BLOCK_BYTES"]

#: Wire dtype names and their numpy types.
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
_WIRE_CODES = {name: i for i, name in enumerate(WIRE_DTYPES)}

#: Bytes (of float32) per pipelined block: small enough to stay in L2 cache,
#: large enough that Python's per-block cost is noise.
DEFAULT_BLOCK_BYTES = 512 << 10

_HELLO = struct.Struct("!4sIII")  # magic, ring token, rank, size
_HEADER = struct.Struct("!4sQQII")  # magic, call, length, wire code, tag
_MAGIC_HELLO = b"TFDH"
_MAGIC_CALL = b"TFDC"
_POLL_S = 0.5  # Longest wait in poll() between checks of the deadlines.


class Rendezvous(Protocol):
  """Where ring members publish their listening ports and find each other's."""

  def publish(self, key: str, value: str) -> None:
    """Makes ``value`` visible to every member under ``key``."""

  def lookup(self, key: str, timeout_s: float) -> str:
    """The value under ``key``, waiting at most ``timeout_s`` for it.

    Raises:
      TimeoutError: nobody published ``key`` in time.
    """


class _Lost(Exception):
  """A peer failed; ``rank`` says which (internal, becomes WorkerLostError)."""

  def __init__(self, rank: int, what: str):
    super().__init__(what)
    self.rank = rank
    self.what = what


def _bytes(array: np.ndarray) -> memoryview:
  """A flat byte view of a contiguous array (bfloat16 has no buffer code)."""
  return memoryview(array.view(np.uint8))


def _shaped(out: np.ndarray, data) -> np.ndarray:
  """``out`` in ``data``'s shape; ``out`` itself when it has it already."""
  shape = np.shape(data)
  return out if out.shape == shape else out.reshape(shape)


def _is_loopback(host: str) -> bool:
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return host == "localhost"


class SocketRing:
  """One process's place in a ring all-reduce over TCP.

  Thread-safe: concurrent calls are serialized (their order must still be
  the same on every process; the header check catches most mistakes).

  Args:
    rank: this process's position, 0 to ``len(hosts) - 1``.
    hosts: every member's host name or address, by rank.
    rendezvous: where listening ports are published and looked up.
    key: a prefix unique to this ring among everything published in
      ``rendezvous``; every member passes the same one.
    names: how errors name each member (e.g. ``"worker:1"``); ranks if
      omitted.
    connect_timeout_s: bound on connecting the ring.
    timeout_s: a peer that sends nothing for this long during an all-reduce
      is declared lost.
    block_bytes: float32 bytes per pipelined block.
    source: where the hosts came from, for error messages.

  Raises:
    ConfigError: a rank out of range, or non-positive timeouts.
  """

  def __init__(self, *, rank: int, hosts: Sequence[str],
               rendezvous: Rendezvous, key: str,
               names: Sequence[str] | None = None,
               connect_timeout_s: float = 300.0, timeout_s: float = 300.0,
               block_bytes: int = DEFAULT_BLOCK_BYTES,
               source: str = "SocketRing"):
    self._hosts = list(hosts)
    if not self._hosts or not 0 <= rank < len(self._hosts):
      raise ConfigError(field="rank", value=rank, source=source,
                        expected=f"0 to {len(self._hosts) - 1}, one per host")
    for field, value in (("connect_timeout_s", connect_timeout_s),
                         ("timeout_s", timeout_s),
                         ("block_bytes", block_bytes)):
      if not value > 0:
        raise ConfigError(field=field, value=value, source=source,
                          expected="a positive number")
    self._rank = rank
    self._names = list(names) if names else [f"rank {i}"
                                             for i in range(len(hosts))]
    self._rendezvous = rendezvous
    self._key = key
    self._token = zlib.crc32(key.encode())
    self._connect_timeout_s = float(connect_timeout_s)
    self._timeout_s = float(timeout_s)
    self._block = max(1, int(block_bytes) // 4)
    self._source = source
    self._lock = threading.Lock()
    self._left: socket.socket | None = None
    self._right: socket.socket | None = None
    self._poll = None
    self._failure: BaseException | None = None
    self._calls = 0
    self._wire_bufs: dict[str, list[np.ndarray]] = {}
    self._scratch = np.empty(self._block, np.float32)

  @property
  def rank(self) -> int:
    return self._rank

  @property
  def size(self) -> int:
    return len(self._hosts)

  @property
  def connected(self) -> bool:
    return self._left is not None

  def _describe(self, rank: int) -> str:
    return f"{self._names[rank]} ({self._hosts[rank]})"

  # Connection.

  def connect(self) -> None:
    """Connects to both neighbours; does nothing when connected.

    Raises:
      StartupTimeoutError: a neighbour did not publish its port, accept or
        connect within ``connect_timeout_s``.
      ConfigError: a host that does not resolve.
      WorkerLostError: the ring failed before.
    """
    with self._lock:
      self._connect_locked()

  def _connect_locked(self) -> None:
    if self._failure is not None:
      raise self._failure
    if self._left is not None or self.size == 1:
      return
    deadline = time.monotonic() + self._connect_timeout_s
    right_rank = (self._rank + 1) % self.size
    left_rank = (self._rank - 1) % self.size
    listener = self._listen()
    right = left = None
    try:
      port = listener.getsockname()[1]
      self._rendezvous.publish(f"{self._key}/{self._rank}", str(port))
      right = self._dial(right_rank, deadline)
      left = self._accept(listener, left_rank, deadline)
      # The right neighbour's answer: it accepted this connection as ours.
      if self._read_hello(right, self._remaining(
          deadline, right_rank, "answer")) != self._hello(right_rank):
        raise self._late(right_rank, "answer this worker's hello")
    except BaseException as e:
      for s in (right, left):
        if s is not None:
          s.close()
      # The port is published under this key for good: no second try.
      self._failure = e if isinstance(e, Exception) else WorkerLostError(
          f"socket transport: connecting was interrupted ({e!r})")
      raise
    finally:
      listener.close()
    for s in (left, right):
      s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      s.setblocking(False)  # _exchange waits in poll(), with a deadline.
    self._left, self._right = left, right
    self._poll = select.poll()

  def _listen(self) -> socket.socket:
    host = self._hosts[self._rank]
    # A loopback cluster listens on loopback only; otherwise on every
    # interface, as TensorFlow's gRPC server does, since the name peers use
    # may not be an address of this host's own interfaces (NAT, containers).
    if _is_loopback(host):
      try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
      except socket.gaierror as e:
        raise self._bad_host(self._rank, e) from None
      family, _, _, _, address = infos[0]
      return socket.create_server(address, family=family, backlog=8)
    if socket.has_dualstack_ipv6():
      return socket.create_server(("", 0), family=socket.AF_INET6,
                                  dualstack_ipv6=True, backlog=8)
    return socket.create_server(("", 0), backlog=8)

  def _bad_host(self, rank: int, error: Exception) -> ConfigError:
    return ConfigError(
        field=f"address of {self._names[rank]}", value=self._hosts[rank],
        source=self._source, expected="a host name this process can resolve",
        hint=f"Fix the cluster's addresses ({error})")

  def _late(self, rank: int, what: str) -> StartupTimeoutError:
    return StartupTimeoutError(
        f"socket transport: {self._names[self._rank]} waited "
        f"{self._connect_timeout_s:.0f} s for {self._describe(rank)} to "
        f"{what}; is that worker running and at the same step, and can "
        "this host reach it on TCP ports the OS picks?")

  def _remaining(self, deadline: float, rank: int, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
      raise self._late(rank, what)
    return left

  def _dial(self, rank: int, deadline: float) -> socket.socket:
    """Connects to ``rank`` (the right neighbour) and sends the hello."""
    what = "publish its port"
    try:
      port = int(self._rendezvous.lookup(
          f"{self._key}/{rank}", self._remaining(deadline, rank, what)))
    except TimeoutError:
      raise self._late(rank, what) from None
    while True:
      left = self._remaining(deadline, rank,
                             f"accept a connection on port {port}")
      try:
        conn = socket.create_connection((self._hosts[rank], port),
                                        timeout=min(left, 10.0))
      except socket.gaierror as e:
        raise self._bad_host(rank, e) from None
      except OSError:  # Refused or unreachable for now: retry until the end.
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        continue
      try:
        conn.sendall(self._hello(self._rank))
      except OSError:
        conn.close()
        continue
      return conn

  def _hello(self, rank: int) -> bytes:
    return _HELLO.pack(_MAGIC_HELLO, self._token, rank, self.size)

  def _read_hello(self, conn: socket.socket, timeout_s: float) -> bytes:
    conn.settimeout(max(0.01, min(timeout_s, 10.0)))
    data = b""
    try:
      while len(data) < _HELLO.size:
        chunk = conn.recv(_HELLO.size - len(data))
        if not chunk:
          break
        data += chunk
    except OSError:
      pass
    return data

  def _accept(self, listener: socket.socket, rank: int,
              deadline: float) -> socket.socket:
    """Accepts ``rank`` (the left neighbour), checks its hello, answers."""
    while True:
      left = self._remaining(deadline, rank, "connect to this worker")
      listener.settimeout(left)
      try:
        conn, _ = listener.accept()
      except socket.timeout:
        continue  # _remaining raises on the next turn.
      if self._read_hello(conn, left) == self._hello(rank):
        try:
          conn.sendall(self._hello(self._rank))
          return conn
        except OSError:
          pass
      conn.close()  # Not our neighbour (a stale or stray connection).

  # All-reduce.

  def all_reduce(self, data: np.ndarray, *, wire: str = "float32",
                 tag: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """The element-wise sum of ``data`` over every process of the ring.

    Every process must call with the same length, ``wire`` and ``tag``, in
    the same order.

    Args:
      data: a float32 array (any shape; summed flat).
      wire: the dtype sent, one of `WIRE_DTYPES`.
      tag: a number identifying the call site, checked against the peers'.
      out: a contiguous float32 array of ``data``'s size for the sum;
        ``data`` itself sums in place. A new array when omitted.

    Returns:
      ``out`` (or a new float32 array), shaped as ``data``, holding the
      same bits on every process.

    Raises:
      WorkerLostError: a peer closed its connection, failed or sent nothing
        for ``timeout_s``; names the peer.
      StartupTimeoutError: the ring could not connect.
      ConfigError: an unknown ``wire``, an unusable ``out``, or a peer that
        called with another length, wire dtype or tag (calls out of order).
    """
    if wire not in WIRE_DTYPES:
      raise ConfigError(field="wire", value=wire, source=self._source,
                        expected=f"one of {sorted(WIRE_DTYPES)}")
    x = np.ascontiguousarray(data, dtype=np.float32).reshape(-1)
    if out is None:
      out = np.empty(x.size, np.float32)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.float32
          or out.size != x.size or not out.flags.c_contiguous
          or not out.flags.writeable):
      raise ConfigError(field="out", value=type(out).__name__,
                        source=self._source,
                        expected=f"a writable contiguous float32 array of "
                                 f"{x.size} values")
    flat_out = out.reshape(-1)
    if (np.may_share_memory(x, flat_out)
        and x.ctypes.data != flat_out.ctypes.data):
      x = x.copy()  # Overlapping but not the same: keep the input apart.
    with self._lock:
      if self.size == 1 and self._failure is None:
        if flat_out.ctypes.data != x.ctypes.data:
          np.copyto(flat_out, x)
        return _shaped(out, data)
      self._call_locked(
          "all-reduce", x.size, wire, tag,
          lambda header: self._reduce(x, flat_out, wire, header))
      return _shaped(out, data)

  def send_receive(self, data: np.ndarray, out: np.ndarray) -> None:
    """Sends ``data`` to the right neighbour, receives the left's into ``out``.

    The data movement of an all-reduce without its arithmetic, on the same
    sockets and loop: with 2 workers an all-reduce of S bytes moves S bytes
    each way, so an exchange of S bytes bounds how fast any all-reduce can
    be on these sockets (`tfdist bench` reports it as the ceiling). Every
    worker calls it in step, as `all_reduce`.

    Args:
      data: a contiguous float32 array.
      out: a writable contiguous float32 array of the same size.

    Raises:
      WorkerLostError: a peer died or stopped.
      StartupTimeoutError: the ring could not connect.
    """
    x, flat_out = data.reshape(-1), out.reshape(-1)

    def move(header):
      head_in = bytearray(_HEADER.size)
      blocks = self._blocks(0, x.size)
      self._exchange(
          [lambda: _HEADER.pack(*header)]
          + [lambda lo=lo, hi=hi: _bytes(x[lo:hi]) for lo, hi in blocks],
          [(head_in, lambda: self._check_header(head_in, header), 0)]
          + [(_bytes(flat_out[lo:hi]), None, -1) for lo, hi in blocks])

    with self._lock:
      if self.size == 1 and self._failure is None:
        np.copyto(flat_out, x)
        return
      self._call_locked("exchange", x.size, "float32", 0, move)

  def _call_locked(self, what: str, length: int, wire: str, tag: int,
                   move: Callable[[tuple], None]) -> None:
    """One numbered call of the ring: ``move(header)`` under its failure rules.

    A lost peer becomes `WorkerLostError` naming it, a mismatched header a
    `ConfigError`; either, or an interruption, closes the ring for good.
    """
    if self._failure is not None:
      raise self._failure
    self._connect_locked()
    call = self._calls
    self._calls += 1
    try:
      move(self._header(call, length, wire, tag))
    except _Lost as e:
      self._fail(WorkerLostError(
          f"socket transport: {self._names[self._rank]} lost "
          f"{self._describe(e.rank)} during {what} #{call} "
          f"({length} float32 values): {e.what}. A peer died or stopped; "
          "restart the cluster (tfdist launch --max-restarts K, or "
          "SLURM's requeue)"))
    except ConfigError as e:
      self._fail(e)
    except BaseException as e:  # E.g. KeyboardInterrupt: the ring is torn.
      self._failure = WorkerLostError(
          f"socket transport: {what} #{call} of "
          f"{self._names[self._rank]} was interrupted ({e!r}); the ring "
          "is out of step and closed")
      self._close_locked()
      raise

  def _fail(self, error: BaseException):
    self._failure = error
    self._close_locked()
    raise error from None

  def _header(self, call: int, length: int, wire: str, tag: int) -> tuple:
    return (_MAGIC_CALL, call, length, _WIRE_CODES[wire], tag & 0xFFFFFFFF)

  def _check_header(self, received: bytearray, mine: tuple) -> None:
    theirs = _HEADER.unpack(bytes(received))
    if theirs == mine:
      return
    left_rank = (self._rank - 1) % self.size
    names = list(WIRE_DTYPES)
    described = [f"call #{h[1]}, {h[2]} values, wire "
                 f"{names[h[3]] if h[3] < len(names) else h[3]}, tag {h[4]}"
                 for h in (theirs, mine)]
    raise ConfigError(
        field="all-reduce order", value=described[0],
        source=f"socket transport, {self._describe(left_rank)}",
        expected=f"what this worker all-reduces: {described[1]}",
        hint="Every worker must all-reduce the same gradients in the same "
             "order: build the same model and optimizer everywhere")

  def _exchange(self, sends: Sequence[Callable[[], Any]],
                recvs: Sequence[tuple[Any, Callable[[], None] | None, int]]
                ) -> None:
    """One step: ``sends`` to the right neighbour, ``recvs`` from the left.

    One thread moves both directions with non-blocking sockets: it writes
    and reads whatever the kernel takes or has, runs each block's callback
    as soon as the block is in, and waits in ``poll`` only when neither
    direction moves. No thread hand-offs (the lowest latency), and no
    deadlock when both sides send first.

    Args:
      sends: callables returning the next buffer to send, called when the
        previous one is written (so encoding happens just in time).
      recvs: (buffer to fill, callback, after) in order; the callback runs
        once the buffer is full and ``sends[after]`` is written (so it may
        overwrite what that send read); ``after`` -1 waits for nothing.

    Raises:
      _Lost: a peer closed, failed, or did not move for ``timeout_s``.
    """
    right, left = self._right, self._left
    right_rank, left_rank = (self._rank + 1) % self.size, (
        self._rank - 1) % self.size
    si = ri = soff = roff = 0
    sview = rview = None
    waiting: list[tuple[int, Callable[[], None]]] = []  # (after, callback)
    last_send = last_recv = time.monotonic()
    while si < len(sends) or ri < len(recvs) or waiting:
      moved = False
      if si < len(sends):
        if sview is None:
          sview, soff = memoryview(sends[si]()).cast("B"), 0
        if soff < len(sview):
          try:
            soff += right.send(sview[soff:])
            moved = True
            last_send = time.monotonic()
          except BlockingIOError:
            pass
          except OSError as e:
            raise _Lost(right_rank, f"send failed: {e}") from None
        if soff >= len(sview):
          si, sview = si + 1, None
          moved = True
          while waiting and waiting[0][0] < si:
            waiting.pop(0)[1]()
      if ri < len(recvs):
        if rview is None:
          rview, roff = memoryview(recvs[ri][0]).cast("B"), 0
        if roff < len(rview):
          try:
            k = left.recv_into(rview[roff:])
          except BlockingIOError:
            k = -1
          except OSError as e:
            raise _Lost(left_rank, f"receive failed: {e}") from None
          if k == 0:
            raise _Lost(left_rank, "it closed the connection")
          if k > 0:
            roff += k
            moved = True
            last_recv = time.monotonic()
        if roff >= len(rview):
          _, done, after = recvs[ri]
          ri, rview = ri + 1, None
          if done is not None:
            if after < si and not waiting:
              done()
            else:
              waiting.append((after, done))
          moved = True
      if moved:
        continue
      # Nothing moved: wait for either socket, a bounded time.
      poll = self._poll
      for sock in (right, left):
        try:
          poll.unregister(sock)
        except KeyError:
          pass
      if si < len(sends):
        poll.register(right, select.POLLOUT)
      if ri < len(recvs):
        poll.register(left, select.POLLIN)
      if poll.poll(_POLL_S * 1000):
        continue
      now = time.monotonic()
      if ri < len(recvs) and now - last_recv > self._timeout_s:
        raise _Lost(left_rank, f"no data for {self._timeout_s:.0f} s "
                    "(timeout_s)")
      if si < len(sends) and now - last_send > self._timeout_s:
        raise _Lost(right_rank, f"it accepted no data for "
                    f"{self._timeout_s:.0f} s (timeout_s)")

  def _wire(self, wire: str, length: int) -> list[np.ndarray]:
    """Two wire buffers of at least ``length``, reused across calls."""
    bufs = self._wire_bufs.get(wire)
    if bufs is None or bufs[0].size < length:
      bufs = [np.empty(length, WIRE_DTYPES[wire]) for _ in range(2)]
      self._wire_bufs[wire] = bufs
    return bufs

  def _blocks(self, lo: int, hi: int) -> list[tuple[int, int]]:
    return [(s, min(s + self._block, hi)) for s in range(lo, hi, self._block)]

  def _reduce(self, x: np.ndarray, out: np.ndarray, wire: str,
              header: tuple) -> None:
    """Sums ``x`` into ``out`` over the ring; the header goes first."""
    head_out = _HEADER.pack(*header)
    head_in = bytearray(_HEADER.size)
    # The peer's header is checked once ours is written, so that on a
    # mismatch both sides learn it before either closes.
    first = ([lambda: head_out],
             [(head_in, lambda: self._check_header(head_in, header), 0)])
    self._ring(x, out, wire, first)

  def _ring(self, x: np.ndarray, out: np.ndarray, wire: str, first) -> None:
    """Three or more processes: reduce-scatter, then all-gather.

    At reduce-scatter step s a process sends segment r - s (its own input at
    s = 0, then the partial sum it made at step s - 1) and adds what it
    receives into segment r - s - 1; it then owns segment r + 1, which the
    all-gather passes round. A segment is never written in the step that
    sends it, so ``out`` may be ``x``.
    """
    n, r = self.size, self._rank
    bounds = [i * x.size // n for i in range(n + 1)]

    def seg(i):
      return bounds[i % n], bounds[i % n + 1]

    compressed = wire != "float32"
    width = bounds[1] - bounds[0] + 1
    send_buf, recv_buf = self._wire(wire, width)
    widened = self._scratch
    sends, recvs = list(first[0]), list(first[1])
    # Reduce-scatter.
    for s in range(n - 1):
      slo, shi = seg(r - s)
      rlo, rhi = seg(r - s - 1)
      src = x if s == 0 else out
      for lo, hi in self._blocks(slo, shi):
        if compressed:

          def encode(lo=lo, hi=hi, slo=slo, src=src):
            part = send_buf[lo - slo:hi - slo]
            np.copyto(part, src[lo:hi], casting="unsafe")
            return _bytes(part)

          sends.append(encode)
        else:
          sends.append(lambda lo=lo, hi=hi, src=src: _bytes(src[lo:hi]))
      for lo, hi in self._blocks(rlo, rhi):
        part = recv_buf[lo - rlo:hi - rlo]
        if compressed:

          def add(lo=lo, hi=hi, part=part):
            np.copyto(widened[:hi - lo], part, casting="unsafe")
            np.add(x[lo:hi], widened[:hi - lo], out=out[lo:hi])

        else:

          def add(lo=lo, hi=hi, part=part):
            np.add(x[lo:hi], part, out=out[lo:hi])

        recvs.append((_bytes(part), add, -1))
      self._exchange(sends, recvs)
      sends, recvs = [], []
    # All-gather: at step s send segment r + 1 - s, receive segment r - s.
    for s in range(n - 1):
      slo, shi = seg(r + 1 - s)
      rlo, rhi = seg(r - s)
      for lo, hi in self._blocks(slo, shi):
        if not compressed:
          sends.append(lambda lo=lo, hi=hi: _bytes(out[lo:hi]))
        elif s == 0:  # The owned segment: round once, keep the rounding.

          def own(lo=lo, hi=hi, slo=slo):
            part = send_buf[lo - slo:hi - slo]
            np.copyto(part, out[lo:hi], casting="unsafe")
            np.copyto(out[lo:hi], part, casting="unsafe")
            return _bytes(part)

          sends.append(own)
        else:  # Forward what arrived at the previous step, as it came.
          sends.append(lambda lo=lo, hi=hi, slo=slo, buf=send_buf: _bytes(
              buf[lo - slo:hi - slo]))
      for lo, hi in self._blocks(rlo, rhi):
        if compressed:
          part = recv_buf[lo - rlo:hi - rlo]
          recvs.append((_bytes(part), lambda lo=lo, hi=hi, part=part:
                        np.copyto(out[lo:hi], part, casting="unsafe"), -1))
        else:
          recvs.append((_bytes(out[lo:hi]), None, -1))
      self._exchange(sends, recvs)
      sends, recvs = [], []
      if compressed:
        send_buf, recv_buf = recv_buf, send_buf

  # Shutdown.

  def close(self) -> None:
    """Closes the connections for good; later calls raise `WorkerLostError`.

    Peers in the middle of an all-reduce with this process see the
    connection close and fail at once. Idempotent.
    """
    with self._lock:
      if self._failure is None:
        self._failure = WorkerLostError(
            f"socket transport: the ring of {self._names[self._rank]} was "
            "closed; make a new one")
      self._close_locked()

  def _close_locked(self) -> None:
    for s in (self._left, self._right):
      if s is not None:
        try:
          s.close()
        except OSError:
          pass
    self._left = self._right = self._poll = None
