"""`BackupAndRestore`: exact mid-epoch resume and preemption for ``fit``.

A drop-in replacement for ``keras.callbacks.BackupAndRestore`` for plain
``model.fit`` under a tfdist strategy, and the backup behind
``tfdist.fit(backup_dir=...)``. It checkpoints the model, the optimizer and
the position (epoch, step within the epoch, the global batch and the number
of workers):

* the chief writes ``backup_dir``; other workers write a temporary directory
  that is removed at once (`tfdist.training.chief.write_dir`);
* on SIGTERM or SIGUSR1 every worker saves at the same step and
  `tfdist.PreemptedError` (exit code 42) ends training
  (`tfdist.training.preemption`);
* a restarted ``fit`` resumes at the saved step: the batches already applied
  are drawn from the input and dropped, never applied twice (Keras's own
  callback re-applies a partial epoch's steps);
* the backup directory belongs to one job: the chief records the model's
  architecture, its variables and the cluster shapes in it (`tfdist.training.ownership`) and
  another job's, or a directory of other files, is refused before anything
  is read or written; every worker agrees on the restored position before
  training;
* a backup resumes on any number of workers. With the same global batch it
  resumes at the same step; with another one (a ``dataset_fn`` of
  per-replica batches on another number of replicas, or a changed batch) at
  the same sample of the epoch, rounded down to a whole batch, and the chief
  logs one line saying what changed. Under plain ``model.fit`` the callback
  cannot see fit's batch size and resumes at the saved step;
* when training completes, what tfdist wrote there is removed, and nothing
  else.

Exact resume needs an input that gives the same batches in the same order on
every run: a dataset shuffled with a seed, or arrays with ``shuffle=False``
(``tfdist.fit`` shuffles arrays statelessly, per epoch, by itself).
"""

from __future__ import annotations

from typing import Any

from absl import logging
import keras
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.strategy import introspect
from tfdist.training import _input
from tfdist.training import checkpoints as checkpoints_lib
from tfdist.training import chief as chief_lib
from tfdist.training import ownership
from tfdist.training import preemption as preemption_lib

__all__ = ["BackupAndRestore"]

_SOURCE = "tfdist.BackupAndRestore"


class BackupAndRestore(keras.callbacks.Callback):
  """Backs up training state; restores it, mid-epoch, when ``fit`` restarts.

  Under plain ``model.fit`` it drives itself from Keras's callback hooks.
  ``tfdist.fit`` drives it instead, in this order: `manage`, `restore`,
  `begin` (with the watcher of the run), `resume` before each ``fit`` call
  or epoch that starts mid-epoch, `should_stop`/`preempt` and `due` at step
  ends under ParameterServerStrategy, and `finished`.
  """

  def __init__(self, backup_dir: str, *, save_freq: str | int = "epoch",
               delete_checkpoint: bool = True):
    """Creates the callback.

    Args:
      backup_dir: where the chief keeps the backup; shared by all runs of one
        job (a restart must find it) and by no other job. A relative path is
        read against the working directory now.
      save_freq: ``"epoch"`` to back up at epoch ends only, or ``N`` to also
        back up every ``N`` steps within an epoch.
      delete_checkpoint: remove the backup when training completes, as
        Keras's ``BackupAndRestore`` does.

    Raises:
      ConfigError: an empty ``backup_dir`` or a ``save_freq`` that is neither
        ``"epoch"`` nor a positive integer.
    """
    super().__init__()
    if not isinstance(backup_dir, str) or not backup_dir:
      raise ConfigError(field="backup_dir", value=backup_dir, source=_SOURCE,
                        expected="a directory path every run of the job sees")
    if save_freq != "epoch" and (not isinstance(save_freq, int)
                                 or isinstance(save_freq, bool)
                                 or save_freq < 1):
      raise ConfigError(field="save_freq", value=save_freq, source=_SOURCE,
                        expected='"epoch" or a positive number of steps')
    self._directory = chief_lib.absolute(backup_dir)
    self._every = None if save_freq == "epoch" else save_freq
    self._delete = delete_checkpoint
    self._offset = 0  # Steps of the epoch applied before this fit call.
    self._watcher: preemption_lib.PreemptionWatcher | None = None
    self._managed = False  # True when tfdist.fit drives restore and watching.
    self._steps: int | None = None
    self._epoch = 0
    self._skip = 0  # Steps of the resumed epoch dropped, not applied.
    self._checkpoint: tf.train.Checkpoint | None = None
    self._position: tf.Variable | None = None
    self._batch: int | None = None  # This run's global batch, if known.
    self._samples: int | None = None  # Samples in one epoch, if known.
    self._resized: str | None = None  # What changed since the backup.

  # --- The part tfdist.fit drives -------------------------------------------

  def manage(self, model: keras.Model, *, steps_per_epoch: int,
             global_batch: int | None = None,
             samples_per_epoch: int | None = None) -> None:
    """For ``tfdist.fit``: it restores, skips input and watches signals.

    ``global_batch`` (samples per step) lets a backup of another global
    batch resume at its sample; ``samples_per_epoch`` is for the log line.
    """
    self._managed = True
    self._steps = _check_steps(steps_per_epoch)
    self._batch, self._samples = global_batch, samples_per_epoch
    self.set_model(model)

  def begin(self, watcher: preemption_lib.PreemptionWatcher | None) -> None:
    """Training starts: act on ``watcher``'s signals (``None``: none)."""
    self._watcher = watcher

  def resume(self, offset: int) -> None:
    """The coming batches of the epoch start ``offset`` steps into it.

    ``tfdist.fit`` skips those steps in its input, so Keras counts batches
    from 0 again; the backup counts them from ``offset``.
    """
    self._offset = offset

  def should_stop(self) -> bool:
    """Call once per step: True once a preemption signal means stop."""
    return self._watcher is not None and self._watcher.should_stop()

  def restore(self) -> tuple[int, int] | None:
    """Claims the directory, restores the newest readable backup.

    Every worker takes part; they agree on the position before it is
    returned (`tfdist.training.checkpoints.agreed`).

    Returns:
      The restored ``(epoch, step)``, or ``None`` when there was no backup.

    Raises:
      ConfigError: another job's directory, or one the chief cannot write;
        workers that restored different positions; a saved step that the
        ``steps_per_epoch`` of this run does not reach.
      CheckpointError: the directory holds backups and none is readable.
    """
    strategy = self.model.distribute_strategy
    self._resized = None
    restored = checkpoints_lib.agreed(strategy, self._restore_here,
                                      directory=self._directory,
                                      field="backup_dir", source=_SOURCE)
    if self._resized and introspect.is_chief(strategy):
      logging.warning("tfdist: %s", self._resized)
    return restored

  def _restore_here(self) -> tuple[int, int] | None:
    model = self.model
    strategy = model.distribute_strategy
    ownership.claim(self._directory,
                    ownership.owner_of([model, model.optimizer], strategy),
                    strategy=strategy, field="backup_dir", source=_SOURCE)
    if not checkpoints_lib.candidates(self._directory):
      return None
    checkpoint = self._ensure_checkpoint()
    with strategy.scope():
      if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    checkpoints_lib.restore_latest(checkpoint, self._directory)
    epoch, step, batch, workers = (int(v) for v in self._position.numpy())
    saved, here = step, introspect.num_input_workers(strategy)
    if batch and self._batch and batch != self._batch:
      step = step * batch // self._batch  # The sample, to a whole batch.
    self._batch = self._batch or batch or None  # Unknown here: unchanged.
    if batch != (self._batch or 0) or workers != here:
      self._resized = _resize_line(
          saved=(workers, batch), here=(here, self._batch),
          epoch=epoch, sample=saved * batch if batch else None,
          samples=self._samples, step=step)
    if self._steps is not None and step >= self._steps:
      raise ConfigError(
          field="steps_per_epoch", value=self._steps, source=_SOURCE,
          expected=f"more than {step}: the backup in {self._directory} was "
                   f"saved {step} steps into epoch {epoch}",
          hint="Pass the steps_per_epoch of the run that saved it, or a new "
               "backup_dir to start fresh")
    return epoch, step

  def due(self, done_in_epoch: int) -> bool:
    """True when a periodic backup falls after ``done_in_epoch`` steps."""
    return bool(self._every) and done_in_epoch % self._every == 0

  def preempt(self, epoch: int, done: int) -> None:
    """Saves at ``done`` steps into ``epoch`` and raises PreemptedError."""
    if self._steps and done >= self._steps:
      epoch, done = epoch + 1, 0
    self._save(epoch, done)
    watcher = self._watcher
    if not self._managed:
      self._stop_watching()
    watcher.exit(epoch * (self._steps or 0) + done, self._directory)

  def finished(self) -> None:
    """Training completed: the backup is no longer needed."""
    if self._delete:
      ownership.release(self._directory, self.model.distribute_strategy)

  # --- Keras callback hooks --------------------------------------------------

  def on_train_begin(self, logs=None):
    if self._managed:
      return
    strategy = self.model.distribute_strategy
    if isinstance(strategy,
                  tf.distribute.experimental.ParameterServerStrategy):
      raise ConfigError(
          field="callbacks", value=type(self).__name__, source=_SOURCE,
          expected="a synchronous strategy: Keras 3's Model.fit does not run "
                   "under ParameterServerStrategy",
          hint="Use tfdist.fit(model, dataset_fn, backup_dir=...)")
    self._steps = _check_steps(self.params.get("steps") if self.params
                               else None)
    restored = self.restore()
    if restored is not None:
      epoch, step = restored
      self.model._initial_epoch = epoch  # pylint: disable=protected-access
      if step:
        self._skip_batches(step)
    self._watcher = preemption_lib.PreemptionWatcher(strategy).__enter__()

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    done = self._offset + batch + 1
    if done <= self._skip:  # A dropped batch of the resumed epoch.
      return
    if self.should_stop():
      self.preempt(self._epoch, done)
    if self.due(done) and (self._steps is None or done < self._steps):
      self._save(self._epoch, done)

  def on_epoch_end(self, epoch, logs=None):
    self._skip = 0
    self._save(epoch + 1, 0)

  def on_train_end(self, logs=None):
    if self._managed:
      return
    self._stop_watching()
    self.model._initial_epoch = None  # pylint: disable=protected-access
    self.finished()

  # --- Internals ---------------------------------------------------------------

  def _ensure_checkpoint(self) -> tf.train.Checkpoint:
    if self._checkpoint is None:
      with tf.init_scope():
        self._position = tf.Variable([0] * 4, dtype=tf.int64,
                                     trainable=False,
                                     name="tfdist_backup_position")
      self._checkpoint = tf.train.Checkpoint(
          model=self.model, optimizer=self.model.optimizer,
          position=self._position)
    return self._checkpoint

  def _save(self, epoch: int, step: int) -> None:
    checkpoint = self._ensure_checkpoint()
    self._position.assign([epoch, step, self._batch or 0,
                           introspect.num_input_workers(
                               self.model.distribute_strategy)])
    checkpoints_lib.save(
        checkpoint, self._directory, strategy=self.model.distribute_strategy,
        number=epoch * self._steps + step if self._steps else None,
        max_to_keep=2)

  def _stop_watching(self) -> None:
    if self._watcher is not None:
      self._watcher.__exit__(None, None, None)
      self._watcher = None

  def _skip_batches(self, steps: int) -> None:
    """Makes the next ``steps`` batches of plain ``fit`` draw and drop data.

    Keras counts them as steps of the epoch (so the epoch still ends after
    its ``steps_per_epoch``), but nothing is applied: the restored optimizer
    already holds them.
    """
    model = self.model
    train = model.make_train_function()
    per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    self._skip = steps

    left = [steps]

    def skipping(iterator) -> dict[str, Any]:
      for _ in range(min(per_call, left[0])):
        next(iterator)
        left[0] -= 1
      if not left[0]:
        model.train_function = train
      return {}

    model.train_function = skipping


def _resize_line(*, saved: tuple[int, int], here: tuple[int, int | None],
                 epoch: int, sample: int | None, samples: int | None,
                 step: int) -> str:
  """Says what changed since the backup, and where training goes on."""
  def size(workers, batch):
    return (f"{workers} worker{'s' * (workers != 1)} (global batch "
            f"{batch or 'unknown'})")
  where = (f"sample {sample} of {samples or 'an unknown number'}"
           if sample is not None else f"step {step}")
  line = (f"resuming a backup of {size(*saved)} on {size(*here)} at epoch "
          f"{epoch}, {where}")
  if sample is not None and here[1] and step * here[1] != sample:
    line += f" (from step {step}: sample {step * here[1]})"
  return line


def _check_steps(steps: Any) -> int | None:
  """``steps`` per epoch, unless it would never end an epoch."""
  if steps is not None:
    _input.check_steps(steps, "an epoch to end", source=_SOURCE)
  return steps
