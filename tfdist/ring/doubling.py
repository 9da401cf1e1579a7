"""Recursive doubling: the schedule for small all-reduces, by partner.

A ring all-reduce of ``n`` processes takes ``2 (n - 1)`` steps one after
the other, each paying the link's latency (and, in Python, a few tens of
microseconds of work), whatever the size: for a small buffer the steps are
the whole cost. Recursive doubling (Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA
19(1), 2005: MPICH's all-reduce for short messages) takes ``log2 n``: at
step ``k`` every rank swaps its whole partial sum with rank ``rank XOR 2**k``
and adds, so after the last step each holds the total. It moves ``log2 n``
times the buffer each way where the ring moves ``2 (n - 1) / n`` times it,
so it wins below a size and the ring above (`seconds`, the model that
`tfdist.ring.socket_ring.choose` compares).

When ``n`` is not a power of two, with ``m`` the largest power of two below
it, each extra rank ``e >= m`` first hands its buffer to rank ``e - m``
(which adds it), waits while the first ``m`` ranks double, and then
receives the total from ``e - m``: two more steps.

Every rank ends with the same bits: a partner pair adds the same two
float32 values (``a + b == b + a`` exactly), every pair of one step adds
partial sums over the same blocks of ranks, and an extra rank receives the
total as its partner holds it.

`steps` are pure functions of a rank and the number of ranks, no sockets,
so the schedule can be checked alone (tests/test_ring.py simulates it);
`all_reduce` runs them on a `SocketRing`'s partners.

Example::

  for step in steps(rank=2, size=6):
    ...  # Swap the buffer with step.partner; step.kind says what to keep.
"""

# A schedule is the ring's own part: it runs under its lock, on its members.
# pylint: disable=protected-access

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from tfdist.ring import pieces

__all__ = ["NAME", "WIRES", "CAP_BYTES", "ADD", "GIVE", "TAKE", "Step",
           "steps", "exchanges", "partners", "seconds", "all_reduce"]

#: Its name in `tfdist.ring.socket_ring.SCHEDULES`.
NAME = "doubling"
#: The wire dtypes it carries (compressed wires take the ring).
WIRES = ("float32",)

#: The rule (`tfdist.ring.socket_ring.choose`) never picks it above this
#: many float32 bytes, whatever the model says. Recursive doubling sends
#: the whole buffer in one message per exchange where the ring sends
#: pieces, and adds only once all of it is in (the ring adds each block as
#: it arrives). Measured (`tfdist.bench.doubling`;
#: docs/benchmarks.md): with 2 ranks, where the model has no crossover, it
#: was as fast or faster up to 16 KiB everywhere (1.0-1.9x); above, single
#: messages sometimes stalled on the bed's shaped links (2 hosts at
#: 10 Gbit/s: 0.35x at 64 KiB in 2 runs of 3, 0.54x at 128 KiB). So never
#: above this.
CAP_BYTES = 32 << 10

#: Send this rank's partial sum, receive the partner's and add it in.
ADD = "add"
#: Send this rank's buffer; what the partner sends is not needed.
GIVE = "give"
#: Send anything; the partner's buffer (the total) is the result.
TAKE = "take"


class Step(NamedTuple):
  """One exchange of one rank: with whom, and what it keeps.

  Attributes:
    partner: the rank swapped with (both send and receive the whole
      buffer).
    kind: `ADD`, `GIVE` or `TAKE`.
  """
  partner: int
  kind: str


def _largest_power_of_two(size: int) -> int:
  return 1 << (size.bit_length() - 1)


@functools.lru_cache(maxsize=256)
def steps(rank: int, size: int) -> tuple[Step, ...]:
  """The exchanges of ``rank`` in a recursive-doubling all-reduce.

  Args:
    rank: 0 to ``size - 1``.
    size: the number of ranks, 1 or more.

  Returns:
    The steps in order; none for a single rank.
  """
  if not 0 <= rank < size:
    raise ValueError(f"rank {rank} is not in 0..{size - 1}")
  m = _largest_power_of_two(size)
  if rank >= m:  # An extra rank: hand over, then take the total.
    return (Step(rank - m, GIVE), Step(rank - m, TAKE))
  extra = rank + m if rank + m < size else None
  out = [Step(extra, ADD)] if extra is not None else []
  bit = 1
  while bit < m:
    out.append(Step(rank ^ bit, ADD))
    bit <<= 1
  if extra is not None:
    out.append(Step(extra, GIVE))
  return tuple(out)


def exchanges(size: int) -> int:
  """Exchanges one after the other (latencies) of an all-reduce of ``size``.

  ``log2 m``, plus 2 when ``size`` is not a power of two; the ring's
  ``2 (size - 1)`` for comparison.
  """
  m = _largest_power_of_two(size)
  return (m.bit_length() - 1) + (2 if size > m else 0)


def partners(rank: int, size: int) -> tuple[int, ...]:
  """The ranks ``rank`` exchanges with, each once, in the order first met."""
  return tuple(dict.fromkeys(step.partner for step in steps(rank, size)))


def seconds(size: int, nbytes: float, *, latency_s: float,
            bytes_per_s: float) -> float:
  """The alpha-beta model's time of one all-reduce of ``nbytes``.

  `exchanges` messages of the whole buffer one after the other, each
  costing ``latency_s + nbytes / bytes_per_s``: fewer latencies than the
  ring's ``2 (size - 1)``, more bytes than its ``2 (size - 1) / size``.
  """
  return exchanges(size) * (latency_s + nbytes / bytes_per_s)


def all_reduce(ring, x: pieces.Pieces, out: pieces.Pieces, wire: str,
               tag: int) -> None:
  """Sums ``x`` into ``out`` over ``ring`` by recursive doubling.

  With two ranks the partner is the ring's neighbour, over the ring's own
  connections; with more, each partner has a ring of two of its own
  (`SocketRing`'s pairs). A partner's failure closes the ring and every
  partner's, for good.
  """
  del wire  # Always float32 (`WIRES`).
  if len(x.arrays) == 1:
    _double(ring, x.arrays[0], out.arrays[0], tag)
    return
  flat = np.concatenate(x.arrays)  # At most CAP_BYTES, unless forced.
  _double(ring, flat, flat, tag)
  for at, o in out.views(0, out.size):
    np.copyto(o, flat[at:at + o.size])


def _double(ring, x: np.ndarray, out: np.ndarray, tag: int) -> None:
  if out.ctypes.data != x.ctypes.data:
    np.copyto(out, x)
  scratch = ring._wire("float32", x.size)[0][:x.size]
  if ring.size == 2:  # One exchange, with the ring's neighbour.
    ring._send_receive_locked(out, scratch, tag=tag, what="all-reduce")
    np.add(out, scratch, out=out)
    return
  with ring._over_pairs():
    for step in steps(ring.rank, ring.size):
      swap = ring._pair(step.partner)._swap
      if step.kind == TAKE:
        swap(scratch, out, tag)
      else:
        swap(out, scratch, tag)
        if step.kind == ADD:
          np.add(out, scratch, out=out)
