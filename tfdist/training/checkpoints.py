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
A save that fails for lack of space or quota removes what it wrote and raises
`tfdist.DiskFullError`, which names the last whole checkpoint.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import shutil
from typing import Callable

from absl import logging
import tensorflow as tf

from tfdist import _flight
from tfdist.errors import CheckpointError
from tfdist.errors import ConfigError
from tfdist.errors import DiskFullError
from tfdist.errors import TfdistError
from tfdist.strategy import flight_steps
from tfdist.strategy import introspect
from tfdist.training import chief as chief_lib
from tfdist.training import ownership

__all__ = ["save", "restore_latest", "candidates", "agreed"]

#: A full filesystem or quota (TensorFlow's ResourceExhaustedError says so in
#: the system's words).
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

#: A restored position: numbers every worker must agree on.
Position = tuple[int, ...]


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

  Raises:
    DiskFullError: no space or quota left; the partial save was removed.
  """
  directory = chief_lib.absolute(directory)
  with chief_lib.write_dir(directory, strategy) as target:
    before = set(os.listdir(target)) if os.path.isdir(target) else set()
    manager = tf.train.CheckpointManager(checkpoint, target,
                                         max_to_keep=max_to_keep)
    try:
      path = manager.save(checkpoint_number=number)
    except (tf.errors.OpError, OSError) as e:
      reason = next((os.strerror(n) for n in _NO_SPACE
                     if os.strerror(n) in str(e)), None)
      if reason is None:
        raise
      ownership.remove_partial(target, before)
      raise DiskFullError(directory=target, free=_free(target),
                          last=next(iter(candidates(directory)), None),
                          reason=reason) from e
  return path if introspect.is_chief(strategy) else None


def _free(path: str) -> int:
  """Bytes free on the filesystem of ``path``, or of its nearest parent."""
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return shutil.disk_usage(path).free


def candidates(directory: str) -> list[str]:
  """Checkpoint prefixes in ``directory``, newest first."""
  directory = chief_lib.absolute(directory)
  paths: list[str] = []
  try:
    state = tf.train.get_checkpoint_state(directory)
  except (tf.errors.OpError, ValueError) as e:  # An unparseable state file.
    logging.warning("tfdist: unreadable checkpoint state in %s: %s",
                    directory, e)
    state = None
  if state is not None:  # TensorFlow joined relative paths to directory.
    paths = list(state.all_model_checkpoint_paths)
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
  directory = chief_lib.absolute(directory)
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


def agreed(strategy: tf.distribute.Strategy,
           restore: Callable[[], Position | None], *, directory: str,
           field: str, source: str,
           expected: str = "a directory every worker restores from",
           peer_hint: str = ("Another worker failed to restore from it; its "
                             "error says why")) -> Position | None:
  """Runs ``restore`` on every worker; they agree on its result or all fail.

  Under MultiWorkerMirroredStrategy with several workers, each worker's
  outcome (failed, nothing restored, or the position) is gathered in one
  collective, bounded by the strategy's collective timeout. A worker that
  restored another position than its peers (say, its ``directory`` is not the
  chief's: no shared filesystem) would train on a different step and hang
  or diverge, so every worker raises instead; a worker whose own restore
  failed raises its error and its peers say so.

  Args:
    strategy: the strategy training runs under.
    restore: restores this worker's state; returns the position (at most
      two numbers) or ``None`` when there was nothing to restore.
    directory: the directory restored from, for messages.
    field: its argument name, e.g. ``"backup_dir"``.
    source: where it was given, e.g. ``"tfdist.fit"``.
    expected: what its peers' error says was expected of ``directory``.
    peer_hint: the hint of that error.

  Returns:
    What ``restore`` returned, the same on every worker.

  Raises:
    TfdistError: ``restore``'s own error on the worker it happened on;
      `tfdist.ConfigError` on its peers and on workers that disagree.
  """
  error = None
  try:
    position = restore()
  except TfdistError as e:
    error, position = e, None
  if not (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
          and introspect.num_workers(strategy) > 1):
    if error is not None:
      raise error
    return position
  padded = [0, 0] if position is None else [*position, 0, 0][:2]
  mine = [float(error is not None), float(position is not None), *padded]
  rows = {tuple(int(v) for v in row) for row in _gather(strategy, mine)}
  if error is not None:
    raise error
  if any(row[0] for row in rows):
    raise ConfigError(field=field, value=directory, source=source,
                      expected=expected, hint=peer_hint)
  if len(rows) > 1:
    seen = sorted("nothing" if not row[1] else f"position {list(row[2:])}"
                  for row in rows)
    raise ConfigError(
        field=field, value=directory, source=source,
        expected="the same saved position on every worker: one directory "
                 "all workers read (a shared filesystem)",
        hint=f"The workers restored {', '.join(seen)}")
  return position


def _gather(strategy: tf.distribute.Strategy, values: list[float]) -> list:
  """Every replica's ``values``, gathered on every worker."""
  @tf.function
  def gather(value):
    return strategy.gather(strategy.run(tf.identity, args=(value,)), axis=0)
  with _flight.recorded("barrier: restored position", transport="tensorflow",
                        peers=flight_steps.peers(strategy)):
    return gather(tf.constant([values], tf.float64)).numpy().tolist()


def _number(path: str) -> int:
  match = re.search(r"(\d+)$", path)
  return int(match.group(1)) if match else -1
