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

The model (`seconds`) charges ``2 log2 m`` messages, one after the other,
moving ``2 (m - 1) / m`` of the buffer each way (halves of halves: ``1/2 +
1/4 + ... + 1/m`` each phase), plus, when ``size > m``, the fold's two
messages of the whole buffer.

Example::

  plan(rank=1, size=4, length=10)  # Its steps (`tfdist.ring.schedule`).
"""

from __future__ import annotations

import functools

from tfdist.ring.schedule import Span
from tfdist.ring.schedule import Step
from tfdist.ring.schedule import folded

__all__ = ["NAME", "WIRES", "CAP_BYTES", "plan", "seconds"]

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


@functools.lru_cache(maxsize=256)
def plan(rank: int, size: int, length: int) -> tuple[Step, ...]:
  """The steps of ``rank`` (by partner); none for a single rank."""

  def core(m: int) -> list[Step]:
    bounds = [i * length // m for i in range(m + 1)]

    def held(r: int, ranks: int) -> Span:
      """The segments of the ``ranks`` ranks of ``r``'s group (aligned)."""
      base = r & ~(ranks - 1)
      return bounds[base], bounds[base + ranks]

    bits = [1 << k for k in range(m.bit_length() - 1)]
    # Halving keeps the half of this rank's group of bit ranks; doubling
    # swaps what the two groups of bit ranks hold.
    return ([Step(rank ^ b, held(rank ^ b, b), rank ^ b, held(rank, b), True)
             for b in reversed(bits)]
            + [Step(rank ^ b, held(rank, b), rank ^ b, held(rank ^ b, b),
                    False) for b in bits])

  return folded(rank, size, length, core)


def seconds(size: int, nbytes: float, *, latency_s: float,
            bytes_per_s: float) -> float:
  """The alpha-beta model's time of one all-reduce of ``nbytes`` (above);
  a message of ``b`` bytes costs ``latency_s + b / bytes_per_s``."""
  m = 1 << (size.bit_length() - 1)
  total = 2 * ((m.bit_length() - 1) * latency_s
               + (m - 1) / m * nbytes / bytes_per_s)
  if size > m:
    total += 2 * (latency_s + nbytes / bytes_per_s)
  return total
