"""`tfdist.fit` under ParameterServerStrategy: a ClusterCoordinator loop.

Keras 3's ``Model.fit`` has no ClusterCoordinator path, so this loop
schedules Keras's own ``train_step`` (and ``test_step`` for validation) on
the workers, drives the callbacks as ``fit`` would, and backs up through
`tfdist.BackupAndRestore`'s driven API. Steps are at-least-once: a lost
worker's steps are rescheduled and the data starts over on resume.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.data import feed
from tfdist.data.feed import DatasetFn
from tfdist.errors import ConfigError
from tfdist.training import _input
from tfdist.training import backup as backup_lib

__all__ = ["fit_parameter_server"]

_SOURCE = "tfdist.fit"


def fit_parameter_server(
    model: keras.Model, stream: _input.Stream,
    cbs: Sequence[keras.callbacks.Callback], *, epochs: int, epoch: int,
    step: int, verbose: Any, validation_data: Any,
    validation_steps: int | None,
    backup: backup_lib.BackupAndRestore | None,
    fit_kwargs: dict[str, Any]) -> keras.callbacks.History:
  """Schedules Keras's own ``train_step`` on the workers; `tfdist.fit`'s
  arguments, starting ``step`` steps into ``epoch`` (from ``backup``), the
  callbacks ``cbs`` already chief-aware.

  Returns:
    The ``History`` of the epochs trained.

  Raises:
    ConfigError: extra ``Model.fit`` arguments, or validation input that is
      not a dataset function with ``validation_steps``.
  """
  if fit_kwargs:
    raise ConfigError(field=sorted(fit_kwargs)[0], value="given",
                      source=_SOURCE,
                      expected="no extra Model.fit arguments under "
                               "ParameterServerStrategy")
  strategy = model.distribute_strategy
  s = stream.steps_per_epoch
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  _build_for_coordinator(model, stream.dataset_fn)
  train_iter = _input.per_worker_iterator(coordinator, strategy,
                                          stream.dataset_fn)

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
      backup.resume(first)
    for batch in range(first, s):
      callback_list.on_train_batch_begin(batch - first)
      coordinator.schedule(train_fn, args=(train_iter,))
      if backup and backup.should_stop():
        coordinator.join()
        backup.preempt(e, batch + 1)
      if backup and backup.due(batch + 1):
        coordinator.join()  # The backup must hold every step scheduled so far.
      callback_list.on_train_batch_end(batch - first, {})
    coordinator.join()
    logs = _results(model)
    if validation_data is not None:
      logs.update(_validate(model, coordinator, test_fn, validation_data,
                            validation_steps))
    callback_list.on_epoch_end(e, logs)
    if model.stop_training:
      break
  callback_list.on_train_end(logs)
  return history


def _validate(model, coordinator, test_fn, data, steps) -> dict[str, float]:
  if not callable(data) or isinstance(data, tf.data.Dataset):
    raise ConfigError(field="validation_data", value=type(data).__name__,
                      source=_SOURCE,
                      expected="a dataset function under "
                               "ParameterServerStrategy")
  _input.check_steps(steps, "validation under ParameterServerStrategy")
  model.reset_metrics()
  iterator = _input.per_worker_iterator(
      coordinator, model.distribute_strategy,
      feed.checked(data, field="validation_data", source=_SOURCE))
  for _ in range(steps):
    coordinator.schedule(test_fn, args=(iterator,))
  coordinator.join()
  return {f"val_{k}": v for k, v in _results(model).items()}


def _results(model) -> dict[str, float]:
  return {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()}


def _build_for_coordinator(model: keras.Model, dataset_fn: DatasetFn) -> None:
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
