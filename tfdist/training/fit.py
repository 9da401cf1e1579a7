"""`tfdist.fit`: Keras ``Model.fit`` plus what a distributed run needs.

* Every strategy: Mirrored, CentralStorage, MultiWorkerMirrored and TPU run
  Keras's own ``fit`` (with `keras_compat`'s corrections); ParameterServer runs
  a `ClusterCoordinator` loop that schedules Keras's own ``train_step`` on the
  workers, since Keras 3 has no coordinator path.
* The progress bar and logs appear on the chief only.
* ``backup_dir=``: resume inside an epoch. The model, the optimizer and the
  position (epoch, step within the epoch) are checkpointed by the chief; a
  restarted run restores them and skips exactly the batches already applied,
  so no step is applied twice (synchronous strategies; under
  ParameterServerStrategy steps are at-least-once and the data restarts).
  The backup is removed when training completes, as Keras's own
  ``BackupAndRestore`` does.
* ``tensorboard_dir=``: TensorBoard logs written by the chief only; any
  ``ModelCheckpoint``/``TensorBoard``/``CSVLogger`` you pass writes its real
  path on the chief and a temporary one elsewhere.

Input: arrays (``x``, ``y``), a batched ``tf.data.Dataset`` of global batches,
or a ``dataset_fn(input_context)`` giving per-replica batches (required under
ParameterServerStrategy). For exact resume the input must be deterministic:
arrays are shuffled with ``seed``; a dataset should shuffle with a seed.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.data import batching
from tfdist.errors import ConfigError
from tfdist.errors import WorkerLostError
from tfdist.training import backup as backup_lib
from tfdist.training import callbacks as callbacks_lib
from tfdist.training import chief as chief_lib
from tfdist.training import preemption as preemption_lib

__all__ = ["fit"]

_SOURCE = "tfdist.fit"
DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


def fit(model: keras.Model, x: Any = None, y: Any = None, *,
        batch_size: int | None = None, epochs: int = 1,
        steps_per_epoch: int | None = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        validation_data: Any = None, validation_steps: int | None = None,
        verbose: Any = "auto", shuffle: bool = True, seed: int = 0,
        initial_epoch: int = 0, backup_dir: str | None = None,
        backup_every_steps: int | None = None,
        tensorboard_dir: str | None = None,
        **fit_kwargs: Any) -> keras.callbacks.History:
  """Trains ``model`` under the strategy it was built in.

  Args:
    model: a compiled Keras model, built and compiled under
      ``strategy.scope()``.
    x: arrays, a batched ``tf.data.Dataset`` of global batches, or a
      ``dataset_fn(input_context)`` of per-replica batches.
    y: targets when ``x`` holds arrays.
    batch_size: the global batch size for arrays (32 by default).
    epochs: as in ``Model.fit``.
    steps_per_epoch: steps per epoch; needed for a ``dataset_fn`` and an
      infinite dataset.
    callbacks: Keras callbacks; path-writing ones are made chief-aware.
    validation_data: as in ``Model.fit``; under ParameterServerStrategy a
      dataset or ``dataset_fn`` with ``validation_steps``.
    validation_steps: as in ``Model.fit``.
    verbose: as in ``Model.fit``, on the chief; 0 on other workers.
    shuffle: shuffle arrays each epoch, by a stateless function of ``seed``
      and the epoch, so a resumed run sees the same order.
    seed: the shuffle seed for arrays.
    initial_epoch: as in ``Model.fit``.
    backup_dir: fault-tolerant resume from this directory. With it, SIGTERM
      or SIGUSR1 makes every worker save at the same step and raise
      `tfdist.PreemptedError` (exit code 42 when uncaught); see
      docs/fault_tolerance.md.
    backup_every_steps: also back up every this many steps inside an epoch;
      by default only at epoch ends.
    tensorboard_dir: TensorBoard logs, written by the chief.
    **fit_kwargs: passed on to ``Model.fit`` (e.g. ``class_weight``).

  Returns:
    The ``History`` of the epochs trained by this call.

  Raises:
    ConfigError: input or options that cannot serve the strategy, e.g. a
      plain dataset under ParameterServerStrategy, or an unbatched dataset
      that must be split over replicas.
    PreemptedError: a preemption signal came; the backup holds the step.
    WorkerLostError: a peer died or stopped answering mid-training.
    CheckpointError: ``backup_dir`` holds backups and none is readable.
  """
  strategy = model.distribute_strategy
  if not isinstance(epochs, int) or epochs < 1:
    raise ConfigError(field="epochs", value=epochs, source=_SOURCE,
                      expected="a positive integer")
  if backup_every_steps is not None and (
      not isinstance(backup_every_steps, int) or backup_every_steps < 1):
    raise ConfigError(field="backup_every_steps", value=backup_every_steps,
                      source=_SOURCE, expected="a positive integer or None")
  ps = isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)
  stream = _Stream.make(x, y, strategy=strategy, batch_size=batch_size,
                        steps_per_epoch=steps_per_epoch, shuffle=shuffle,
                        seed=seed, ps=ps)
  chief = chief_lib.is_chief(strategy)
  if not chief:
    verbose = 0
  extra = []
  if tensorboard_dir:
    extra.append(keras.callbacks.TensorBoard(tensorboard_dir,
                                             write_graph=not ps))
  backup = None
  epoch, step = initial_epoch, 0
  if backup_dir:
    backup = backup_lib.BackupAndRestore(
        backup_dir, save_freq=backup_every_steps or "epoch")
    backup.manage(model, steps_per_epoch=stream.steps_per_epoch)
    restored = backup.restore()
    if restored is not None:
      epoch, step = restored
  with callbacks_lib.chief_aware(list(callbacks or ()) + extra,
                                 strategy) as cbs:
    if backup:
      cbs.append(backup)
    run = _fit_parameter_server if ps else _fit_keras
    # Without a backup there is nowhere to save: signals keep their meaning.
    watching = (preemption_lib.PreemptionWatcher(strategy) if backup
                else contextlib.nullcontext())
    with watching as watcher, _worker_errors(strategy):
      if backup:
        backup.watcher = watcher
      history = run(model, stream, cbs, epochs=epochs, epoch=epoch, step=step,
                    verbose=verbose, validation_data=validation_data,
                    validation_steps=validation_steps, backup=backup,
                    fit_kwargs=fit_kwargs)
  if backup:
    backup.finished()
  return history


class _Stream:
  """The input as one stream of batches over all epochs, so it can resume."""

  def __init__(self, *, steps_per_epoch: int, make: Callable[[int], Any],
               dataset_fn: DatasetFn | None = None):
    self.steps_per_epoch = steps_per_epoch
    self._make = make
    self.dataset_fn = dataset_fn

  def skipping(self, steps: int) -> Any:
    """The input, ``steps`` steps in."""
    return self._make(steps)

  @classmethod
  def make(cls, x, y, *, strategy, batch_size, steps_per_epoch, shuffle,
           seed, ps) -> "_Stream":
    replicas = strategy.num_replicas_in_sync
    if callable(x) and not isinstance(x, tf.data.Dataset):
      if y is not None:
        raise ConfigError(field="y", value=type(y).__name__, source=_SOURCE,
                          expected="no y with a dataset function")
      _check_steps(steps_per_epoch, "a dataset function")
      return cls(steps_per_epoch=steps_per_epoch, dataset_fn=x,
                 make=lambda skip: strategy.distribute_datasets_from_function(
                     _skipping_fn(x, skip)))
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
      if cardinality == tf.data.INFINITE_CARDINALITY:
        _check_steps(steps_per_epoch, "an infinite dataset")
        return cls(steps_per_epoch=steps_per_epoch, make=x.skip)
      if cardinality <= 0:
        _check_steps(steps_per_epoch, "a dataset of unknown size")
      steps = steps_per_epoch or cardinality
      return cls(steps_per_epoch=steps, make=x.repeat().skip)
    if x is None:
      raise ConfigError(field="x", value=None, source=_SOURCE,
                        expected="arrays, a tf.data.Dataset or a dataset "
                                 "function")
    return cls._from_arrays(x, y, batch_size=batch_size or 32,
                            steps_per_epoch=steps_per_epoch, shuffle=shuffle,
                            seed=seed, replicas=replicas)

  @classmethod
  def _from_arrays(cls, x, y, *, batch_size, steps_per_epoch, shuffle, seed,
                   replicas) -> "_Stream":
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
    return cls(steps_per_epoch=steps, make=data.skip)


def _check_steps(steps, what: str) -> None:
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
    raise ConfigError(field="steps_per_epoch", value=steps, source=_SOURCE,
                      expected=f"a positive integer for {what}")


def _skipping_fn(dataset_fn: DatasetFn, steps: int) -> DatasetFn:
  """Skips ``steps`` steps of per-replica batches in each input pipeline."""
  if not steps:
    return dataset_fn

  def skipped(ctx):
    return dataset_fn(ctx).skip(
        steps * (ctx.num_replicas_in_sync // ctx.num_input_pipelines))
  return skipped


def _is_batched(dataset: tf.data.Dataset) -> bool:
  """True when a batching transformation is on the dataset's input chain."""
  if batching.static_batch_size(dataset):
    return True
  seen = 0
  node = dataset
  while node is not None and seen < 100:
    if "batch" in type(node).__name__.lower():
      return True
    node = getattr(node, "_input_dataset", None)
    seen += 1
  return False


@contextlib.contextmanager
def _worker_errors(strategy):
  """Turns TensorFlow's errors for a lost peer into WorkerLostError.

  Under ParameterServerStrategy the coordinator itself tolerates a lost
  worker (it reschedules the worker's steps), so an error that gets here most
  likely means a ps task was lost: the message names it, since its variables
  are gone and only a restart of the whole cluster can go on.
  """
  try:
    yield
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
          tf.errors.AbortedError, tf.errors.CancelledError) as e:
    task_type, task_id, cluster = chief_lib.task_of(strategy)
    me = f"{task_type}:{task_id}" if task_type else "this process"
    cause = f"{type(e).__name__}: {_summary(e)}"
    lost_ps = (_lost_ps_tasks(cluster.get("ps", []), e)
               if _is_ps_strategy(strategy) else [])
    if lost_ps:
      raise WorkerLostError(
          f"{me}: parameter server task {', '.join(lost_ps)} was lost "
          f"mid-training ({cause}). Its variables are gone, so this run "
          "cannot go on: restart the whole cluster, ps, workers and chief "
          "(tfdist launch --max-restarts K, or SLURM's requeue); with "
          "backup_dir training resumes from the last backup, restored onto "
          "the new ps tasks") from e
    raise WorkerLostError(
        f"{me}: a peer task died, stopped or stopped answering mid-training "
        f"({cause}). Restart the cluster (tfdist launch --max-restarts K, or "
        "SLURM's requeue); with backup_dir training resumes from the last "
        "backup") from e


# TensorFlow names the remote task an RPC failed on, e.g. "GRPC error
# information from remote target /job:ps/replica:0/task:1".
_REMOTE_PS = re.compile(r"remote target /job:ps/replica:\d+/task:(\d+)")
_GENERIC_LINE = re.compile(r"^(graph execution error:|\d+ root error\(s\) "
                           r"found\.)$", re.IGNORECASE)


def _is_ps_strategy(strategy: tf.distribute.Strategy) -> bool:
  return isinstance(strategy,
                    tf.distribute.experimental.ParameterServerStrategy)


def _summary(error: Exception, limit: int = 300) -> str:
  """The first informative line of a TensorFlow error message."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  for line in lines:
    if not _GENERIC_LINE.match(line):
      return line[:limit]
  return (lines[0] if lines else "no message")[:limit]


def _lost_ps_tasks(addresses, error: Exception) -> list[str]:
  """The ps tasks a ParameterServerStrategy error names, e.g. ``ps:0 at A``.

  A task is named when TensorFlow's message names it as a remote target or
  names its address (``addresses``: the cluster's ps job).
  """
  text = str(error)
  if isinstance(addresses, dict):  # A sparse cluster: {index: address}.
    addresses = [addresses.get(i, "?") for i in range(max(addresses) + 1)]
  lost = {int(i) for i in _REMOTE_PS.findall(text)}
  lost.update(i for i, address in enumerate(addresses)
              if re.search(re.escape(address) + r"(?!\d)", text))
  return [f"ps:{i} at {addresses[i]}" if i < len(addresses) else f"ps:{i}"
          for i in sorted(lost)]


def _fit_keras(model, stream, cbs, *, epochs, epoch, step, verbose,
               validation_data, validation_steps, backup, fit_kwargs):
  """Keras's own fit; a partial first epoch when resuming mid-epoch."""
  s = stream.steps_per_epoch
  common = dict(callbacks=cbs, verbose=verbose, validation_data=validation_data,
                validation_steps=validation_steps, shuffle=False, **fit_kwargs)
  history = keras.callbacks.History()
  history.set_model(model)
  history.on_train_begin()  # Starts empty epoch and history records.
  if epoch >= epochs:
    return history
  if step:
    backup.offset = step
    part = model.fit(stream.skipping(epoch * s + step), initial_epoch=epoch,
                     epochs=epoch + 1, steps_per_epoch=s - step, **common)
    backup.offset = 0
    _merge(history, part)
    epoch += 1
  if epoch < epochs:
    rest = model.fit(stream.skipping(epoch * s), initial_epoch=epoch,
                     epochs=epochs, steps_per_epoch=s, **common)
    _merge(history, rest)
  return history


def _merge(into: keras.callbacks.History, part: keras.callbacks.History):
  into.epoch.extend(part.epoch)
  for key, values in part.history.items():
    into.history.setdefault(key, []).extend(values)


def _fit_parameter_server(model, stream, cbs, *, epochs, epoch, step, verbose,
                          validation_data, validation_steps, backup,
                          fit_kwargs):
  """Schedules Keras's own ``train_step`` on the workers."""
  if fit_kwargs:
    raise ConfigError(field=sorted(fit_kwargs)[0], value="given",
                      source=_SOURCE,
                      expected="no extra Model.fit arguments under "
                               "ParameterServerStrategy")
  strategy = model.distribute_strategy
  s = stream.steps_per_epoch
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  _build_for_coordinator(model, stream.dataset_fn)
  train_iter = _per_worker_iterator(coordinator, strategy, stream.dataset_fn)

  @tf.function
  def train_fn(iterator):
    return strategy.run(model.train_step, args=(next(iterator),))

  @tf.function
  def test_fn(iterator):
    return strategy.run(model.test_step, args=(next(iterator),))

  history = keras.callbacks.History()
  callback_list = keras.callbacks.CallbackList(
      list(cbs) + [history], add_progbar=verbose != 0, model=model,
      verbose=1 if verbose == "auto" else verbose, epochs=epochs, steps=s)
  callback_list.on_train_begin()
  logs: dict[str, float] = {}
  for e in range(epoch, epochs):
    callback_list.on_epoch_begin(e)
    model.reset_metrics()
    first = step if e == epoch else 0
    if backup:
      backup.offset = first
    for batch in range(first, s):
      callback_list.on_train_batch_begin(batch - first)
      coordinator.schedule(train_fn, args=(train_iter,))
      if backup and backup.watcher and backup.watcher.should_stop():
        coordinator.join()
        backup.preempt(e, batch + 1)
      if backup and backup.due(batch + 1):
        coordinator.join()  # The backup must hold every step scheduled so far.
      callback_list.on_train_batch_end(batch - first, {})
    coordinator.join()
    logs = _results(model)
    if validation_data is not None:
      logs.update(_validate_ps(model, coordinator, strategy, test_fn,
                               validation_data, validation_steps))
    callback_list.on_epoch_end(e, logs)
    if model.stop_training:
      break
  callback_list.on_train_end(logs)
  return history


def _validate_ps(model, coordinator, strategy, test_fn, data, steps):
  if not callable(data) or isinstance(data, tf.data.Dataset):
    raise ConfigError(field="validation_data", value=type(data).__name__,
                      source=_SOURCE,
                      expected="a dataset function under "
                               "ParameterServerStrategy")
  _check_steps(steps, "validation under ParameterServerStrategy")
  model.reset_metrics()
  iterator = _per_worker_iterator(coordinator, strategy, data)
  for _ in range(steps):
    coordinator.schedule(test_fn, args=(iterator,))
  coordinator.join()
  return {f"val_{k}": v for k, v in _results(model).items()}


def _results(model) -> dict[str, float]:
  return {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()}


def _per_worker_iterator(coordinator, strategy, dataset_fn):
  return iter(coordinator.create_per_worker_dataset(
      lambda: strategy.distribute_datasets_from_function(dataset_fn)))


def _build_for_coordinator(model, dataset_fn) -> None:
  """Creates the optimizer and metric variables on the coordinator.

  Scheduled functions must not create variables, so everything Keras builds
  lazily on the first step is built here from one local batch.
  """
  strategy = model.distribute_strategy
  batch = next(iter(dataset_fn(tf.distribute.InputContext())))
  with strategy.scope():
    model._symbolic_build(data_batch=batch)  # pylint: disable=protected-access
    if not model.optimizer.built:
      model.optimizer.build(model.trainable_variables)
