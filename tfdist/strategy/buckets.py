"""The socket all-reduce: gradients summed in buckets, during the backward
pass.

The gradients are cut into buckets of ``bucket_bytes`` (25 MiB; `buckets`),
each summed as soon as the backward pass has made it (`_overlapped`); a
model of fewer bytes is one bucket, summed after it. While
`tfdist.strategy.timeline` records, each bucket's times are noted. Sparse
gradients are made dense first; other dtypes (float64, integers) take the
collective path.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfdist.strategy import introspect
from tfdist.strategy import packing
from tfdist.strategy import timeline
from tfdist.strategy.gradient_options import get_compression
from tfdist.strategy.rings import ring_for

__all__ = ["socket_all_reduce", "buckets"]


# Plain Python over static shapes: autograph has nothing to convert here, and
# converting the numpy callback's closure fails noisily ("can't be nonlocal").
@tf.autograph.experimental.do_not_convert
def socket_all_reduce(grads: Sequence[Any], *, compression: str,
                      connect_timeout_s: float, timeout_s: float,
                      fallback, secret: str | None = None,
                      ports: str | None = None,
                      authenticate_values: bool = False,
                      keep_sparse: bool = False,
                      bucket_bytes: int = 0) -> list[Any]:
  """Sums ``grads`` over the workers through the socket ring.

  Call in a replica context, with the gradients of one step in the same order
  on every worker.

  Args:
    grads: gradient tensors or ``IndexedSlices`` (none ``None``).
    compression: a `tfdist.perf.COMPRESSIONS` name: the wire dtype.
    connect_timeout_s, timeout_s, secret, ports, authenticate_values: the
      ring's, as `tfdist.strategy.rings.ring_for` takes them.
    fallback: ``fallback(list_of_tensors)`` sums tensors the ring does not
      carry (not float32/float16/bfloat16) with TensorFlow's collectives.
    keep_sparse: ``IndexedSlices`` go to ``fallback`` as they are (an
      embedding's rows, gathered by TensorFlow's collectives) instead of
      being made dense for the ring (its whole table every step).
    bucket_bytes: cut the gradients into buckets of at most this many
      float32 bytes, last variable first, each summed as soon as it exists
      (`buckets`); 0 sums them all in one call after the backward pass.

  Returns:
    The summed gradients, each in its gradient's dtype; dense, but those
    ``keep_sparse`` left to ``fallback``.
  """
  strategy = tf.distribute.get_strategy()
  ring = ring_for(strategy, connect_timeout_s=connect_timeout_s,
                  timeout_s=timeout_s, secret=secret, ports=ports,
                  authenticate_values=authenticate_values)
  dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
           for g in grads]
  if ring is None:
    return dense
  carried = [g.dtype in packing.DTYPES and not (
      keep_sparse and isinstance(g, tf.IndexedSlices)) for g in grads]
  packed = [i for i, c in enumerate(carried) if c]
  others = [i for i, c in enumerate(carried) if not c]
  result: list[Any] = list(dense)
  if others:
    kept = [grads[i] if keep_sparse else dense[i] for i in others]
    for i, r in zip(others, fallback(kept)):
      result[i] = r
  if not packed:
    return result
  tensors = [dense[i] for i in packed]
  wire = get_compression(compression).ring_wire
  groups = buckets(tensors, bucket_bytes)
  if len(groups) == 1:
    args, reduce = packing.bucket(ring, tensors, wire,
                                  introspect.record_of(strategy).sums,
                                  "gradient bucket 1/1")
    nbytes = packing.nbytes(tensors)
    sums = tf.numpy_function(
        lambda *a: timeline.note_bucket(
            functools.partial(reduce, *a), bucket=0, of=1, nbytes=nbytes,
            ready=time.perf_counter()),
        args, [tf.float32] * len(tensors), stateful=True,
        name="tfdist_socket_all_reduce")
  else:
    sums = _overlapped(ring, tensors, wire, groups,
                       bound_s=connect_timeout_s + timeout_s * len(groups))
  for i, g, piece in zip(packed, tensors, sums):
    static = g.shape.is_fully_defined()
    piece.set_shape([g.shape.num_elements() if static else None])
    shape = g.shape if static else tf.shape(g)
    result[i] = tf.cast(tf.reshape(piece, shape), g.dtype)
  return result


def buckets(tensors: Sequence[tf.Tensor], bucket_bytes: int
            ) -> list[list[int]]:
  """Indices of ``tensors`` cut into buckets of at most ``bucket_bytes``.

  Last first: TensorFlow computes a model's gradients in the reverse order
  of its variables, layer by layer (measured on CPU, in ``fit`` and in a
  hand-written step alike), so each bucket is whole as early as it can be.
  A gradient larger than ``bucket_bytes`` is a bucket alone. One bucket of
  all, in order, when ``bucket_bytes`` is 0 or a size is not known when
  traced.
  """
  sizes = [g.shape.num_elements() for g in tensors]
  if not bucket_bytes or None in sizes:
    return [list(range(len(tensors)))]
  out: list[list[int]] = []
  filled = 0
  for i in reversed(range(len(tensors))):
    if out and filled + sizes[i] * 4 <= bucket_bytes:
      out[-1].append(i)
      filled += sizes[i] * 4
    else:
      out.append([i])
      filled = sizes[i] * 4
  return out


def _overlapped(ring, tensors, wire: str, groups: list[list[int]], *,
                bound_s: float) -> list[tf.Tensor]:
  """Each of ``groups`` summed as soon as its gradients exist.

  Bucket k has two ops. ``start_k`` only hands its gradients to the ring's
  `tfdist.ring.courier.Courier` thread, so no inter-op thread of TensorFlow
  waits on the network while the backward pass runs; graph execution is
  dataflow, so it runs as soon as its gradients exist, although it was
  issued after the whole backward pass. Each ``start_k`` follows
  ``start_{k-1}``, so every worker's thread sums the buckets in the same
  order. ``finish_k`` waits for bucket k's sums; it follows the last
  ``start`` and ``finish_{k-1}``, so it holds no thread before the backward
  pass is done.
  """
  courier = ring.courier
  sums: list[Any] = [None] * len(tensors)
  tickets, previous = [], []
  for k, group in enumerate(groups):
    members = [tensors[i] for i in group]
    args, reduce = packing.bucket(ring, members, wire,
                                  packing.Buffers(sizes=1),
                                  f"gradient bucket {k + 1}/{len(groups)}")
    def start(*arrays, reduce=reduce, k=k, nbytes=packing.nbytes(members)):
      return np.int64(courier.start(functools.partial(
          timeline.note_bucket, functools.partial(reduce, *arrays), bucket=k,
          of=len(groups), nbytes=nbytes, ready=time.perf_counter())))
    with tf.control_dependencies(previous):
      ticket = tf.numpy_function(start, args, tf.int64, stateful=True,
                                 name=f"tfdist_bucket_start_{k}")
    tickets.append(ticket)
    previous = [ticket]
  for k, group in enumerate(groups):
    with tf.control_dependencies(previous):
      summed = tf.numpy_function(
          lambda ticket: courier.finish(int(ticket), bound_s), [tickets[k]],
          [tf.float32] * len(group), stateful=True,
          name=f"tfdist_bucket_finish_{k}")
    previous = [summed[0]]
    for i, piece in zip(group, summed):
      sums[i] = piece
  return sums
