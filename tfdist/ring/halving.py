"""Recursive halving and doubling: the schedule for middle sizes, by partner.

The ring's ``2 (n - 1)`` steps cost ``2 (n - 1)`` latencies one after the
other; recursive doubling pays only ``log2 n`` of them but sends the whole
buffer each time. Rabenseifner's all-reduce (Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA
19(1), 2005: MPICH's all-reduce for long messages) has the ring's bytes
with doubling's few latencies: a reduce-scatter by recursive halving, then
an all-gather by recursive doubling, ``2 log2 m`` exchanges moving
``2 (m - 1) / m`` of the buffer each way for ``m`` ranks, a power of two.

* **Reduce-scatter**: at the step of bit ``b`` (``m / 2`` down to 1),
  rank ``r`` and ``r ^ b`` hold partial sums of the same range; it is cut
  in two at a segment boundary (segment ``i`` of ``m``: elements
  ``i * length // m`` up to ``(i + 1) * length // m``), the rank whose bit
  is clear keeps the lower half, and each sends the other half and adds
  what it receives into the half it keeps. Rank ``r`` ends with the sum
  of segment ``r``.
* **All-gather**: the bits the other way, 1 up to ``m / 2``: each sends
  the range it holds and stores its partner's.
* **Not a power of two**: with ``m`` the largest power of two below ``n``,
  each extra rank ``e >= m`` first hands its buffer to rank ``e - m``
  (which adds it), and at the end takes the total from it, as
  `tfdist.ring.doubling` does: two more messages of the whole buffer, each
  one way.

Every rank ends with the same bits: each element's partial sums are
computed on one rank only (the one that keeps it at each step; a pair
never adds the same element twice), and every other rank gets a copy of
the total.

`steps` are pure functions of a rank, the number of ranks and the length,
no sockets, so the schedule can be checked alone (tests/test_ring.py
simulates it); `all_reduce` runs them on a `SocketRing`'s partners, each
step pipelined in blocks, a received block added as soon as it is in.

Example::

  for step in steps(rank=1, size=4, length=10):
    ...  # Send step.send to step.partner; receive step.recv, add or store.
"""

# A schedule is the ring's own part: it runs under its lock, on its members.
# pylint: disable=protected-access

from __future__ import annotations

import functools
from typing import NamedTuple

from tfdist.ring import pieces
from tfdist.ring.schedule import Span
from tfdist.ring.schedule import blocks
from tfdist.ring.wire import as_bytes

__all__ = ["NAME", "WIRES", "CAP_BYTES", "Step", "steps", "seconds",
           "all_reduce"]

#: Its name in `tfdist.ring.socket_ring.SCHEDULES`.
NAME = "halving"
#: The wire dtypes it carries (compressed wires take the ring).
WIRES = ("float32",)
#: The rule never picks it above this many float32 bytes, whatever the
#: model says (the model has it as fast as the ring there: the same bytes,
#: fewer latencies). Measured on the bed at 1 Gbit/s
#: (`tfdist.bench.schedules`, docs/benchmarks.md "Many hosts"): at 256 KiB
#: and 1 MiB it was the fastest or within 1.1x of it at 4, 8 and 16 hosts
#: (1.58x faster than the ring at 16 hosts and 1 MiB), but from 4 MiB the
#: ring was 1.0-1.2x faster at 4 hosts, 1.2-1.6x at 8 and 1.3-2.0x at 16:
#: each step is a burst on another connection, which the ring's one
#: steady stream per neighbour is not.
CAP_BYTES = 1 << 20

_NONE = (0, 0)


class Step(NamedTuple):
  """One exchange of one rank with one partner.

  Attributes:
    partner: the rank exchanged with.
    send: the elements sent to it (empty: nothing).
    recv: the elements received from it (empty: nothing).
    add: whether what is received is added into this rank's values of
      ``recv`` (else stored there).
  """
  partner: int
  send: Span
  recv: Span
  add: bool


@functools.lru_cache(maxsize=256)
def steps(rank: int, size: int, length: int) -> tuple[Step, ...]:
  """The exchanges of ``rank`` in an all-reduce of ``length`` elements.

  Args:
    rank: 0 to ``size - 1``.
    size: the number of ranks, 1 or more.
    length: the buffer's elements (any, 0 and fewer than ``size`` too).

  Returns:
    The steps in order; none for a single rank.
  """
  if not 0 <= rank < size:
    raise ValueError(f"rank {rank} is not in 0..{size - 1}")
  m = 1 << (size.bit_length() - 1)
  whole = (0, length)
  if rank >= m:  # An extra rank: hand over, then take the total.
    return (Step(rank - m, whole, _NONE, False),
            Step(rank - m, _NONE, whole, False))
  bounds = [i * length // m for i in range(m + 1)]

  def held(r: int, ranks: int) -> Span:
    """The segments of the ``ranks`` ranks of ``r``'s group (aligned)."""
    base = r & ~(ranks - 1)
    return bounds[base], bounds[base + ranks]

  extra = rank + m if rank + m < size else None
  out = [Step(extra, _NONE, whole, True)] if extra is not None else []
  bit = m >> 1
  while bit:  # Halving: keep the half of this rank's group of bit ranks.
    out.append(Step(rank ^ bit, held(rank ^ bit, bit), held(rank, bit), True))
    bit >>= 1
  bit = 1
  while bit < m:  # Doubling: swap what the two groups of bit ranks hold.
    out.append(Step(rank ^ bit, held(rank, bit), held(rank ^ bit, bit),
                    False))
    bit <<= 1
  if extra is not None:
    out.append(Step(extra, whole, _NONE, False))
  return tuple(out)


def seconds(size: int, nbytes: float, *, latency_s: float,
            bytes_per_s: float) -> float:
  """The alpha-beta model's time of one all-reduce of ``nbytes``.

  ``2 log2 m`` messages moving ``2 (m - 1) / m`` of the buffer in all,
  plus the fold's two messages of the whole buffer when ``size`` is not
  the power of two ``m``; a message of ``b`` bytes costs
  ``latency_s + b / bytes_per_s``.
  """
  m = 1 << (size.bit_length() - 1)
  total = 2 * ((m.bit_length() - 1) * latency_s
               + (m - 1) / m * nbytes / bytes_per_s)
  if size > m:
    total += 2 * (latency_s + nbytes / bytes_per_s)
  return total


def all_reduce(ring, x: pieces.Pieces, out: pieces.Pieces, wire: str,
               tag: int) -> None:
  """Sums ``x`` into ``out`` over ``ring`` by recursive halving and doubling.

  With two ranks the partner is the ring's neighbour, over the ring's own
  connections; with more, each partner has a ring of two of its own
  (`SocketRing`'s pairs, the ones `tfdist.ring.doubling` uses), each step
  one call on it. A partner's failure closes the ring and every
  partner's, for good. ``out`` may be ``x``: a step never writes what it
  sends.
  """
  del wire  # Always float32 (`WIRES`).
  moves = _moves(ring, x, out)
  if ring.size == 2:
    ring._call_locked("all-reduce", x.size, "float32", tag,
                      ((sends, recvs) for _, sends, recvs in moves))
    return
  with ring._over_pairs():
    for partner, sends, recvs in moves:
      ring._pair(partner)._step(x.size, tag, sends, recvs)


def _moves(ring, x: pieces.Pieces, out: pieces.Pieces):
  """Each step's ``(partner, sends, recvs)`` for `tfdist.ring.exchange`."""
  block = ring._block
  received = ring._wire("float32", x.size)[0]
  for i, step in enumerate(steps(ring.rank, ring.size, x.size)):
    src = x if i == 0 else out  # Then the partial sums of earlier steps.
    sends = [lambda v=v: as_bytes(v) for lo, hi in blocks(step.send, block)
             for _, v in src.views(lo, hi)]
    recvs = []
    rlo = step.recv[0]
    for lo, hi in blocks(step.recv, block):
      if step.add:
        part = received[lo - rlo:hi - rlo]
        recvs.append((as_bytes(part), functools.partial(
            pieces.add, part, src.views(lo, hi), out.views(lo, hi)), -1))
      else:
        recvs.extend((as_bytes(v), None, -1) for _, v in out.views(lo, hi))
    yield step.partner, sends, recvs
