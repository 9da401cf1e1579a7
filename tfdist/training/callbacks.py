"""Chief-aware Keras callbacks and exports: one writer per path.

Keras 3's ``ModelCheckpoint``, ``BackupAndRestore``, ``TensorBoard`` and
``CSVLogger`` do not know the chief from a worker: every worker writes the
same path. `chief_aware` points each one at the real path on the chief (its
checkpoints renamed into place whole) and at a temporary directory elsewhere,
removed afterwards (`tfdist.strategy.keras_callbacks`, which plain
``model.fit`` under a tfdist strategy also goes through). `save_model`
exports the same way, atomically.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator, Sequence

import keras
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.strategy import introspect
from tfdist.strategy import keras_callbacks
from tfdist.training import checkpoints as checkpoints_lib
from tfdist.training import chief as chief_lib

__all__ = ["chief_aware", "save_model"]


@contextlib.contextmanager
def chief_aware(callbacks: Sequence[keras.callbacks.Callback] | None,
                strategy: tf.distribute.Strategy
                ) -> Iterator[list[keras.callbacks.Callback]]:
  """Yields the callbacks, writing to temporary paths on non-chief workers.

  The callbacks' paths are restored and the temporary directory is removed
  when the block ends.

  Raises:
    ConfigError: a Keras ``BackupAndRestore`` is given: it resumes only at
      epoch boundaries; use ``tfdist.fit(backup_dir=...)``, which resumes
      inside an epoch (plain ``model.fit`` takes Keras's, chief-aware).
  """
  callbacks = list(callbacks or ())
  for cb in callbacks:
    if isinstance(cb, keras.callbacks.BackupAndRestore):
      raise ConfigError(
          field="callbacks", value=type(cb).__name__, source="tfdist.fit",
          expected="no keras.callbacks.BackupAndRestore",
          hint="Pass backup_dir= to tfdist.fit: it resumes inside an epoch, "
               "applies no step twice and only the chief writes")
  with keras_callbacks.one_writer(callbacks, refusal=ConfigError,
                                  chief=introspect.is_chief(strategy)):
    yield callbacks


def save_model(model: keras.Model, path: str,
               strategy: tf.distribute.Strategy | None = None) -> str | None:
  """Saves ``model`` (``.keras`` file or SavedModel directory) from the chief.

  Every worker runs the save (reading distributed variables can be a
  collective); the chief writes into a temporary directory beside ``path``
  and renames the result onto it, so a reader never sees a half-written
  export. Other workers write into a temporary directory that is removed.

  Nothing is removed or overwritten that was not saved under ``strategy``
  (its `tfdist.strategy.introspect.Record` keeps the paths): a ``path`` that
  exists (a file, or a directory with anything in it), the working directory
  or one of its parents is refused on every worker before anything is
  written. Saving again to such a path replaces that export.

  Args:
    model: the model.
    path: a ``.keras`` file, or a SavedModel directory for serving; a
      relative path is read against the working directory, a trailing ``/``
      changes nothing.
    strategy: the strategy the model was built under; the model's own by
      default.

  Returns:
    ``path`` on the chief, ``None`` elsewhere.

  Raises:
    ConfigError: ``path`` exists and was not saved under ``strategy``, or it
      is the working directory or one of its parents.
  """
  strategy = (strategy or getattr(model, "distribute_strategy", None)
              or tf.distribute.get_strategy())
  final = chief_lib.absolute(path)
  saved = introspect.record_of(strategy).saved
  # Every worker checks before any writes: the chief cannot publish before
  # a slower worker has looked (it would then find the chief's export).
  checkpoints_lib.agreed(
      strategy, lambda: _check_free(final, path, saved), directory=path,
      field="path", source="tfdist.save_model",
      expected="a path every worker may save to",
      peer_hint="Another worker refused it; its error says why")
  name = os.path.basename(final)
  with chief_lib.write_dir(os.path.dirname(final), strategy) as directory:
    os.makedirs(directory, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=directory)
    try:
      target = os.path.join(tmp, name)
      if final.endswith(".keras"):
        model.save(target)
      else:
        model.export(target)
      _publish(target, os.path.join(directory, name), tmp, path, saved)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  if not introspect.is_chief(strategy):
    return None
  saved.add(final)
  return path


def _check_free(final: str, given: str, saved: set[str]) -> None:
  """Raises ConfigError unless save_model may write ``final``."""
  cwd = os.getcwd()
  if os.path.commonpath([final, cwd]) == final:
    raise ConfigError(
        field="path", value=given, source="tfdist.save_model",
        expected="a new file or directory: this is the working directory or "
                 "one of its parents",
        hint="Name a new directory inside it, e.g. "
             f"{os.path.join(given, 'model')!r}")
  if final in saved or not os.path.lexists(final):
    return
  if os.path.isdir(final) and not os.path.islink(final) and not os.listdir(
      final):
    return  # An empty directory: nothing to lose.
  raise ConfigError(
      field="path", value=given, source="tfdist.save_model",
      expected="a path that does not exist yet, or an empty directory: "
               f"{final} holds what this strategy did not save",
      hint="Save to a new path, or move or delete the old one yourself; "
           "tfdist never removes what it did not write")


def _publish(target: str, final: str, tmp: str, given: str,
             saved: set[str]) -> None:
  """Moves ``target`` onto ``final``; never replaces another's files."""
  if os.path.lexists(final) and final in saved:  # Saved under strategy.
    if not os.path.isdir(target):
      os.replace(target, final)
      return
    os.replace(final, os.path.join(tmp, "previous"))  # Removed with tmp.
  try:
    if os.path.isdir(target):
      os.rename(target, final)  # Fails on a directory with anything in it.
    else:
      os.link(target, final)  # Fails on any existing file.
  except OSError as e:
    raise ConfigError(
        field="path", value=given, source="tfdist.save_model",
        expected="a path nothing else writes at the same time",
        hint=f"Renaming the export onto it failed: {e.strerror or e}"
        ) from None
