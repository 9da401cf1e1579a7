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

The model (`seconds`) charges `exchanges` messages one after the other,
each the whole buffer: ``log2 m`` latencies and ``log2 m`` buffers each
way (plus 2 of each for the fold), where the ring pays ``2 (n - 1)``
latencies and ``2 (n - 1) / n`` buffers.

Example::

  plan(rank=2, size=6, length=10)  # Its steps (`tfdist.ring.schedule`).
"""

from __future__ import annotations

import functools

from tfdist.ring.schedule import Step
from tfdist.ring.schedule import folded

__all__ = ["NAME", "WIRES", "CAP_BYTES", "plan", "exchanges", "seconds"]

#: Its name in `tfdist.ring.socket_ring.SCHEDULES`.
NAME = "doubling"
#: The wire dtypes it carries (compressed wires take the ring).
WIRES = ("float32",)

#: The rule (`tfdist.ring.socket_ring.choose`) never picks it above this
#: many float32 bytes: it sends the whole buffer per exchange and adds only
#: once all of it is in (the ring adds each block as it arrives), which the
#: model does not charge. On the bed (docs/benchmarks.md, "The rule
#: against the fastest") it was the fastest up to 256 KiB at 2-16 hosts, 1
#: and 10 Gbit/s, but at 2 hosts 1.13-1.24x the ring from 1 MiB.
CAP_BYTES = 256 << 10


@functools.lru_cache(maxsize=256)
def plan(rank: int, size: int, length: int) -> tuple[Step, ...]:
  """The steps of ``rank`` (by partner); none for a single rank."""
  whole = (0, length)
  return folded(rank, size, length, lambda m: [
      Step(rank ^ (1 << k), whole, rank ^ (1 << k), whole, True)
      for k in range(m.bit_length() - 1)])


def exchanges(size: int) -> int:
  """Exchanges one after the other (latencies) of an all-reduce of ``size``.

  ``log2 m``, plus 2 when ``size`` is not a power of two; the ring's
  ``2 (size - 1)`` for comparison.
  """
  m = 1 << (size.bit_length() - 1)
  return (m.bit_length() - 1) + (2 if size > m else 0)


def seconds(size: int, nbytes: float, *, latency_s: float,
            bytes_per_s: float) -> float:
  """The alpha-beta model's time of one all-reduce of ``nbytes`` (above);
  a message of ``b`` bytes costs ``latency_s + b / bytes_per_s``."""
  return exchanges(size) * (latency_s + nbytes / bytes_per_s)
