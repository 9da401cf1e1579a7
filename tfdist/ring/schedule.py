"""The ring all-reduce schedule: which elements move at each step.

Pure functions of a rank, the ring's size and the buffer's length: no
sockets, no numbers, so the schedule can be checked alone.

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

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["Span", "Step", "segments", "segment_capacity", "reduce_scatter",
           "all_gather", "owned", "blocks"]

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
