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
so it wins below a size and the ring above (`limit`; a `SocketRing`'s
``doubling_bytes``).

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

__all__ = ["ADD", "GIVE", "TAKE", "Step", "steps", "exchanges", "partners",
           "WIRES", "limit", "all_reduce"]

#: The wire dtypes it carries (compressed wires take the ring).
WIRES = ("float32",)

#: The link `limit` assumes by default: the slowest tfdist is measured on
#: (1 Gbit/s: 0.95 of the line, as the bed's streams moved) and a step's
#: latency in Python over it (the bed measured 13-28 us a hop).
_SLOW_LINK_BYTES_PER_S = 0.95 * 125e6
_STEP_LATENCY_S = 30e-6
#: Recursive doubling sends the whole buffer in one message per exchange
#: where the ring sends pieces, and adds only once all of it is in (the
#: ring adds each block as it arrives). Measured (`tfdist.bench.doubling`;
#: docs/benchmarks.md): with 2 ranks, where the model has no crossover, it
#: was as fast or faster up to 16 KiB everywhere (1.0-1.9x); above, single
#: messages sometimes stalled on the bed's shaped links (2 hosts at
#: 10 Gbit/s: 0.35x at 64 KiB in 2 runs of 3, 0.54x at 128 KiB). So never
#: above this.
_CAP_BYTES = 32 << 10

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


def limit(size: int, *, latency_s: float = _STEP_LATENCY_S,
          bytes_per_s: float = _SLOW_LINK_BYTES_PER_S) -> int:
  """Bytes at or below which recursive doubling beats the ring, by the model.

  A message of ``b`` bytes costs ``latency_s + b / bytes_per_s``; the ring
  takes ``2 (n - 1)`` exchanges of ``S / n``, recursive doubling
  `exchanges` exchanges of ``S``. Equal at
  ``S* = (2 (n - 1) - e) latency_s bytes_per_s / (e - 2 (n - 1) / n)``,
  capped at 32 KiB (at 2 ranks the model has no crossover; measured, a
  single message above that sometimes stalled). The defaults assume a
  1 Gbit/s link and 30 us a step: a faster link raises the crossover, so
  by the model the limit is safe there too, and it leaves some gain (the
  bed at 10 Gbit/s: 4 hosts 1.8x at 64 KiB) unused.

  Args:
    size: the number of ranks.
    latency_s: one exchange's fixed cost.
    bytes_per_s: the link's rate.

  Returns:
    The limit in bytes (float32 bytes of the buffer); 0 for one rank.
  """
  if size < 2:
    return 0
  e, ring = exchanges(size), 2 * (size - 1)
  if e >= ring:
    return 0
  per_byte = e - ring / size
  if per_byte <= 0:
    return _CAP_BYTES
  crossover = (ring - e) * latency_s * bytes_per_s / per_byte
  return int(min(crossover, _CAP_BYTES))


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
  flat = np.concatenate(x.arrays)  # At most the limit's bytes.
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
