"""Chief-aware Keras callbacks and exports: one writer per path.

Keras 3's ``ModelCheckpoint`` and ``TensorBoard`` do not know the chief from a
worker: every worker writes the same path. `chief_aware` points each one at
the real path on the chief and at a temporary directory elsewhere, removed
afterwards. `save_model` exports the same way, atomically.
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
from tfdist.training import chief as chief_lib

__all__ = ["chief_aware", "save_model"]

# Callback class -> the attribute holding the path it writes.
_WRITERS = {
    keras.callbacks.ModelCheckpoint: "filepath",
    keras.callbacks.TensorBoard: "log_dir",
    keras.callbacks.CSVLogger: "filename",
}


@contextlib.contextmanager
def chief_aware(callbacks: Sequence[keras.callbacks.Callback] | None,
                strategy: tf.distribute.Strategy
                ) -> Iterator[list[keras.callbacks.Callback]]:
  """Yields the callbacks, writing to temporary paths on non-chief workers.

  The callbacks' paths are restored and the temporary directory is removed
  when the block ends.

  Raises:
    ConfigError: a Keras ``BackupAndRestore`` is given: it resumes only at
      epoch boundaries and every worker writes its directory; use
      ``tfdist.fit(backup_dir=...)``.
  """
  callbacks = list(callbacks or ())
  for cb in callbacks:
    if isinstance(cb, keras.callbacks.BackupAndRestore):
      raise ConfigError(
          field="callbacks", value=type(cb).__name__, source="tfdist.fit",
          expected="no keras.callbacks.BackupAndRestore",
          hint="Pass backup_dir= to tfdist.fit: it resumes inside an epoch, "
               "applies no step twice and only the chief writes")
  writers = [cb for cb in callbacks if isinstance(cb, tuple(_WRITERS))]
  if not writers or introspect.is_chief(strategy):
    yield callbacks
    return
  originals = []
  with chief_lib.write_dir("", strategy) as tmp:
    try:
      for i, cb in enumerate(callbacks):
        for cls, attr in _WRITERS.items():
          if isinstance(cb, cls):
            path = getattr(cb, attr)
            originals.append((cb, attr, path))
            setattr(cb, attr, os.path.join(tmp, f"{i}", os.path.basename(
                os.fspath(path).rstrip("/")) or "out"))
      yield callbacks
    finally:
      for cb, attr, path in originals:
        setattr(cb, attr, path)


def save_model(model: keras.Model, path: str,
               strategy: tf.distribute.Strategy | None = None) -> str | None:
  """Saves ``model`` (``.keras`` file or SavedModel directory) from the chief.

  Every worker runs the save (reading distributed variables can be a
  collective); the chief writes to a temporary sibling and renames it onto
  ``path``, so a reader never sees a half-written export. Other workers write
  into a temporary directory that is removed.

  Args:
    model: the model.
    path: a ``.keras`` file, or a SavedModel directory for serving.
    strategy: the strategy the model was built under; the model's own by
      default.

  Returns:
    ``path`` on the chief, ``None`` elsewhere.
  """
  strategy = (strategy or getattr(model, "distribute_strategy", None)
              or tf.distribute.get_strategy())
  is_keras = os.fspath(path).endswith(".keras")
  with chief_lib.write_dir(os.path.dirname(os.path.abspath(path)),
                           strategy) as directory:
    os.makedirs(directory, exist_ok=True)
    name = os.path.basename(path)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=directory)
    try:
      target = os.path.join(tmp, name)
      if is_keras:
        model.save(target)
      else:
        model.export(target)
      final = os.path.join(directory, name)
      if os.path.isdir(final) and not is_keras:
        shutil.rmtree(final)
      os.replace(target, final)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return path if introspect.is_chief(strategy) else None
