"""Saving from the chief, and restoring the newest readable checkpoint.

`save` is the one chief-aware save: every worker takes part (under
MultiWorkerMirroredStrategy reading distributed variables is a collective),
the chief writes the real directory and the others a temporary one
(`tfdist.training.chief.write_dir`). `tfdist.BackupAndRestore` and
`tfdist.Runner` both save through it.

TensorFlow writes a checkpoint's data first and then updates the directory's
``checkpoint`` state file by an atomic rename, so a kill mid-save leaves the
state file naming only finished checkpoints. `restore_latest` restores the
newest of those; when it is unreadable (truncated or corrupt files) it falls
back to the one before, and when the directory holds checkpoints but none can
be read it raises `tfdist.CheckpointError` rather than start over.
"""

from __future__ import annotations

import glob
import os
import re

from absl import logging
import tensorflow as tf

from tfdist.errors import CheckpointError
from tfdist.strategy import introspect
from tfdist.training import chief as chief_lib

__all__ = ["save", "restore_latest", "candidates"]


def save(checkpoint: tf.train.Checkpoint, directory: str, *,
         strategy: tf.distribute.Strategy, max_to_keep: int,
         number: int | None = None) -> str | None:
  """Saves ``checkpoint`` from every worker; only the chief's lands in place.

  Args:
    checkpoint: what to save.
    directory: the checkpoint directory the chief writes.
    strategy: the strategy training runs under; it decides who is chief.
    max_to_keep: checkpoints kept in ``directory``.
    number: the checkpoint's number (``ckpt-<number>``); the next one by
      default.

  Returns:
    The saved prefix on the chief, ``None`` on other workers.
  """
  with chief_lib.write_dir(directory, strategy) as target:
    manager = tf.train.CheckpointManager(checkpoint, target,
                                         max_to_keep=max_to_keep)
    path = manager.save(checkpoint_number=number)
  return path if introspect.is_chief(strategy) else None


def candidates(directory: str) -> list[str]:
  """Checkpoint prefixes in ``directory``, newest first."""
  paths: list[str] = []
  try:
    state = tf.train.get_checkpoint_state(directory)
  except (tf.errors.OpError, ValueError) as e:  # An unparseable state file.
    logging.warning("tfdist: unreadable checkpoint state in %s: %s",
                    directory, e)
    state = None
  if state is not None:
    paths = [p if os.path.isabs(p) else os.path.join(directory, p)
             for p in state.all_model_checkpoint_paths]
    if state.model_checkpoint_path and not paths:
      paths = [state.model_checkpoint_path]
  if not paths:  # No state file: finished saves still have an .index file.
    paths = [p[:-len(".index")]
             for p in glob.glob(os.path.join(directory, "*.index"))]
    paths.sort(key=_number)
  return list(reversed(paths))


def restore_latest(checkpoint: tf.train.Checkpoint, directory: str | None, *,
                   strict: bool = True) -> str | None:
  """Restores the newest readable checkpoint; returns its path.

  Args:
    checkpoint: what to restore into.
    directory: the checkpoint directory; ``None`` or empty restores nothing.
    strict: require every existing object to be matched (otherwise partial
      restores are accepted).

  Returns:
    The restored prefix, or ``None`` when the directory holds no checkpoint.

  Raises:
    CheckpointError: checkpoints exist and none could be restored.
  """
  if not directory or not tf.io.gfile.isdir(directory):
    return None
  paths = candidates(directory)
  if not paths:
    return None
  failures = []
  for path in paths:
    try:
      status = checkpoint.restore(path)
      if strict:
        status.assert_existing_objects_matched()
      else:
        status.expect_partial()
      if failures:
        logging.warning("tfdist: fell back to checkpoint %s; newer ones were "
                        "unreadable: %s", path, "; ".join(failures))
      return path
    except (tf.errors.OpError, ValueError, AssertionError, IndexError,
            KeyError) as e:  # Truncated files raise IndexError.
      failures.append(f"{os.path.basename(path)}: "
                      f"{str(e).splitlines()[0][:200]}")
  raise CheckpointError(
      f"no checkpoint in {directory} could be restored ({'; '.join(failures)})."
      " Training will not start over silently: restore the directory from a "
      "copy, or remove it to train from scratch")


def _number(path: str) -> int:
  match = re.search(r"(\d+)$", path)
  return int(match.group(1)) if match else -1
