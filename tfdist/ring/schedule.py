"""The ring schedule: which elements move at each step, and moving them.

The steps are pure functions of a rank, the ring's size and the buffer's
length (no sockets, no numbers), so they can be checked alone; `all_reduce`
runs them on a `SocketRing`'s connections, the schedule of every buffer
that no other takes (`tfdist.ring.socket_ring`).

The buffer of ``length`` elements is cut into ``size`` segments (segment
``i`` holds elements ``i * length // size`` up to ``(i + 1) * length //
size``; lengths differ by at most one, and some are empty when ``length <
size``). Ranks pass data to the right (rank ``r`` to ``r + 1``) in two
phases of ``size - 1`` steps each:

* reduce-scatter step ``s``: rank ``r`` sends segment ``r - s`` (its own
  input at ``s = 0``, then the partial sum it made at step ``s - 1``) and
  adds what it receives into segment ``r - s - 1``; afterwards it owns the
  full sum of segment ``r + 1`` (`owned`);
* all-gather step ``s``: rank ``r`` sends segment ``r + 1 - s`` and stores
  what it receives as segment ``r - s``.

Segment numbers are taken modulo ``size``. What rank ``r`` sends at a step
is what rank ``r + 1`` receives at that step, and a segment is never
written in the step that sends it, so the sum may go into the input.

Example::

  for step in reduce_scatter(rank=0, size=3, length=10):
    for lo, hi in blocks(step.send, block=4):
      ...  # Send elements lo:hi to rank 1.
"""

# A schedule is the ring's own part: it runs under its lock, on its members.
# pylint: disable=protected-access

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from tfdist.ring import pieces
from tfdist.ring.wire import WIRE_DTYPES
from tfdist.ring.wire import as_bytes
from tfdist.ring.wire import decode
from tfdist.ring.wire import encode

__all__ = ["NAME", "WIRES", "CAP_BYTES", "Span", "Step", "segments",
           "segment_capacity", "reduce_scatter", "all_gather", "owned",
           "blocks", "seconds", "all_reduce"]

#: Its name in `tfdist.ring.socket_ring.SCHEDULES`.
NAME = "ring"
#: The wire dtypes it carries: every one.
WIRES = tuple(WIRE_DTYPES)
#: No cap: it takes every call the others do not.
CAP_BYTES = None

#: Elements ``lo`` up to (not including) ``hi`` of the flat buffer.
Span = tuple[int, int]


class Step(NamedTuple):
  """One step of one rank: what it sends right and receives from the left.

  A named tuple, not a dataclass: cheap to build, and immutable, so a
  schedule can be cached and shared.

  Attributes:
    send: the elements sent to the right neighbour.
    recv: the elements received from the left neighbour.
  """
  send: Span
  recv: Span


def segments(length: int, size: int) -> list[Span]:
  """The ``size`` segments of a buffer of ``length`` elements, in order."""
  bounds = [i * length // size for i in range(size + 1)]
  return list(zip(bounds, bounds[1:]))


def segment_capacity(length: int, size: int) -> int:
  """Elements enough to hold any one segment (they differ by at most one)."""
  return length // size + 1


# Every training step all-reduces the same length: its schedule is reused.
@functools.lru_cache(maxsize=256)
def _steps(rank: int, size: int, length: int, send: int,
           recv: int) -> tuple[Step, ...]:
  """``size - 1`` steps; step ``s`` sends segment ``rank + send - s``."""
  segs = segments(length, size)
  return tuple(Step(segs[(rank + send - s) % size],
                    segs[(rank + recv - s) % size]) for s in range(size - 1))


def reduce_scatter(rank: int, size: int, length: int) -> tuple[Step, ...]:
  """The reduce-scatter steps of ``rank``: add each received segment in.

  Step ``s`` sends segment ``rank - s`` and receives segment ``rank - s -
  1``, whose sum so far is the received values plus this rank's input.
  """
  return _steps(rank, size, length, 0, -1)


def all_gather(rank: int, size: int, length: int) -> tuple[Step, ...]:
  """The all-gather steps of ``rank``: store each received segment.

  Step ``s`` sends segment ``rank + 1 - s`` (the `owned` one at ``s = 0``,
  then the one received at step ``s - 1``) and receives segment ``rank -
  s``.
  """
  return _steps(rank, size, length, 1, 0)


def owned(rank: int, size: int, length: int) -> Span:
  """The segment ``rank`` holds the full sum of after the reduce-scatter."""
  return segments(length, size)[(rank + 1) % size]


def blocks(span: Span, block: int) -> list[Span]:
  """``span`` cut into consecutive pieces of at most ``block`` elements."""
  lo, hi = span
  return [(s, min(s + block, hi)) for s in range(lo, hi, block)]


def seconds(size: int, nbytes: float, *, latency_s: float,
            bytes_per_s: float) -> float:
  """The alpha-beta model's time of one all-reduce of ``nbytes``.

  ``2 (size - 1)`` steps one after the other, each a message of
  ``nbytes / size`` costing ``latency_s + bytes / bytes_per_s``.
  """
  return 2 * (size - 1) * (latency_s + nbytes / size / bytes_per_s)


def all_reduce(ring, x: pieces.Pieces, out: pieces.Pieces, wire: str,
               tag: int) -> None:
  """Sums ``x`` into ``out`` over ``ring``: reduce-scatter, then all-gather.

  For every ring of two or more processes. A segment is never written in
  the step that sends it, so ``out`` may be ``x``. A block that spans
  several arrays of ``x`` is sent as their views, one after the other, and
  added view by view.
  """
  ring._call_locked("all-reduce", x.size, wire, tag,
                    _moves(ring, x, out, wire))


def _moves(ring, x: pieces.Pieces, out: pieces.Pieces, wire: str):
  """Each step's ``(sends, recvs)`` for `tfdist.ring.exchange.Link`."""
  n, r, block = ring.size, ring.rank, ring._block
  compressed = wire != "float32"
  send_buf, recv_buf = ring._wire(wire, segment_capacity(x.size, n))
  widened = ring._scratch
  for s, step in enumerate(reduce_scatter(r, n, x.size)):
    sends, recvs = [], []
    slo, rlo = step.send[0], step.recv[0]
    src = x if s == 0 else out  # Then the partial sum of step s - 1.
    for lo, hi in blocks(step.send, block):
      if compressed:
        sends.append(lambda lo=lo, hi=hi, slo=slo, src=src: _encode(
            src.views(lo, hi), send_buf[lo - slo:hi - slo]))
      else:
        sends.extend(lambda v=v: as_bytes(v) for _, v in src.views(lo, hi))
    for lo, hi in blocks(step.recv, block):
      part = recv_buf[lo - rlo:hi - rlo]

      def add(part=part, xs=x.views(lo, hi), outs=out.views(lo, hi),
              size=hi - lo):
        values = decode(part, widened[:size]) if compressed else part
        pieces.add(values, xs, outs)

      recvs.append((as_bytes(part), add, -1))
    yield sends, recvs
  for s, step in enumerate(all_gather(r, n, x.size)):
    sends, recvs = [], []
    slo, rlo = step.send[0], step.recv[0]
    for lo, hi in blocks(step.send, block):
      if not compressed:
        sends.extend(lambda v=v: as_bytes(v) for _, v in out.views(lo, hi))
      elif s == 0:  # The owned segment: round once, keep the rounding.

        def own(views=out.views(lo, hi), part=send_buf[lo - slo:hi - slo]):
          sent = _encode(views, part)
          _decode(part, views)
          return sent

        sends.append(own)
      else:  # Forward what arrived at the previous step, as it came.
        sends.append(lambda lo=lo, hi=hi, slo=slo, buf=send_buf: as_bytes(
            buf[lo - slo:hi - slo]))
    for lo, hi in blocks(step.recv, block):
      if compressed:
        part = recv_buf[lo - rlo:hi - rlo]
        recvs.append((as_bytes(part), lambda part=part, views=out.views(
            lo, hi): _decode(part, views), -1))
      else:
        recvs.extend((as_bytes(v), None, -1) for _, v in out.views(lo, hi))
    yield sends, recvs
    if compressed:
      send_buf, recv_buf = recv_buf, send_buf


def _encode(views: list[tuple[int, np.ndarray]], into: np.ndarray
            ) -> memoryview:
  """Rounds float32 ``views`` (offset, values) into the wire buffer ``into``."""
  for at, v in views:
    encode(v, into[at:at + v.size])
  return as_bytes(into)


def _decode(received: np.ndarray, views: list[tuple[int, np.ndarray]]
            ) -> None:
  """Widens wire values ``received`` into float32 ``views`` (offset, into)."""
  for at, v in views:
    decode(received[at:at + v.size], v)
