"""`Batching`: the global and per-replica batch sizes, stated explicitly.

Under a `tf.distribute.Strategy` one step consumes a *global* batch, split
evenly over ``num_replicas_in_sync`` replicas::

    global_batch_size = per_replica_batch_size * num_replicas

Give either size (or both, consistently); `Batching` derives the other and
refuses a global batch that does not split evenly, so no replica silently gets
a smaller batch than the learning-rate schedule assumes.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["Batching", "batching_for", "is_tpu_strategy", "static_batch_size"]

_SOURCE = "tfdist.data batching"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batching:
  """How one step's examples split over the replicas.

  Build it with `Batching.resolve` (or `batching_for` from a strategy); the
  constructor checks that the three sizes agree.

  Attributes:
    global_batch_size: examples per step, over all replicas.
    per_replica_batch_size: examples per step on each replica.
    num_replicas: replicas in sync (``strategy.num_replicas_in_sync``).
    drop_remainder: whether the last, smaller batch is dropped, so every batch
      has a static size (TPUs need it).
  """

  global_batch_size: int
  per_replica_batch_size: int
  num_replicas: int
  drop_remainder: bool = False

  def __post_init__(self):
    _check_positive("num_replicas", self.num_replicas, self._source)
    _check_positive("global_batch_size", self.global_batch_size, self._source)
    _check_positive("per_replica_batch_size", self.per_replica_batch_size,
                    self._source)
    per_step = self.per_replica_batch_size * self.num_replicas
    if per_step != self.global_batch_size:
      raise ConfigError(
          field="per_replica_batch_size", value=self.per_replica_batch_size,
          expected=(f"global_batch_size / num_replicas = "
                    f"{self.global_batch_size} / {self.num_replicas}"),
          source=self._source,
          hint="Give only one of global_batch_size and per_replica_batch_size")

  @property
  def _source(self) -> str:
    return _SOURCE

  @classmethod
  def resolve(cls, *, num_replicas: int, global_batch_size: int | None = None,
              per_replica_batch_size: int | None = None,
              drop_remainder: bool = False,
              source: str = _SOURCE) -> Batching:
    """Derives the missing batch size from the one given.

    Args:
      num_replicas: replicas in sync.
      global_batch_size: examples per step over all replicas.
      per_replica_batch_size: examples per step per replica.
      drop_remainder: see the attribute.
      source: named in errors, e.g. ``"--global_batch_size flag"``.

    Returns:
      The batching, every size set.

    Raises:
      ConfigError: neither size given, a size that is not a positive integer,
        a global batch that ``num_replicas`` does not divide, or two sizes
        that disagree. The error's ``field`` names the offending argument.
    """
    _check_positive("num_replicas", num_replicas, source)
    if global_batch_size is None and per_replica_batch_size is None:
      raise ConfigError(
          field="global_batch_size", expected=(
              "a positive integer (or per_replica_batch_size)"),
          source=source,
          hint="State the batch size; tfdist does not guess one")
    if global_batch_size is None:
      _check_positive("per_replica_batch_size", per_replica_batch_size, source)
      global_batch_size = per_replica_batch_size * num_replicas
    _check_positive("global_batch_size", global_batch_size, source)
    if global_batch_size % num_replicas:
      lower = global_batch_size - global_batch_size % num_replicas
      nearest = " or ".join(str(n) for n in (lower, lower + num_replicas) if n)
      raise ConfigError(
          field="global_batch_size", value=global_batch_size,
          expected=f"a multiple of the {num_replicas} replicas in sync",
          source=source,
          hint=f"Use {nearest}, or give per_replica_batch_size")
    global_batch_size = int(global_batch_size)
    derived = global_batch_size // num_replicas
    if per_replica_batch_size is not None:
      _check_positive("per_replica_batch_size", per_replica_batch_size, source)
      if per_replica_batch_size != derived:
        raise ConfigError(
            field="per_replica_batch_size", value=per_replica_batch_size,
            expected=(f"{derived} = global_batch_size {global_batch_size} / "
                      f"{num_replicas} replicas"),
            source=source,
            hint=("Give only one of global_batch_size and "
                  "per_replica_batch_size"))
    return cls(global_batch_size=global_batch_size,
               per_replica_batch_size=derived, num_replicas=num_replicas,
               drop_remainder=drop_remainder)


def is_tpu_strategy(strategy: tf.distribute.Strategy) -> bool:
  """Whether ``strategy`` runs on TPUs (which need static batch shapes)."""
  return isinstance(strategy, (tf.distribute.TPUStrategy,
                               tf.distribute.experimental.TPUStrategy))


def batching_for(strategy: tf.distribute.Strategy, *,
                 global_batch_size: int | None = None,
                 per_replica_batch_size: int | None = None,
                 drop_remainder: bool | None = None,
                 source: str = _SOURCE) -> Batching:
  """`Batching.resolve` with the replicas of ``strategy``.

  Args:
    strategy: the strategy the batches feed.
    global_batch_size: examples per step over all replicas.
    per_replica_batch_size: examples per step per replica.
    drop_remainder: ``None`` drops the remainder exactly when ``strategy`` is
      a TPU strategy; ``False`` on a TPU strategy is refused.
    source: named in errors.

  Returns:
    The batching.

  Raises:
    ConfigError: as `Batching.resolve`, or ``drop_remainder=False`` on a TPU.
  """
  tpu = is_tpu_strategy(strategy)
  if drop_remainder is None:
    drop_remainder = tpu
  elif tpu and not drop_remainder:
    raise ConfigError(
        field="drop_remainder", value=False, source=source,
        expected="True with a TPU strategy: TPUs need static batch shapes")
  return Batching.resolve(
      num_replicas=strategy.num_replicas_in_sync,
      global_batch_size=global_batch_size,
      per_replica_batch_size=per_replica_batch_size,
      drop_remainder=drop_remainder, source=source)


def static_batch_size(dataset: tf.data.Dataset) -> int | None:
  """The leading dimension every component of ``dataset``'s elements shares.

  Returns:
    The batch size when it is static (the dataset was batched with
    ``drop_remainder=True``), else ``None`` (unbatched, or batched with a
    possibly smaller last batch).
  """
  sizes = set()
  for spec in tf.nest.flatten(dataset.element_spec):
    shape = getattr(spec, "shape", None)
    if shape is None or shape.rank in (None, 0):
      return None
    sizes.add(shape[0])
  if len(sizes) != 1:
    return None
  size = sizes.pop()
  return int(size) if size is not None else None


def _check_positive(field: str, value: Any, source: str) -> None:
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
      or value <= 0):
    raise ConfigError(field=field, value=value, expected="a positive integer",
                      source=source)
