"""A flat float32 buffer held as consecutive arrays, never concatenated.

`SocketRing.all_reduce` sums a list of arrays (a model's gradients, say) as
if they were one buffer laid end to end, without making that buffer: each
block of the ring's schedule (`tfdist.ring.schedule`) becomes the views of
the arrays it covers, sent one after the other, and each received block is
added piece by piece. Concatenating first would read and write every value
once more, the longest pass of the whole all-reduce on a processor-bound
link (about 1 ms per 16 MiB and 7 ms per 64 MiB on the 2-vCPU machines the
bench runs on; docs/benchmarks.md).

Pure numpy, no sockets, so the arithmetic of offsets can be checked alone.

Example::

  x = Pieces([np.ones(3, np.float32), np.zeros(2, np.float32)])
  [(offset, v.size) for offset, v in x.views(2, 5)]  # [(0, 1), (1, 2)]
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

__all__ = ["Pieces", "add"]


class Pieces:
  """Arrays read (or written) as their concatenation.

  Args:
    arrays: contiguous one-dimensional arrays, in order.
  """

  def __init__(self, arrays: Sequence[np.ndarray]):
    self.arrays = tuple(arrays)
    starts = [0]
    for a in self.arrays:
      starts.append(starts[-1] + a.size)
    self._starts = starts
    #: The number of elements of all the arrays together.
    self.size = starts[-1]

  def views(self, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
    """Elements ``lo`` up to ``hi``, as ``(offset from lo, view)`` in order.

    One view per array the span touches; empty arrays give none.
    """
    if len(self.arrays) == 1:
      return [(0, self.arrays[0][lo:hi])]
    found = []
    i = bisect.bisect_right(self._starts, lo) - 1
    at = lo
    while at < hi:
      start, end = self._starts[i], self._starts[i + 1]
      if end > at:
        stop = min(hi, end)
        found.append((at - lo, self.arrays[i][at - start:stop - start]))
        at = stop
      i += 1
    return found


def add(values: np.ndarray, xs: list[tuple[int, np.ndarray]],
        outs: list[tuple[int, np.ndarray]]) -> None:
  """``outs = xs + values``, view by view: ``xs`` and ``outs`` are the same
  span's `Pieces.views` (offsets from the span's start), ``values`` the
  span's received values; ``outs`` may be ``xs``."""
  for (at, x), (_, o) in zip(xs, outs):
    np.add(x, values[at:at + x.size], out=o)
