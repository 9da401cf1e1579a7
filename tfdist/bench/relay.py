"""A latency relay: every chunk crossing a link is held for a set time.

The kernel here has no netem, so a link's latency is added in user space.
A `Relay` is one process on a rank's host (selectors, no threads): for each
port it is asked to serve (`Relay.forward`) it listens beside it and, for
each connection, dials the real port and copies both ways, sending each
chunk no earlier than ``delay_s`` after it arrived, in order. Its own cost
is measured by the sweep that uses it (`tfdist.bench.schedules`). It reads
``PORT DELAY_S`` lines on stdin, answers each with its relay port, and ends
when stdin closes; it asks the kernel for 1 us of timer slack, so 25 us is
not 75.
"""

from __future__ import annotations

import collections
import ctypes
import os
import selectors
import socket
import subprocess
import sys
import time

from tfdist import _net
from tfdist.bench import procs

__all__ = ["Relay", "main"]

_CHUNK = 256 << 10  # Bytes per recv.
_HELD_MAX = 8 << 20  # Bytes held per direction before reading pauses.
_PR_SET_TIMERSLACK = 29  # prctl(2).


class Relay:
  """A relay process on this host, serving any number of ports.

  Args:
    host: the address it listens on (the rank's own, as its ring's).
    timeout_s: bound on starting it and on each answer.
  """

  def __init__(self, host: str, *, timeout_s: float = 30.0):
    self._timeout_s = timeout_s
    self._proc = subprocess.Popen(
        procs.python_module("tfdist.bench.relay", host),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

  def __enter__(self) -> "Relay":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def forward(self, port: int, delay_s: float) -> int:
    """The port on which the relay forwards to ``port`` with ``delay_s``.

    Raises:
      procs.BenchProcessError: the relay ended, or did not answer within
        its bound.
    """
    self._proc.stdin.write(f"{port} {delay_s!r}\n")
    self._proc.stdin.flush()
    ready = selectors.DefaultSelector()
    ready.register(self._proc.stdout, selectors.EVENT_READ)
    try:
      if not ready.select(self._timeout_s):
        raise procs.BenchProcessError(
            f"latency relay: no answer for port {port} within "
            f"{self._timeout_s:g} s")
    finally:
      ready.close()
    line = self._proc.stdout.readline()
    if not line.strip().isdigit():
      raise procs.BenchProcessError(
          f"latency relay: it ended instead of serving port {port} "
          f"(exit status {self._proc.poll()})")
    return int(line)

  def cpu_s(self) -> float:
    """The relay process's processor seconds so far (Linux's /proc)."""
    with open(f"/proc/{self._proc.pid}/stat") as f:
      # utime and stime, after the command's name in parentheses.
      fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

  def close(self) -> None:
    """Ends the relay and every connection through it."""
    if self._proc.stdin.closed:
      return
    self._proc.stdin.close()
    try:
      self._proc.wait(self._timeout_s)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait(self._timeout_s)
    self._proc.stdout.close()


class _Direction:
  """One direction of a relayed connection: chunks held until due."""

  def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float):
    self.src, self.dst, self.delay_s = src, dst, delay_s
    self.held: collections.deque[tuple[float, memoryview]] = (
        collections.deque())
    self.held_bytes = 0
    self.ended = False  # src closed its sending side.
    self.shut = False  # ... and that was passed on to dst.
    self.stalled = False  # A due chunk waits for dst to take more.

  @property
  def reading(self) -> bool:
    return not self.ended and self.held_bytes < _HELD_MAX

  def due(self) -> float | None:
    """When the next chunk may go; ``None``: nothing held, or stalled (dst
    wakes the loop when it takes more)."""
    return self.held[0][0] if self.held and not self.stalled else None

  def read(self, now: float) -> None:
    data = self.src.recv(_CHUNK)
    if not data:
      self.ended = True
    else:
      self.held.append((now + self.delay_s, memoryview(data)))
      self.held_bytes += len(data)

  def write(self, now: float) -> None:
    """Sends every chunk that is due, as far as ``dst`` takes them."""
    self.stalled = False
    while self.held and self.held[0][0] <= now:
      due, data = self.held[0]
      try:
        sent = self.dst.send(data)
      except BlockingIOError:
        sent = 0
      self.held_bytes -= sent
      if sent < len(data):
        self.held[0] = (due, data[sent:])
        self.stalled = True
        return
      self.held.popleft()
    if self.ended and not self.held and not self.shut:
      self.shut = True
      self.dst.shutdown(socket.SHUT_WR)


class _Loop:
  """The relay process's one loop: requests, listeners and connections."""

  def __init__(self, host: str):
    self._host = host
    self._selector = selectors.SelectSelector()
    self._listeners: dict[socket.socket, tuple[int, float]] = {}
    # Each relayed socket: (what it sends, what it receives).
    self._ends: dict[socket.socket, tuple[_Direction, _Direction]] = {}

  def run(self) -> None:
    self._selector.register(sys.stdin, selectors.EVENT_READ)
    while True:
      dues = [d.due() for d, _ in self._ends.values()]
      dues = [d for d in dues if d is not None]
      timeout = (max(0.0, min(dues) - time.perf_counter()) if dues
                 else None)
      for key, events in self._selector.select(timeout):
        sock = key.fileobj
        if sock is sys.stdin:
          if not self._request():
            return
        elif sock in self._listeners:
          self._accept(sock)
        elif sock in self._ends and events & selectors.EVENT_READ:
          self._read(self._ends[sock][0])
      now = time.perf_counter()
      for sock in list(self._ends):
        if sock in self._ends:
          self._flush(self._ends[sock][0], now)
      for sock, (sends, receives) in list(self._ends.items()):
        self._watch(sock, (selectors.EVENT_READ if sends.reading else 0)
                    | (selectors.EVENT_WRITE if receives.stalled else 0))

  def _request(self) -> bool:
    line = sys.stdin.readline()
    if not line:
      return False
    port, delay_s = line.split()
    listener = socket.create_server((self._host, 0),
                                    family=_net.family(self._host),
                                    backlog=64)
    listener.setblocking(False)
    self._listeners[listener] = (int(port), float(delay_s))
    self._selector.register(listener, selectors.EVENT_READ)
    print(listener.getsockname()[1], flush=True)
    return True

  def _accept(self, listener: socket.socket) -> None:
    port, delay_s = self._listeners[listener]
    try:
      client, _ = listener.accept()
    except BlockingIOError:
      return
    try:
      upstream = socket.create_connection((self._host, port), timeout=10)
    except OSError:
      client.close()  # The real port is gone: so is the link.
      return
    for s in (client, upstream):
      s.setblocking(False)
      s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    up = _Direction(client, upstream, delay_s)
    down = _Direction(upstream, client, delay_s)
    self._ends[client] = (up, down)
    self._ends[upstream] = (down, up)
    for s in (client, upstream):
      self._selector.register(s, selectors.EVENT_READ)

  def _read(self, direction: _Direction) -> None:
    if not direction.reading:
      return
    try:
      direction.read(time.perf_counter())
    except OSError:
      self._drop(direction)

  def _flush(self, direction: _Direction, now: float) -> None:
    try:
      direction.write(now)
    except OSError:
      self._drop(direction)
      return
    other = self._ends.get(direction.dst)
    if direction.shut and other is not None and other[0].shut:
      self._drop(direction)

  def _watch(self, sock: socket.socket, events: int) -> None:
    """Waits for ``events`` on ``sock`` (none: not watched)."""
    try:
      key = self._selector.get_key(sock)
    except KeyError:
      key = None
    if key is None and events:
      self._selector.register(sock, events)
    elif key is not None and not events:
      self._selector.unregister(sock)
    elif key is not None and key.events != events:
      self._selector.modify(sock, events)

  def _drop(self, direction: _Direction) -> None:
    """Closes both sockets of ``direction``'s connection."""
    for sock in (direction.src, direction.dst):
      if self._ends.pop(sock, None) is not None:
        self._watch(sock, 0)
        sock.close()


def main(argv: list[str] | None = None) -> int:
  """The relay process: ``python -m tfdist.bench.relay HOST``."""
  argv = sys.argv[1:] if argv is None else argv
  try:  # Linux: sleep 1 us past a deadline, not 50.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
  except (OSError, AttributeError):
    pass
  _Loop(argv[0]).run()
  return 0


if __name__ == "__main__":
  sys.exit(main())
