"""Input that can resume mid-epoch: skip the steps already applied.

`Stream` turns what `tfdist.fit` accepts (arrays, a batched dataset, a
``dataset_fn``) into one stream of batches over all epochs that can start
any number of steps in. `skipping` and `per_worker_iterator` are the pieces
`tfdist.fit` and `tfdist.Runner` share: a ``dataset_fn`` that starts a number
of steps in, and ParameterServerStrategy's per-worker input.

Each step takes one per-replica batch per local replica from each input
pipeline, so skipping that many batches puts a resumed run where it stopped.
A `Stream` also knows its global batch where the input says it (arrays, a
constant ``batch``), so a backup can keep its position in samples.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import tensorflow as tf

from tfdist.data import batching
from tfdist.data import feed
from tfdist.data.feed import DatasetFn
from tfdist.errors import ConfigError
from tfdist.strategy import introspect

__all__ = ["Stream", "check_steps", "per_worker_iterator", "skipping"]

_SOURCE = "tfdist.fit"


def skipping(dataset_fn: DatasetFn, steps: int) -> DatasetFn:
  """``dataset_fn`` whose pipelines start ``steps`` steps in."""
  if not steps:
    return dataset_fn

  def skipped(ctx):
    return dataset_fn(ctx).skip(
        steps * (ctx.num_replicas_in_sync // ctx.num_input_pipelines))
  return skipped


def _skipper(dataset: tf.data.Dataset) -> Callable[[int], tf.data.Dataset]:
  """``steps -> dataset``, that many batches in; the dataset itself at 0.

  A skip of none is a new dataset op on every `tfdist.fit` call (0.4 ms
  each; `tfdist.bench.overhead`'s ``fit`` case).
  """
  return lambda steps: dataset.skip(steps) if steps else dataset


def per_worker_iterator(coordinator: tf.distribute.coordinator.ClusterCoordinator,
                        strategy: tf.distribute.Strategy,
                        dataset_fn: DatasetFn) -> Any:
  """An iterator over ``dataset_fn``'s batches on every worker.

  Under ParameterServerStrategy steps are at-least-once and the data starts
  over: nothing is skipped.
  """
  return iter(coordinator.create_per_worker_dataset(
      lambda: strategy.distribute_datasets_from_function(dataset_fn)))


def check_steps(steps: Any, what: str, *, source: str = _SOURCE) -> None:
  """Raises ConfigError unless ``steps`` is a positive integer."""
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
    raise ConfigError(field="steps_per_epoch", value=steps, source=source,
                      expected=f"a positive integer for {what}")


class Stream:
  """The input as one stream of batches over all epochs, so it can resume.

  Attributes:
    steps_per_epoch: steps in one epoch.
    dataset_fn: the ``dataset_fn`` given, if any (ParameterServerStrategy
      builds its per-worker input from it).
  """

  def __init__(self, *, steps_per_epoch: int, make: Callable[[int], Any],
               dataset_fn: DatasetFn | None = None,
               batch: Callable[[], int | None] = lambda: None,
               samples: int | None = None):
    self.steps_per_epoch = steps_per_epoch
    self._make = make
    self.dataset_fn = dataset_fn
    self._batch = batch
    self._samples = samples

  def skipping(self, steps: int) -> Any:
    """The input, ``steps`` steps in."""
    return self._make(steps)

  def sizes(self) -> tuple[int | None, int | None]:
    """The global batch and the samples of an epoch; ``None`` if unknown."""
    batch = self._batch()
    return batch, self._samples or (batch and batch * self.steps_per_epoch)

  @classmethod
  def make(cls, x: Any, y: Any, *, strategy: tf.distribute.Strategy,
           batch_size: int | None, steps_per_epoch: int | None,
           shuffle: bool, seed: int, ps: bool) -> "Stream":
    """The stream for `tfdist.fit`'s ``x`` and ``y``.

    Raises:
      ConfigError: input that cannot serve ``strategy`` (``ps``: it is a
        ParameterServerStrategy).
    """
    replicas = strategy.num_replicas_in_sync
    if steps_per_epoch is not None:  # Keras loops forever on one below 1.
      check_steps(steps_per_epoch, "an epoch to end")
    if callable(x) and not isinstance(x, tf.data.Dataset):
      if y is not None:
        raise ConfigError(field="y", value=type(y).__name__, source=_SOURCE,
                          expected="no y with a dataset function")
      check_steps(steps_per_epoch, "a dataset function")
      x = feed.checked(x, field="x", source=_SOURCE)

      def batch():  # A per-replica batch per replica.
        size = _batch_size(x(tf.distribute.InputContext(
            introspect.num_input_workers(strategy), 0, replicas)))
        return size and size * replicas
      return cls(steps_per_epoch=steps_per_epoch, dataset_fn=x, batch=batch,
                 make=lambda skip: strategy.distribute_datasets_from_function(
                     skipping(x, skip)))
    if ps:
      raise ConfigError(
          field="x", value=type(x).__name__, source=_SOURCE,
          expected="a dataset function input_context -> tf.data.Dataset "
                   "under ParameterServerStrategy",
          hint="Each worker builds its own input: pass lambda ctx: "
               "make_dataset(ctx) and steps_per_epoch")
    if isinstance(x, tf.data.Dataset):
      if y is not None:
        raise ConfigError(field="y", value=type(y).__name__, source=_SOURCE,
                          expected="no y with a tf.data.Dataset")
      if replicas > 1 and not _is_batched(x):
        raise ConfigError(
            field="x", value=str(x.element_spec)[:120], source=_SOURCE,
            expected=f"a batched dataset whose global batches can be split "
                     f"over {replicas} replicas",
            hint="Call .batch(global_batch_size) on it, or pass a dataset "
                 "function that batches with "
                 "input_context.get_per_replica_batch_size(global_batch)")
      cardinality = int(x.cardinality())
      batch = lambda: _batch_size(x)
      if cardinality == tf.data.INFINITE_CARDINALITY:
        check_steps(steps_per_epoch, "an infinite dataset")
        return cls(steps_per_epoch=steps_per_epoch, make=_skipper(x),
                   batch=batch)
      if cardinality <= 0:
        check_steps(steps_per_epoch, "a dataset of unknown size")
      steps = steps_per_epoch or cardinality
      return cls(steps_per_epoch=steps, make=_skipper(x.repeat()),
                 batch=batch)
    if x is None:
      raise ConfigError(field="x", value=None, source=_SOURCE,
                        expected="arrays, a tf.data.Dataset or a dataset "
                                 "function")
    return cls._from_arrays(x, y, batch_size=batch_size or 32,
                            steps_per_epoch=steps_per_epoch, shuffle=shuffle,
                            seed=seed, replicas=replicas)

  @classmethod
  def _from_arrays(cls, x, y, *, batch_size, steps_per_epoch, shuffle, seed,
                   replicas) -> "Stream":
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ConfigError(field="batch_size", value=batch_size, source=_SOURCE,
                        expected="a positive integer")
    if batch_size % replicas:
      raise ConfigError(
          field="batch_size", value=batch_size, source=_SOURCE,
          expected=f"a multiple of the {replicas} replicas, so every replica "
                   "gets an equal share of the global batch")
    try:
      n = len(tf.nest.flatten(x)[0])
      arrays = tf.nest.map_structure(tf.convert_to_tensor,
                                     x if y is None else (x, y))
      tf.data.Dataset.from_tensor_slices(arrays)  # Checks equal lengths.
    except (TypeError, ValueError) as e:
      raise ConfigError(field="x", value=type(x).__name__, source=_SOURCE,
                        expected="arrays of equal length, a tf.data.Dataset "
                                 f"or a dataset function ({e})") from None

    def epoch_batches(epoch):
      order = tf.range(n, dtype=tf.int64)
      if shuffle:  # Stateless: epoch e has one order, however it is reached.
        order = tf.random.experimental.stateless_shuffle(
            order, seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
      return tf.data.Dataset.from_tensor_slices(order).batch(batch_size)

    data = tf.data.Dataset.counter().flat_map(epoch_batches).map(
        lambda idx: tf.nest.map_structure(lambda a: tf.gather(a, idx), arrays),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    steps = steps_per_epoch or math.ceil(n / batch_size)
    return cls(steps_per_epoch=steps, make=_skipper(data),
               batch=lambda: batch_size,
               samples=None if steps_per_epoch else n)


def _batch_node(dataset: tf.data.Dataset) -> tf.data.Dataset | None:
  """The last batching transformation on the dataset's input chain."""
  node = dataset
  for _ in range(100):
    if node is None or "batch" in type(node).__name__.lower():
      return node
    node = getattr(node, "_input_dataset", None)
  return None


def _is_batched(dataset: tf.data.Dataset) -> bool:
  """True when a batching transformation is on the dataset's input chain."""
  return bool(batching.static_batch_size(dataset)) or bool(_batch_node(dataset))


def _batch_size(dataset: tf.data.Dataset) -> int | None:
  """The batch size ``dataset`` was batched with, when it is a constant."""
  size = batching.static_batch_size(dataset)
  node = None if size else _batch_node(dataset)
  value = tf.get_static_value(getattr(node, "_batch_size", None))
  return size or (int(value) if value is not None else None)
