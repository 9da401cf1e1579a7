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
so it wins below a size and the ring above (`tfdist.ring.SocketRing`
chooses by ``doubling_bytes``).

When ``n`` is not a power of two, with ``m`` the largest power of two below
it, each extra rank ``e >= m`` first hands its buffer to rank ``e - m``
(which adds it), waits while the first ``m`` ranks double, and then
receives the total from ``e - m``: two more steps.

Every rank ends with the same bits: a partner pair adds the same two
float32 values (``a + b == b + a`` exactly), every pair of one step adds
partial sums over the same blocks of ranks, and an extra rank receives the
total as its partner holds it.

Pure functions of a rank and the number of ranks, no sockets, so the
schedule can be checked alone (tests/test_ring.py simulates it).

Example::

  for step in steps(rank=2, size=6):
    ...  # Swap the buffer with step.partner; step.kind says what to keep.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["ADD", "GIVE", "TAKE", "Step", "steps", "exchanges", "partners"]

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
