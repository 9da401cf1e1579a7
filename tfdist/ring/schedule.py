"""The ring schedule, and the `Step` every schedule's plan is made of.

A schedule is a pure plan: ``plan(rank, size, length)`` gives one rank's
steps (`Step`) of an all-reduce of ``length`` elements over ``size`` ranks, no
sockets, so every plan can be run on paper (tests/test_ring.py simulates
them all). `tfdist.ring.socket_ring.SocketRing` alone carries plans out:
headers, numbering, failures, connections, blocks and wire dtypes.

A rank's values start as its input. At a step it sends its values of
``send`` to rank ``to`` and receives ``recv``'s from rank ``source``, then
adds them in (``add``) or stores them; the peer's matching step has the
same ``add``. A plan either goes along the ring (every step sends to the
right neighbour and receives from the left, all ranks in step, one call
with one header) or by partner (each step with one partner, both ways or
one way, one call of its own on that pair's connections). Two rules keep
the executor simple and in place: a step's ``send`` and ``recv`` overlap
only when it adds, and a span is either untouched before a step or wholly
received earlier (so it is read from the input or from the output, never
both). A plan that cannot carry ``size`` ranks raises ``ValueError``.

The ring (Baidu's and Horovod's): the buffer is cut into ``size``
segments (`segments`); rank ``r`` sends right in two phases of
``size - 1`` steps: reduce-scatter step ``s`` sends segment ``r - s`` and
adds what comes into ``r - s - 1``; all-gather step ``s`` sends segment
``r + 1 - s`` (at ``s = 0`` the one it summed) and stores ``r - s``
(modulo ``size``). Its model (`seconds`): ``2 (size - 1)`` messages one
after the other, each of ``nbytes / size``, so ``2 (size - 1)`` latencies
and ``2 (size - 1) / size`` of the buffer each way, the least any
all-reduce can move.

Example::

  for step in plan(rank=0, size=3, length=10):
    ...  # Send step.send to step.to; receive step.recv from step.source.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from tfdist.ring.wire import WIRE_DTYPES

__all__ = ["NAME", "WIRES", "CAP_BYTES", "Span", "Step", "NONE", "segments",
           "blocks", "along", "sources", "folded", "seconds", "plan"]

#: Its name in `tfdist.ring.socket_ring.SCHEDULES`.
NAME = "ring"
#: The wire dtypes it carries: every one.
WIRES = tuple(WIRE_DTYPES)
#: No cap: it takes every call the others do not.
CAP_BYTES = None

#: Elements ``lo`` up to (not including) ``hi`` of the flat buffer.
Span = tuple[int, int]
#: An empty span: nothing sent, or nothing received.
NONE: Span = (0, 0)


class Step(NamedTuple):
  """One step of one rank's plan (immutable, so plans are cached).

  Attributes:
    to: the rank ``send`` goes to (``None`` when empty).
    send: the elements sent.
    source: the rank ``recv`` comes from (``None`` when empty).
    recv: the elements received.
    add: add what is received into this rank's values (else store it).
  """
  to: int | None
  send: Span
  source: int | None
  recv: Span
  add: bool


def segments(length: int, size: int) -> list[Span]:
  """The ``size`` segments of ``length`` elements, in order: lengths differ
  by at most one, and some are empty when ``length < size``."""
  bounds = [i * length // size for i in range(size + 1)]
  return list(zip(bounds, bounds[1:]))


def blocks(span: Span, block: int) -> list[Span]:
  """``span`` cut into consecutive pieces of at most ``block`` elements."""
  lo, hi = span
  return [(s, min(s + block, hi)) for s in range(lo, hi, block)]


def along(steps: tuple[Step, ...], rank: int, size: int) -> bool:
  """Whether ``steps`` go along the ring (else by partner)."""
  return all(s.to in (None, (rank + 1) % size)
             and s.source in (None, (rank - 1) % size) for s in steps)


def sources(steps: tuple[Step, ...]) -> tuple[tuple[bool, bool], ...]:
  """Whether each step's ``send`` and ``recv`` are still untouched (read
  from the input; else from the output, where earlier steps received)."""
  got, written = [], []
  for step in steps:
    got.append(tuple(not any(lo < b and a < hi for a, b in written)
                     for lo, hi in (step.send, step.recv)))
    written.append(step.recv)
  return tuple(got)


def folded(rank: int, size: int, length: int,
           core: Callable[[int], list[Step]]) -> tuple[Step, ...]:
  """A plan by partner for any ``size`` from ``core(m)``, the steps of
  ``rank`` among ``m``, the largest power of two in ``size``: each extra
  rank ``e >= m`` first hands its buffer to ``e - m`` (which adds it) and
  at the end takes the total from it."""
  m, whole = 1 << (size.bit_length() - 1), (0, length)
  if rank >= m:
    return (Step(rank - m, whole, None, NONE, True),
            Step(None, NONE, rank - m, whole, False))
  if rank + m >= size:
    return tuple(core(m))
  return (Step(None, NONE, rank + m, whole, True), *core(m),
          Step(rank + m, whole, None, NONE, False))


def seconds(size: int, nbytes: float, *, latency_s: float,
            bytes_per_s: float) -> float:
  """The alpha-beta model's time of one all-reduce of ``nbytes``: ``2
  (size - 1)`` messages of ``nbytes / size``, each ``latency_s + bytes /
  bytes_per_s``."""
  return 2 * (size - 1) * (latency_s + nbytes / size / bytes_per_s)


@functools.lru_cache(maxsize=256)
def plan(rank: int, size: int, length: int) -> tuple[Step, ...]:
  """The ring's ``2 (size - 1)`` steps of ``rank``; none for one rank."""
  segs = segments(length, size)
  right, left = (rank + 1) % size, (rank - 1) % size
  return tuple(Step(right, segs[(rank + first - s) % size], left,
                    segs[(rank + first - 1 - s) % size], add)
               for first, add in ((0, True), (1, False))
               for s in range(size - 1))
