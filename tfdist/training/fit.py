"""`tfdist.fit`: Keras ``Model.fit`` plus what a distributed run needs.

* Every strategy: Mirrored, CentralStorage, MultiWorkerMirrored and TPU run
  Keras's own ``fit`` (with `keras_compat`'s corrections); ParameterServer runs
  a `ClusterCoordinator` loop that schedules Keras's own ``train_step`` on the
  workers, since Keras 3 has no coordinator path.
* The progress bar and logs appear on the chief only; ``backup_dir=`` resumes
  inside an epoch (`tfdist.training.backup`; under ParameterServerStrategy
  steps are at-least-once); ``tensorboard_dir=`` and path-writing callbacks
  write their real path on the chief and a temporary one elsewhere.

This module is the entry and the Keras path; the resumable input is in
`tfdist.training._input`, the ParameterServerStrategy loop in
`tfdist.training._ps_loop` and the lost-peer errors in
`tfdist.training._worker_errors`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import keras

from tfdist.errors import ConfigError
from tfdist.strategy import introspect
from tfdist.training import _input
from tfdist.training import _ps_loop
from tfdist.training import _worker_errors
from tfdist.training import backup as backup_lib
from tfdist.training import callbacks as callbacks_lib
from tfdist.training import preemption as preemption_lib

__all__ = ["fit"]

_SOURCE = "tfdist.fit"


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
    steps_per_epoch: steps per epoch, a positive integer; needed for a
      ``dataset_fn`` and an infinite dataset.
    callbacks: Keras callbacks; path-writing ones are made chief-aware.
    validation_data: as in ``Model.fit``; under ParameterServerStrategy a
      dataset or ``dataset_fn`` with ``validation_steps``.
    validation_steps: as in ``Model.fit``.
    verbose: as in ``Model.fit``, on the chief; 0 on other workers.
    shuffle: shuffle arrays each epoch, by a stateless function of ``seed``
      and the epoch, so a resumed run sees the same order.
    seed: the shuffle seed for arrays.
    initial_epoch: as in ``Model.fit``.
    backup_dir: fault-tolerant resume from this directory (a relative path
      is read against the working directory). It belongs to this job: one
      holding another job's backup or other files is refused. With it,
      SIGTERM or SIGUSR1 makes every worker save at the same step and raise
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
      plain dataset under ParameterServerStrategy, an unbatched dataset that
      must be split over replicas, a ``dataset_fn`` that returns no dataset,
      a count that would never end an epoch (``steps_per_epoch`` < 1, a
      negative ``initial_epoch``, a ``steps_per_epoch`` the saved step is
      not below), or a ``backup_dir`` of another job.
    PreemptedError: a preemption signal came; the backup holds the step.
    WorkerLostError: a peer died or stopped answering mid-training.
    CheckpointError: ``backup_dir`` holds backups and none is readable.
  """
  strategy = model.distribute_strategy
  if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
    raise ConfigError(field="epochs", value=epochs, source=_SOURCE,
                      expected="a positive integer")
  if (not isinstance(initial_epoch, int) or isinstance(initial_epoch, bool)
      or initial_epoch < 0):
    raise ConfigError(field="initial_epoch", value=initial_epoch,
                      source=_SOURCE, expected="an integer >= 0")
  if backup_every_steps is not None and (
      not isinstance(backup_every_steps, int) or backup_every_steps < 1):
    raise ConfigError(field="backup_every_steps", value=backup_every_steps,
                      source=_SOURCE, expected="a positive integer or None")
  ps = introspect.is_parameter_server(strategy)
  stream = _input.Stream.make(x, y, strategy=strategy, batch_size=batch_size,
                               steps_per_epoch=steps_per_epoch,
                               shuffle=shuffle, seed=seed, ps=ps)
  chief = introspect.is_chief(strategy)
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
    batch, samples = stream.sizes()
    backup.manage(model, steps_per_epoch=stream.steps_per_epoch,
                  global_batch=batch, samples_per_epoch=samples)
    restored = backup.restore()
    if restored is not None:
      epoch, step = restored
  with callbacks_lib.chief_aware(list(callbacks or ()) + extra,
                                 strategy) as cbs:
    if backup:
      cbs.append(backup)
    run = _ps_loop.fit_parameter_server if ps else _fit_keras
    # Without a backup there is nowhere to save: signals keep their meaning.
    watching = (preemption_lib.PreemptionWatcher(strategy) if backup
                else contextlib.nullcontext())
    with watching as watcher, _worker_errors.worker_errors(strategy):
      if backup:
        backup.begin(watcher)
      history = run(model, stream, cbs, epochs=epochs, epoch=epoch, step=step,
                    verbose=verbose, validation_data=validation_data,
                    validation_steps=validation_steps, backup=backup,
                    fit_kwargs=fit_kwargs)
  if backup:
    backup.finished()
  return history


def _fit_keras(model: keras.Model, stream: _input.Stream,
               cbs: Sequence[keras.callbacks.Callback], *, epochs: int,
               epoch: int, step: int, verbose: Any, validation_data: Any,
               validation_steps: int | None,
               backup: backup_lib.BackupAndRestore | None,
               fit_kwargs: dict[str, Any]) -> keras.callbacks.History:
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
    backup.resume(step)
    part = model.fit(stream.skipping(epoch * s + step), initial_epoch=epoch,
                     epochs=epoch + 1, steps_per_epoch=s - step, **common)
    backup.resume(0)
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
