"""Communication options for gradients, as a wrapper of a Keras optimizer.

Under MultiWorkerMirroredStrategy a Keras 3 optimizer all-reduces the
gradients in ``_all_reduce_sum_gradients`` (the TensorFlow backend's
optimizer), once per update. `with_gradient_options` replaces that one method
on an optimizer instance, so the same optimizer serves Keras ``fit``,
`tfdist.fit` and `tfdist.Runner` (any step that calls ``apply_gradients``):

* ``compression``: float32 gradients cross the wire as float16 or bfloat16
  (`tfdist.perf.compression`), half the bytes, and are cast back to float32
  before the update.
* ``bytes_per_pack``: the all-reduce packs gradients into chunks of about
  this many bytes (of the wire dtype); 0 sends them as one pack, as
  TensorFlow's default does.
* ``transport``: ``auto`` (the default: whatever the strategy's gradients
  take, `tfdist.strategy.transport`'s rule), ``collective`` (TensorFlow's
  collectives) or ``socket`` (tfdist's ring all-reduce over TCP: one packed
  float32 buffer per step, the wire dtype from ``compression``, float32
  sums; MultiWorkerMirroredStrategy with one replica per worker).

Gradient accumulation lives in `tfdist.perf.accumulation`: Keras's own
``gradient_accumulation_steps`` fails under every tf.distribute strategy on
CPU (its all-reduce is a ``merge_call`` inside a ``tf.cond``).

Example:
  >>> with strategy.scope():
  ...   optimizer = with_gradient_options(
  ...       keras.optimizers.SGD(0.1),
  ...       GradientOptions(transport="socket"))
  ...   model.compile(optimizer=optimizer, loss="mse")
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.perf import compression as compression_lib
from tfdist.ring.connection import ring_ports
from tfdist.strategy import transport as transport_lib

__all__ = ["GradientOptions", "with_gradient_options", "gradient_options_of"]

_SOURCE = "GradientOptions"
_ATTR = "_tfdist_gradient_options"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradientOptions:
  """How gradients are communicated.

  Attributes:
    compression: one of `tfdist.perf.COMPRESSIONS`: ``none``, ``fp16``,
      ``bf16``: the dtype gradients cross the wire in.
    bytes_per_pack: all-reduce packs of about this many bytes; 0 means one
      pack. ``collective`` transport only.
    transport: one of `tfdist.perf.TRANSPORTS`: ``auto`` (the strategy's
      transport, as `tfdist.make_strategy` chose it), ``collective`` or
      ``socket``.
    socket_connect_timeout_seconds: ``socket`` transport: bound on
      connecting the workers at the first step.
    socket_timeout_seconds: ``socket`` transport: a peer that sends nothing
      for this long during an all-reduce is declared lost.
    socket_secret: ``socket`` transport: the job's secret, the same on
      every worker; ``TFDIST_JOB_SECRET`` when ``None`` (never shown in
      ``repr``).
    socket_ports: ``socket`` transport: ``"FIRST-LAST"``, the ports the ring
      may listen on; ``TFDIST_RING_PORTS`` when ``None``, else any.
    socket_authenticate_values: ``socket`` transport: also tag every step's
      bytes with an HMAC, so values altered on the way fail the step (costs
      hashing every byte; needs a secret).
  """
  compression: str = "none"
  bytes_per_pack: int = 0
  transport: str = "auto"
  socket_connect_timeout_seconds: float = 300.0
  socket_timeout_seconds: float = 300.0
  socket_secret: str | None = dataclasses.field(default=None, repr=False)
  socket_ports: str | None = None
  socket_authenticate_values: bool = False

  def __post_init__(self):
    compression_lib.get_compression(self.compression)  # Validates the name.
    value = self.bytes_per_pack
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ConfigError(field="bytes_per_pack", value=value, source=_SOURCE,
                        expected="an integer >= 0")
    if self.transport not in transport_lib.TRANSPORTS:
      raise ConfigError(field="transport", value=self.transport,
                        source=_SOURCE,
                        expected=f"one of {list(transport_lib.TRANSPORTS)}")
    if self.transport == "socket" and self.bytes_per_pack:
      raise ConfigError(
          field="bytes_per_pack", value=value, source=_SOURCE,
          expected="0 with transport='socket'",
          hint="The socket transport sends one buffer per step, pipelined "
               "in blocks of its own")
    for field in ("socket_connect_timeout_seconds", "socket_timeout_seconds"):
      seconds = getattr(self, field)
      if (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
          or not seconds > 0):
        raise ConfigError(field=field, value=seconds, source=_SOURCE,
                          expected="a positive number of seconds")
    if self.socket_ports is not None:
      ring_ports(self.socket_ports, source=f"{_SOURCE}.socket_ports")
    if not isinstance(self.socket_secret, (str, type(None))):
      raise ConfigError(field="socket_secret",
                        value=type(self.socket_secret).__name__,
                        source=_SOURCE, expected="a string or None")


def gradient_options_of(optimizer: Any) -> GradientOptions | None:
  """The options `with_gradient_options` gave ``optimizer``, if any."""
  return getattr(optimizer, _ATTR, None)


def with_gradient_options(optimizer: Any,
                          options: GradientOptions) -> Any:
  """Makes ``optimizer`` communicate its gradients as ``options`` say.

  Args:
    optimizer: a Keras 3 optimizer (TensorFlow backend).
    options: `GradientOptions`.

  Returns:
    The same optimizer, changed in place.

  Raises:
    ConfigError: an optimizer without the TensorFlow all-reduce hook, one
      given options twice, or ``transport="socket"`` under a strategy it
      cannot serve (checked here inside a strategy's scope, else at the
      first step).
  """
  if not hasattr(optimizer, "_all_reduce_sum_gradients"):
    raise ConfigError(
        field="optimizer", value=type(optimizer).__name__,
        source="with_gradient_options",
        expected="a Keras 3 optimizer on the TensorFlow backend")
  if gradient_options_of(optimizer) is not None:
    raise ConfigError(field="optimizer", value=type(optimizer).__name__,
                      source="with_gradient_options",
                      expected="an optimizer not given options before")
  codec = compression_lib.get_compression(options.compression)
  communication = tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=options.bytes_per_pack)
  if options.transport == "socket" and tf.distribute.has_strategy():
    transport_lib.check_strategy(tf.distribute.get_strategy())

  def all_reduce_sum_gradients(self, grads_and_vars):
    del self
    return _all_reduce(grads_and_vars, codec, communication, options)

  object.__setattr__(optimizer, "_all_reduce_sum_gradients",
                     types.MethodType(all_reduce_sum_gradients, optimizer))
  object.__setattr__(optimizer, _ATTR, options)
  return optimizer


def _all_reduce(grads_and_vars, codec: compression_lib.Compression,
                communication, options: GradientOptions) -> list:
  """Sums gradients over replicas; compressed ones travel in the wire dtype."""
  context = tf.distribute.get_replica_context()
  if context is None:  # Cross-replica context: nothing to reduce.
    return list(grads_and_vars)
  strategy = tf.distribute.get_strategy()
  choice = transport_lib.gradient_transport(strategy)
  if options.transport != "auto":
    choice = transport_lib.Choice(
        transport=options.transport,
        reason=f"asked for by GradientOptions(transport={options.transport!r})")
  transport_lib.announce(strategy, choice)
  transport = choice.transport

  def reduce(grads):
    if transport == "socket":
      return transport_lib.socket_all_reduce(
          grads, compression=options.compression,
          connect_timeout_s=options.socket_connect_timeout_seconds,
          timeout_s=options.socket_timeout_seconds,
          fallback=lambda ts: _collective(context, ts, codec, communication),
          secret=options.socket_secret, ports=options.socket_ports,
          authenticate_values=options.socket_authenticate_values,
          # As by default (tfdist.strategy.transport): an embedding's rows
          # stay on the collectives unless the ring was asked for.
          keep_sparse=options.transport == "auto")
    return _collective(context, grads, codec, communication)

  return transport_lib.sum_pairs(grads_and_vars, reduce)


def _collective(context, grads, codec: compression_lib.Compression,
                communication) -> list:
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
