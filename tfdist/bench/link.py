"""The raw link between a cluster's hosts: plain TCP streams, both ways at once.

What an all-reduce between hosts is measured against. Each worker connects
to its right neighbour in the ring (`tfdist.strategy.transport`'s order)
and accepts its left one; all then send zeros for ``seconds`` while they
receive, with blocking ``sendall`` / ``recv_into`` of large chunks. A
worker's rate is the bytes it received from its first chunk to its last;
the link is the slowest worker's rate. Then a small token goes round the
ring (`hop_latency`): the median round over the hops is alpha, one hop's
latency (`tfdist.bench.projection`).

Addresses go through a `Rendezvous`; every connection starts with the
measurement's key and the sender's rank, and anything else is dropped. No
TensorFlow here.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time

from tfdist import _net
from tfdist.errors import StartupTimeoutError
from tfdist.ring.connection import Rendezvous

__all__ = ["measure", "stream_rates", "hop_latency", "listener"]

_CHUNK = 4 << 20  # Bytes per sendall / recv_into.
_HELLO = struct.Struct("!64sI")  # The measurement's key, the sender's rank.
_TOKEN = b"tfdist-t"  # What goes round the ring when timing a hop.
_TOKEN_ROUNDS = 200  # Rounds timed, after as many warm-up rounds / 10.


def measure(*, rank: int, hosts: list[str], rendezvous: Rendezvous, key: str,
            seconds: float = 2.0, repeats: int = 3, timeout_s: float = 60.0
            ) -> dict:
  """Every worker's receive rate while all send to their right neighbour.

  Called by every worker of the ring at once, with the same ``key``.

  Args:
    rank: this worker's place in the ring.
    hosts: every worker's host (name or address), by rank.
    rendezvous: where the workers publish their listening addresses and
      their rates.
    key: a key no other measurement of this job uses.
    seconds: how long each stream sends.
    repeats: streams timed; each worker reports the median.
    timeout_s: bound on connecting and on any one socket operation.

  Returns:
    ``{"bytes_per_s": the slowest worker's rate, "by_rank": [rate, ...],
    "hop_latency_s": one hop's latency (`hop_latency`), "cpu_per_wall":
    this process's CPU seconds per second while its streams ran,
    "cpu_s_per_gb": those CPU seconds (all its threads, sending and
    receiving) per GB (1e9 bytes) it received, as many as it sent,
    "seconds": seconds, "repeats": repeats}``.

  Raises:
    StartupTimeoutError: a neighbour did not connect within ``timeout_s``.
  """
  n = len(hosts)
  right, left = (rank + 1) % n, (rank - 1) % n
  with listener(hosts[rank], timeout_s) as server:
    rendezvous.publish(f"{key}/address/{rank}",
                       f"{hosts[rank]}:{server.getsockname()[1]}")
    try:
      address = rendezvous.lookup(f"{key}/address/{right}", timeout_s)
    except TimeoutError:
      raise StartupTimeoutError(
          f"link measurement: worker {right} ({hosts[right]}) did not "
          f"publish its address within {timeout_s:g} s") from None
    start, start_cpu = time.perf_counter(), time.process_time()
    streams = stream_rates(server=server, right=_net.split_address(address),
                           rank=rank, left=left, key=key, seconds=seconds,
                           repeats=repeats, timeout_s=timeout_s)
    cpu_s = time.process_time() - start_cpu
    cpu = cpu_s / (time.perf_counter() - start)
    rates = [rate for rate, _ in streams]
    received = sum(size for _, size in streams)
    hop = hop_latency(server=server, right=_net.split_address(address),
                      rank=rank, left=left, key=f"{key}/hop", n=n,
                      timeout_s=timeout_s)
  mine = statistics.median(rates)
  rendezvous.publish(f"{key}/rate/{rank}", repr(mine))
  by_rank = [mine if r == rank else
             float(rendezvous.lookup(f"{key}/rate/{r}", timeout_s))
             for r in range(n)]
  if rank == 0:
    rendezvous.publish(f"{key}/hop", repr(hop))
  else:
    hop = float(rendezvous.lookup(f"{key}/hop", timeout_s))
  return {"bytes_per_s": min(by_rank), "by_rank": by_rank,
          "hop_latency_s": hop, "cpu_per_wall": cpu,
          "cpu_s_per_gb": cpu_s / (received / 1e9), "seconds": seconds,
          "repeats": repeats}


def stream_rates(*, server: socket.socket, right: tuple[str, int], rank: int,
                 left: int, key: str, seconds: float, repeats: int,
                 timeout_s: float) -> list[tuple[float, int]]:
  """``repeats`` streams from ``left`` while sending to ``right``: each
  one's receive rate (bytes/s) and the bytes it received.

  Each repeat is a fresh pair of connections: this worker dials ``right``
  (through ``right``'s listener) and accepts ``left``'s dial on ``server``.
  """
  streams = []
  hello = _HELLO.pack(key.encode()[:64], rank)
  for _ in range(repeats):
    with socket.create_connection(right, timeout=timeout_s) as out:
      out.sendall(hello)
      with _accept_from(server, key, left, timeout_s) as inbound:
        sent: list[BaseException] = []
        sender = threading.Thread(target=_send_for,
                                  args=(out, seconds, sent), daemon=True)
        sender.start()
        streams.append(_receive_rate(inbound))
        sender.join(timeout_s)
        if sent:
          raise sent[0]
  return streams


def hop_latency(*, server: socket.socket, right: tuple[str, int], rank: int,
                left: int, key: str, n: int, timeout_s: float,
                rounds: int = _TOKEN_ROUNDS) -> float | None:
  """Seconds per hop of a small token passed round the ring of ``n``.

  Worker 0 sends the token and times its return; every other worker passes
  it on as soon as it is in. Blocking calls, ``TCP_NODELAY``.

  Returns:
    On worker 0, the median round's time over ``n``; ``None`` elsewhere.
  """
  with socket.create_connection(right, timeout=timeout_s) as out:
    out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out.sendall(_HELLO.pack(key.encode()[:64], rank))
    with _accept_from(server, key, left, timeout_s) as inbound:
      inbound.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      warmup = max(1, rounds // 10)
      times = []
      for i in range(warmup + rounds):
        start = time.perf_counter()
        if rank == 0:
          out.sendall(_TOKEN)
        if len(_read_exactly(inbound, len(_TOKEN))) != len(_TOKEN):
          raise ConnectionError(
              f"link measurement: worker {left} closed the connection while "
              f"timing a hop")
        if rank != 0:
          out.sendall(_TOKEN)
        elif i >= warmup:
          times.append(time.perf_counter() - start)
  return statistics.median(times) / n if rank == 0 else None


def listener(host: str, timeout_s: float) -> socket.socket:
  """A socket listening on every address of ``host``'s family, on a port
  the system picks, its waits bounded by ``timeout_s``."""
  server = socket.create_server(("", 0), family=_net.family(host), backlog=8)
  server.settimeout(timeout_s)
  return server


def _accept_from(server: socket.socket, key: str, left: int,
                 timeout_s: float) -> socket.socket:
  """The next connection whose hello names ``key`` and ``left``."""
  expected = _HELLO.pack(key.encode()[:64], left)
  deadline = time.monotonic() + timeout_s
  while True:
    server.settimeout(max(0.01, deadline - time.monotonic()))
    try:
      conn, _ = server.accept()
    except TimeoutError:
      raise StartupTimeoutError(
          f"link measurement: worker {left} did not connect within "
          f"{timeout_s:g} s") from None
    conn.settimeout(max(0.01, deadline - time.monotonic()))
    try:
      got = _read_exactly(conn, _HELLO.size)
    except OSError:
      got = b""
    if got == expected:
      conn.settimeout(timeout_s)
      return conn
    conn.close()  # A stranger, or a stale dial: not the neighbour's stream.


def _read_exactly(conn: socket.socket, size: int) -> bytes:
  data = bytearray()
  while len(data) < size:
    part = conn.recv(size - len(data))
    if not part:
      break
    data += part
  return bytes(data)


def _send_for(conn: socket.socket, seconds: float,
              errors: list[BaseException]) -> None:
  payload = memoryview(bytearray(_CHUNK))
  try:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
      conn.sendall(payload)
    conn.shutdown(socket.SHUT_WR)
  except OSError as e:
    errors.append(e)


def _receive_rate(conn: socket.socket) -> tuple[float, int]:
  """Bytes/s from the first chunk's arrival to the last byte's, and every
  byte received."""
  view = memoryview(bytearray(_CHUNK))
  first = conn.recv_into(view)  # The clock starts once bytes flow.
  start = time.perf_counter()
  total, end = 0, start
  while True:
    k = conn.recv_into(view)
    if not k:
      break
    total += k
    end = time.perf_counter()
  return (total / (end - start) if end > start else 0.0), first + total
