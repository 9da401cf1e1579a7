"""The Keras hook's body (`keras_all_reduce`): each optimizer's gradients
summed by its transport."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from tfdist.strategy.buckets import socket_all_reduce
from tfdist.strategy.gradient_options import GradientOptions
from tfdist.strategy.gradient_options import get_compression
from tfdist.strategy.gradient_options import gradient_options_of
from tfdist.strategy.transport_choice import Choice
from tfdist.strategy.transport_choice import announce
from tfdist.strategy.transport_choice import gradient_transport

__all__ = ["keras_all_reduce", "sum_pairs"]


def sum_pairs(pairs: Sequence[tuple[Any, Any]],
              reduce: Callable[[list[Any]], list[Any]]) -> list:
  """``pairs`` (gradient, variable) with every gradient not ``None`` summed.

  ``reduce`` sums the gradients present, in order, in one call.
  """
  pairs = list(pairs)
  present = [i for i, (g, _) in enumerate(pairs) if g is not None]
  if not present:
    return pairs
  result = list(pairs)
  for i, r in zip(present, reduce([pairs[i][0] for i in present])):
    result[i] = (r, pairs[i][1])
  return result


def keras_all_reduce(optimizer, grads_and_vars: list) -> list | None:
  """``optimizer``'s ``(gradient, variable)`` pairs summed over the replicas.

  The one hook of every Keras optimizer (`tfdist.strategy.keras_hooks`
  installs it): by the transport the optimizer's `GradientOptions` ask for,
  else its strategy's (`gradient_transport`), in their wire dtype.

  Returns:
    The summed pairs, or ``None`` where Keras's own all-reduce does the same
    (TensorFlow's collectives, no options given).
  """
  context = tf.distribute.get_replica_context()
  if context is None:  # Cross-replica context: nothing to reduce.
    return grads_and_vars
  given = gradient_options_of(optimizer)
  options = given or GradientOptions()
  strategy = tf.distribute.get_strategy()
  choice = gradient_transport(strategy)
  if options.transport != "auto":
    choice = Choice(
        transport=options.transport,
        reason=f"asked for by GradientOptions(transport={options.transport!r})")
  announce(strategy, choice)
  if choice.transport != "socket" and given is None:
    return None
  codec = get_compression(options.compression)
  communication = tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=options.bytes_per_pack)

  def collective(grads):
    return _collective(context, grads, codec, communication)

  if choice.transport != "socket":
    return sum_pairs(grads_and_vars, collective)
  connect_s, silent_s = (
      (given.socket_connect_timeout_seconds, given.socket_timeout_seconds)
      if given else (choice.connect_timeout_s, choice.timeout_s))
  return sum_pairs(grads_and_vars, lambda grads: socket_all_reduce(
      grads, compression=options.compression, connect_timeout_s=connect_s,
      timeout_s=silent_s, fallback=collective,
      secret=options.socket_secret, ports=options.socket_ports,
      authenticate_values=options.socket_authenticate_values,
      # As by default: an embedding's rows stay on the collectives unless
      # the ring was asked for.
      keep_sparse=options.transport == "auto",
      bucket_bytes=options.bucket_bytes))


def _collective(context, grads, codec, communication) -> list:
  """TensorFlow's all-reduce of ``grads``, each dtype group in one call."""
  # Packs concatenate tensors, so each dtype is reduced in its own call.
  groups: dict[tf.DType, list[int]] = {}
  wire = [codec.encode(g) for g in grads]
  for j, w in enumerate(wire):
    groups.setdefault(w.dtype, []).append(j)
  reduced: list[Any] = [None] * len(grads)
  for indices in groups.values():
    out = context.all_reduce(tf.distribute.ReduceOp.SUM,
                             [wire[j] for j in indices], options=communication)
    for j, r in zip(indices, out):
      reduced[j] = codec.decode(r, grads[j].dtype)
  return reduced
