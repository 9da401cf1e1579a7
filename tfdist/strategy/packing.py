"""Packing: how one bucket of gradients reaches the socket ring (`bucket`).

Every dense floating gradient as float32, flat, in one order (the same on
every worker): large ones alone, runs of small ones packed together, summed
as one into a reused buffer (`Buffers`) whose views return to TensorFlow.
"""

from __future__ import annotations

import sys
import threading
import zlib
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["DTYPES", "ALONE_BYTES", "Buffers", "bucket", "groups", "nbytes"]

#: Gradients of these dtypes are packed into float32 buffers.
DTYPES = (tf.float32, tf.float16, tf.bfloat16)

#: Each gradient starts at a multiple of this many float32 values (64 bytes,
#: TensorFlow's tensor alignment) in the packed buffer, so every sum goes
#: back to TensorFlow as a view of that buffer: a ``tf.numpy_function``
#: output that starts on a 64-byte boundary is taken without a copy (where
#: ``tf.split`` copies every piece unless all offsets are aligned).
_ALIGN = 16

#: A gradient of at least this many float32 bytes (its shape known when
#: traced) reaches the ring as it is, an array of its own
#: (`tfdist.ring.pieces`): packing it would read and write every value once
#: more. Smaller ones, and those of unknown size, are packed together, so
#: that a block of the ring never spans many tiny arrays.
ALONE_BYTES = 256 << 10


def nbytes(tensors: Sequence[tf.Tensor]) -> int:
  """float32 bytes of ``tensors`` (0 for those of unknown size)."""
  return sum((t.shape.num_elements() or 0) * 4 for t in tensors)


def bucket(ring, tensors: Sequence[tf.Tensor], wire: str, sums: "Buffers",
           kind: str) -> tuple[list[tf.Tensor], Callable]:
  """The inputs of one all-reduce of ``tensors`` and the numpy function
  that sums them (into a buffer of ``sums``) and returns each one's sum;
  ``kind`` names it to the flight recorder."""
  tag = _signature(tensors)
  packed_inputs = [_packed([tensors[i] for i in group])
                   for group in groups(tensors)]
  inputs = [flat for flat, _ in packed_inputs]
  # One input that is concat's new buffer, read by nothing but the
  # all-reduce: the sum goes into it. Else an input may be a gradient's own
  # buffer: the sum gets a buffer of its own.
  in_place = len(packed_inputs) == 1 and packed_inputs[0][1]
  counts = tf.stack([tf.size(t, out_type=tf.int64)
                     if t.shape.num_elements() is None
                     else tf.constant(t.shape.num_elements(), tf.int64)
                     for t in tensors])

  def reduce(*args):
    *xs, sizes = args
    if in_place:
      out = xs[0]
    else:
      out = sums.take(sum(c + (-c % _ALIGN) for c in sizes.tolist()))
    outs, start = [], 0
    for x in xs:  # Each input's place in the packed layout of `_views`.
      outs.append(out[start:start + x.size])
      start += x.size + (-x.size % _ALIGN)
    ring.all_reduce(xs, wire=wire, tag=tag, out=outs, kind=kind)
    return _views(out, sizes)

  return inputs + [counts], reduce


def _signature(grads: Sequence[tf.Tensor]) -> int:
  """A number naming the gradients' shapes and dtypes, checked across peers."""
  text = ";".join(f"{g.dtype.name}{g.shape}" for g in grads)
  return zlib.crc32(text.encode())


def _alone(g: tf.Tensor) -> bool:
  """Whether ``g`` reaches the ring unpacked (`ALONE_BYTES`)."""
  count = g.shape.num_elements()
  return count is not None and count * 4 >= ALONE_BYTES


def groups(tensors: Sequence[tf.Tensor]) -> list[list[int]]:
  """``tensors``' indices in order: each one alone (`_alone`), or a run of
  neighbours packed into one buffer."""
  out: list[list[int]] = []
  for i, g in enumerate(tensors):
    if _alone(g):
      out.append([i])
    elif out and not _alone(tensors[out[-1][-1]]):
      out[-1].append(i)
    else:
      out.append([i])
  return out


def _pack(tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """The pieces to concatenate (gradients as float32, zeros to align them).

  Each gradient, flat, is followed by the zeros that bring the next one to a
  multiple of `_ALIGN` (none where that is 0).
  """
  pieces = []
  for g in tensors:
    flat = tf.reshape(tf.cast(g, tf.float32), [-1])
    count = g.shape.num_elements()
    pieces.append(flat)
    if count is None:  # Only known when the graph runs.
      count = tf.size(flat, out_type=tf.int64)
      pieces.append(tf.zeros([tf.math.floormod(-count, _ALIGN)],
                             tf.float32))
    elif count % _ALIGN:
      pieces.append(tf.zeros([-count % _ALIGN], tf.float32))
  return pieces


def _packed(tensors: Sequence[tf.Tensor]) -> tuple[tf.Tensor, bool]:
  """One input of the ring: the gradient itself if `_alone`, else
  ``tensors`` packed by `_pack`; and whether it is a buffer of its own
  (concatenated from two pieces or more that are surely not empty)."""
  if len(tensors) == 1 and _alone(tensors[0]):
    return tf.reshape(tf.cast(tensors[0], tf.float32), [-1]), False
  pieces = _pack(tensors)
  if len(pieces) == 1:
    return pieces[0], False
  return tf.concat(pieces, axis=0), sum(
      (p.shape.num_elements() or 0) > 0 for p in pieces) > 1


def _views(out: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
  """The gradients' sums: views of ``out`` laid out as `_pack` packed them."""
  views, start = [], 0
  for count in counts.tolist():
    views.append(out[start:start + count])
    start += count + (-count % _ALIGN)
  return views


def _aligned(raw: np.ndarray, size: int) -> np.ndarray:
  """``size`` values of ``raw`` (``size + _ALIGN`` long) on a 64-byte
  boundary."""
  skip = (-raw.ctypes.data % (_ALIGN * 4)) // 4
  return raw[skip:skip + size]


class Buffers:
  """Buffers for the sums, reused once TensorFlow has let go of them.

  A sum goes back to TensorFlow as views of its buffer, and TensorFlow holds
  a reference to each view until it frees the tensor (``DelayedNumpyDecref``
  in tensorflow/python/lib/core/ndarray_tensor_bridge.cc), and every view
  one to the buffer: a buffer whose reference count is back to what this
  class alone holds is not seen by any tensor, and the next step of its size
  sums into it. A fresh buffer of 64 MiB costs its page faults, the kernel
  zeroing each page when it is first written: more than the additions
  written into it (docs/benchmarks.md).

  Args:
    keep: buffers kept per size (one in use, one TensorFlow has not let go
      of yet).
    sizes: sizes kept, the most recently used.
  """

  def __init__(self, *, keep: int = 2, sizes: int = 4):
    self._keep, self._sizes = keep, sizes
    self._held: dict[int, list[np.ndarray]] = {}
    self._lock = threading.Lock()
    #: Buffers allocated so far (a reused one is not counted again).
    self.allocations = 0

  def take(self, size: int) -> np.ndarray:
    """A float32 array of ``size`` values on a 64-byte boundary, no other
    array's."""
    with self._lock:
      held = self._held.pop(size, [])
      self._held[size] = held  # The most recent size last.
      while len(self._held) > self._sizes:
        del self._held[next(iter(self._held))]
      for raw in held:
        # References: `held`, `raw` and getrefcount's argument; a view
        # anywhere adds one.
        if sys.getrefcount(raw) == 3:
          return _aligned(raw, size)
      raw = np.empty(size + _ALIGN, np.float32)
      self.allocations += 1
      if len(held) < self._keep:
        held.append(raw)
      return _aligned(raw, size)
