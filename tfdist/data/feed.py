"""Feeding a strategy: per-replica batches from an `InputContext` function.

The recommended path is `distribute`: you write ``examples_fn(input_context)``
returning this input pipeline's unbatched examples (e.g. `load_tfds` with the
context, which shards by file), and tfdist batches them with
``input_context.get_per_replica_batch_size(global_batch_size)``, drops the
remainder on TPUs, prefetches, and calls
``strategy.distribute_datasets_from_function``.

`make_dataset_fn` returns the same batched ``dataset_fn`` without
distributing it, for the APIs that take one themselves:
``ClusterCoordinator.create_per_worker_dataset`` under
ParameterServerStrategy, or ``strategy.distribute_datasets_from_function``
called by hand. `distribute_dataset` is for a dataset already batched with the
global batch size (``strategy.experimental_distribute_dataset``), with the
shard policy stated instead of ``AUTO``.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfdist.data import batching as batching_lib
from tfdist.data import sharding
from tfdist.errors import ConfigError
from tfdist.strategy import introspect

__all__ = ["DatasetFn", "checked", "distribute", "distribute_dataset",
           "make_dataset_fn"]

#: ``input_context -> tf.data.Dataset``, as
#: ``distribute_datasets_from_function`` and ``create_per_worker_dataset``
#: take it.
DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]
#: A function applied to each example before batching.
MapFn = Callable[..., Any]


def make_dataset_fn(examples_fn: DatasetFn, *, global_batch_size: int,
                    drop_remainder: bool = False,
                    shard_by_data: bool = False,
                    map_fn: MapFn | None = None,
                    shuffle_buffer_size: int = 0,
                    seed: int | None = None,
                    repeat: bool = False) -> DatasetFn:
  """Wraps ``examples_fn`` into a ``dataset_fn`` of per-replica batches.

  The function maps, shuffles, repeats, batches and prefetches; its dataset is
  marked ``OFF`` for auto-sharding, since this pipeline's share was chosen
  already, by ``examples_fn`` or by ``shard_by_data``.

  Args:
    examples_fn: returns this input pipeline's unbatched examples, e.g.
      ``lambda ctx: load_tfds(name, split=..., input_context=ctx)``.
    global_batch_size: examples per step over all replicas; the context
      divides it by ``num_replicas_in_sync``.
    drop_remainder: drop the last, smaller batch (needed on TPUs).
    shard_by_data: ``examples_fn`` returns the whole dataset; keep every n-th
      example here (`tfdist.data.shard_by_data`).
    map_fn: applied to each example before batching, in parallel.
    shuffle_buffer_size: examples in the shuffle buffer; 0 does not shuffle.
    seed: the shuffle seed.
    repeat: repeat forever (steps are then bounded by the training loop, as
      ParameterServerStrategy requires).

  Returns:
    ``dataset_fn(input_context) -> tf.data.Dataset``. Called with ``None`` it
    reads as the only pipeline of one replica.
  """
  batching_lib.Batching.resolve(num_replicas=1,
                                global_batch_size=global_batch_size,
                                source="make_dataset_fn")
  if isinstance(shuffle_buffer_size, bool) or not isinstance(
      shuffle_buffer_size, int) or shuffle_buffer_size < 0:
    raise ConfigError(field="shuffle_buffer_size", value=shuffle_buffer_size,
                      expected="a non-negative integer (0: no shuffle)",
                      source="make_dataset_fn")

  def dataset_fn(input_context: tf.distribute.InputContext | None = None
                 ) -> tf.data.Dataset:
    context = input_context or tf.distribute.InputContext()
    try:
      per_replica = context.get_per_replica_batch_size(global_batch_size)
    except ValueError:
      raise ConfigError(
          field="global_batch_size", value=global_batch_size,
          expected=(f"a multiple of the {context.num_replicas_in_sync} "
                    "replicas in sync"),
          source="make_dataset_fn") from None
    dataset = examples_fn(context)
    _check_dataset(dataset, "examples_fn", source="make_dataset_fn")
    if shard_by_data:
      dataset = sharding.shard_by_data(dataset, context)
    if map_fn is not None:
      dataset = dataset.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
    if shuffle_buffer_size:
      dataset = dataset.shuffle(shuffle_buffer_size, seed=seed)
    if repeat:
      dataset = dataset.repeat()
    dataset = dataset.batch(per_replica, drop_remainder=drop_remainder)
    dataset = sharding.set_shard_policy(dataset, sharding.ShardPolicy.OFF)
    return dataset.prefetch(tf.data.AUTOTUNE)

  return dataset_fn


def distribute(strategy: tf.distribute.Strategy, examples_fn: DatasetFn, *,
               global_batch_size: int | None = None,
               per_replica_batch_size: int | None = None,
               drop_remainder: bool | None = None,
               shard_by_data: bool = False,
               map_fn: MapFn | None = None,
               shuffle_buffer_size: int = 0,
               seed: int | None = None,
               repeat: bool = False,
               coordinator: Any = None,
               options: tf.distribute.InputOptions | None = None) -> Any:
  """Distributes per-replica batches of ``examples_fn``'s examples.

  Args:
    strategy: the strategy to feed.
    examples_fn: ``input_context -> tf.data.Dataset`` of this pipeline's
      unbatched examples (see `make_dataset_fn`).
    global_batch_size: examples per step over all replicas.
    per_replica_batch_size: or examples per step per replica; give one.
    drop_remainder: ``None``: exactly on TPU strategies.
    shard_by_data, map_fn, shuffle_buffer_size, seed, repeat: as in
      `make_dataset_fn`.
    coordinator: the ``ClusterCoordinator``, required with
      ParameterServerStrategy, whose datasets live on the workers.
    options: ``tf.distribute.InputOptions`` for the distribution.

  Returns:
    A ``DistributedDataset`` (``model.fit`` and ``strategy.run`` loops take
    it), or a ``PerWorkerDataset`` under ParameterServerStrategy.

  Raises:
    ConfigError: batch sizes as in `tfdist.data.Batching.resolve`;
      ``drop_remainder=False`` on a TPU; ParameterServerStrategy without a
      coordinator.
  """
  batching = batching_lib.batching_for(
      strategy, global_batch_size=global_batch_size,
      per_replica_batch_size=per_replica_batch_size,
      drop_remainder=drop_remainder, source="distribute")
  dataset_fn = make_dataset_fn(
      examples_fn, global_batch_size=batching.global_batch_size,
      drop_remainder=batching.drop_remainder, shard_by_data=shard_by_data,
      map_fn=map_fn, shuffle_buffer_size=shuffle_buffer_size, seed=seed,
      repeat=repeat)
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    if coordinator is None:
      raise ConfigError(
          field="coordinator", expected=(
              "the tf.distribute.experimental.coordinator.ClusterCoordinator "
              "of this ParameterServerStrategy"),
          source="distribute",
          hint=("Its datasets are created on the workers by "
                "coordinator.create_per_worker_dataset; or pass "
                "make_dataset_fn(...) to it yourself"))
    return coordinator.create_per_worker_dataset(dataset_fn)
  return strategy.distribute_datasets_from_function(dataset_fn, options)


def distribute_dataset(strategy: tf.distribute.Strategy,
                       dataset: tf.data.Dataset, *,
                       global_batch_size: int | None = None,
                       num_files: int | None = None,
                       options: tf.distribute.InputOptions | None = None
                       ) -> Any:
  """``experimental_distribute_dataset`` with the batch and shards stated.

  The shard policy comes from `tfdist.data.choose_shard_policy` and is written
  into the dataset's options, so TensorFlow neither guesses (``AUTO``) nor
  warns.

  Args:
    strategy: the strategy to feed.
    dataset: batched with the global batch size.
    global_batch_size: the global batch size; by default the dataset's
      static batch dimension (``batch(..., drop_remainder=True)``).
    num_files: the files ``dataset`` reads (FILE sharding when there are at
      least as many as workers); ``None`` when it reads none or is unknown.
    options: ``tf.distribute.InputOptions``.

  Returns:
    The ``DistributedDataset``.

  Raises:
    ConfigError: more than one replica and no known global batch size; a
      global batch size that disagrees with the dataset's or does not divide
      by the replicas; a TPU strategy and a batch dimension that is not
      static; ParameterServerStrategy (use `distribute`).
  """
  _check_dataset(dataset, "dataset")
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    raise ConfigError(
        field="strategy", value=type(strategy).__name__,
        expected="a strategy that distributes a dataset in this process",
        source="distribute_dataset",
        hint="Use tfdist.data.distribute(..., coordinator=...) instead")
  static = batching_lib.static_batch_size(dataset)
  replicas = strategy.num_replicas_in_sync
  tpu = batching_lib.is_tpu_strategy(strategy)
  if global_batch_size is None:
    if static is None and (replicas > 1 or tpu):
      raise ConfigError(
          field="global_batch_size", value=None,
          expected=(f"the global batch size to split over {replicas} "
                    "replicas: given, or the static batch dimension of the "
                    f"dataset (element_spec {dataset.element_spec})"),
          source="distribute_dataset",
          hint=("Batch with drop_remainder=True, pass global_batch_size=, or "
                "use tfdist.data.distribute for per-replica batches"))
    global_batch_size = static
  elif static is not None and static != global_batch_size:
    raise ConfigError(
        field="global_batch_size", value=global_batch_size,
        expected=f"{static}, the dataset's static batch dimension",
        source="distribute_dataset")
  if tpu and static is None:
    raise ConfigError(
        field="dataset", value=str(dataset.element_spec),
        expected="a static batch dimension: TPUs need batch(...,"
                 " drop_remainder=True)",
        source="distribute_dataset")
  if global_batch_size is not None:
    batching_lib.Batching.resolve(
        num_replicas=replicas, global_batch_size=global_batch_size,
        drop_remainder=static is not None, source="distribute_dataset")
  policy = sharding.choose_shard_policy(
      num_workers=introspect.num_input_workers(strategy), num_files=num_files)
  dataset = sharding.set_shard_policy(dataset, policy)
  return strategy.experimental_distribute_dataset(dataset, options)


def checked(dataset_fn: DatasetFn, *, field: str, source: str) -> DatasetFn:
  """``dataset_fn``, raising a `tfdist.ConfigError` when it returns no dataset.

  Without it a ``dataset_fn`` that returns a NumPy array or ``None`` fails
  deep inside ``tf.distribute`` with a traceback that does not name it.

  Args:
    dataset_fn: ``input_context -> tf.data.Dataset``.
    field: its argument name, for the message.
    source: the API it was given to, for the message.
  """
  def dataset_fn_checked(input_context=None):
    dataset = dataset_fn(input_context)
    _check_dataset(dataset, field, source=source,
                   what="a function that returns a tf.data.Dataset")
    return dataset
  return dataset_fn_checked


def _check_dataset(dataset: Any, field: str, *, source: str = "tfdist.data",
                   what: str = "a tf.data.Dataset") -> None:
  if not isinstance(dataset, tf.data.Dataset):
    raise ConfigError(field=field, value=type(dataset).__name__,
                      expected=what, source=source)
