"""How gradients cross the wire: the vocabulary, and `GradientOptions`.

Every name tfdist accepts for a gradient's journey is defined here once:

* **transports** (`TRANSPORTS`): ``collective`` (TensorFlow's collectives),
  ``socket`` (tfdist's ring all-reduce over TCP) or ``auto``, the rule of
  `tfdist.strategy.transport`, which `TRANSPORT_VARIABLE` overrides for a job;
* **compressions** (`COMPRESSIONS`), Horovod's ``Compression.fp16`` idea:
  float32 gradients cross the wire in 16 bits and are cast back just after;
  sums, accumulation and the update stay in float32.

| compression | wire dtype   | range       | mantissa bits |
|-------------|--------------|-------------|---------------|
| none        | the gradient | -           | -             |
| fp16        | float16      | 6e-8..65504 | 10            |
| bf16        | bfloat16     | as float32  | 7             |

`tfdist.perf.with_gradient_options` attaches `GradientOptions` to a Keras
optimizer; the one Keras hook (`tfdist.strategy.transport.keras_all_reduce`)
reads them, or these defaults where none were given.
"""

from __future__ import annotations

import dataclasses
from typing import Any
import weakref

from tfdist.errors import ConfigError

__all__ = ["TRANSPORTS", "TRANSPORT_VARIABLE", "COMPRESSIONS", "Compression",
           "get_compression", "GradientOptions", "gradient_options_of"]

#: What may carry the gradients (`tfdist.strategy.transport`).
TRANSPORTS: tuple[str, ...] = ("auto", "collective", "socket")

#: The environment variable that sets the transport where the option is
#: ``auto`` (e.g. ``TFDIST_TRANSPORT=collective`` for a whole job).
TRANSPORT_VARIABLE = "TFDIST_TRANSPORT"

_SOURCE = "GradientOptions"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compression:
  """How gradients travel in the all-reduce.

  Attributes:
    name: the registry name.
    wire_dtype: the dtype's name sent, or ``None`` to send gradients as they
      are (the socket ring then sends float32: `ring_wire`).
  """
  name: str
  wire_dtype: str | None = None

  @property
  def ring_wire(self) -> str:
    """The wire dtype of tfdist's ring, which packs float32 buffers."""
    return self.wire_dtype or "float32"

  def applies_to(self, tensor: Any) -> bool:
    """True for dense float32 tensors, the only ones this compresses."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return (self.wire_dtype is not None and isinstance(tensor, tf.Tensor)
            and tensor.dtype == tf.float32)

  def encode(self, tensor: Any) -> Any:
    """The tensor as sent."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if not self.applies_to(tensor):
      return tensor
    return tf.cast(tensor, self.wire_dtype)

  def decode(self, tensor: Any, dtype: Any) -> Any:
    """The received tensor back in the gradient's ``dtype``."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)


_REGISTRY: dict[str, Compression] = {
    "none": Compression(name="none"),
    "fp16": Compression(name="fp16", wire_dtype="float16"),
    "bf16": Compression(name="bf16", wire_dtype="bfloat16"),
}

#: Every compression name `get_compression` accepts.
COMPRESSIONS: tuple[str, ...] = tuple(sorted(_REGISTRY))


def get_compression(name: str) -> Compression:
  """The `Compression` called ``name``.

  Raises:
    ConfigError: an unknown name; the message lists the valid ones.
  """
  if name not in _REGISTRY:
    raise ConfigError(field="compression", value=name, source=_SOURCE,
                      expected=f"one of {list(COMPRESSIONS)}")
  return _REGISTRY[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradientOptions:
  """How an optimizer's gradients are communicated.

  Attributes:
    compression: one of `COMPRESSIONS`: the dtype gradients cross the wire
      in.
    bytes_per_pack: all-reduce packs of about this many bytes; 0 means one
      pack. ``collective`` transport only.
    transport: one of `TRANSPORTS`: ``auto`` (the strategy's transport, as
      `tfdist.make_strategy` chose it), ``collective`` or ``socket``.
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
    bucket_bytes: ``socket`` transport: gradients cross in buckets of at
      most this many float32 bytes, the last layers' first, each as soon as
      the backward pass has made it, while the pass goes on (DDP's 25 MiB by
      default, the fastest of 0, 25, 50 and 100 MiB measured on the bed:
      docs/benchmarks.md); 0 sends them all after the pass.
  """
  compression: str = "none"
  bytes_per_pack: int = 0
  transport: str = "auto"
  socket_connect_timeout_seconds: float = 300.0
  socket_timeout_seconds: float = 300.0
  socket_secret: str | None = dataclasses.field(default=None, repr=False)
  socket_ports: str | None = None
  socket_authenticate_values: bool = False
  bucket_bytes: int = 25 << 20

  def __post_init__(self):
    get_compression(self.compression)  # Validates the name.
    for field in ("bytes_per_pack", "bucket_bytes"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(field=field, value=value, source=_SOURCE,
                          expected="an integer >= 0")
    value = self.bytes_per_pack
    if self.transport not in TRANSPORTS:
      raise ConfigError(field="transport", value=self.transport,
                        source=_SOURCE, expected=f"one of {list(TRANSPORTS)}")
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
      from tfdist.ring.connection import ring_ports  # pylint: disable=g-import-not-at-top
      ring_ports(self.socket_ports, source=f"{_SOURCE}.socket_ports")
    if not isinstance(self.socket_secret, (str, type(None))):
      raise ConfigError(field="socket_secret",
                        value=type(self.socket_secret).__name__,
                        source=_SOURCE, expected="a string or None")

  def attach(self, optimizer: Any) -> None:
    """Gives ``optimizer`` these options (`gradient_options_of` reads them)."""
    _given[optimizer] = self


# Kept off the optimizer, which Keras lists, compares and serializes.
_given: "weakref.WeakKeyDictionary[Any, GradientOptions]" = (
    weakref.WeakKeyDictionary())


def gradient_options_of(optimizer: Any) -> GradientOptions | None:
  """The options `tfdist.perf.with_gradient_options` gave ``optimizer``."""
  return _given.get(optimizer)
