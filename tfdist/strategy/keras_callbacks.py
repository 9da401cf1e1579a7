"""Keras's own writing callbacks under several workers: one writer per path.

Keras 3's ``ModelCheckpoint``, ``BackupAndRestore``, ``TensorBoard`` and
``CSVLogger`` know nothing of the chief: under MultiWorkerMirroredStrategy
every worker writes the same files (tensorflow/tensorflow#38635). For the
length of one ``fit`` (or ``evaluate``, ``predict``), `one_writer` points each
callback:

| callback           | the chief                                          | every other worker |
|--------------------|----------------------------------------------------|--------------------|
| ``ModelCheckpoint``  | writes each file in a staging directory beside its target, then renames it onto the target | a temporary directory |
| ``BackupAndRestore`` | restores from ``backup_dir``; each save staged, then renamed into place | restores from ``backup_dir`` too (the chief's state), saves into a temporary directory, never deletes ``backup_dir`` |
| (every worker)     | first refuses a ``backup_dir`` holding files Keras did not write (`refuse_unowned`), before any callback runs: Keras deletes the whole directory when training ends | |
| ``TensorBoard``, ``CSVLogger`` | the real path (appended as training goes) | a temporary directory |

A rename onto the target is atomic on one filesystem, so a reader (the next
run's restore, an evaluator) never sees a half-written file. URLs such as
``gs://`` are written as Keras writes them on the chief. The temporary
directories are created by `one_writer` and removed when ``fit`` ends, even on
error, and every callback gets its own paths back.

`tfdist.strategy.keras_hooks` applies it to every ``model.fit``,
``evaluate`` and ``predict`` under a strategy;
``tfdist.fit`` and `tfdist.training.chief_aware` call it directly. A callback
already inside a `one_writer` is left to the outer one.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import shutil
import tempfile
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

__all__ = ["FRESH", "VERIFIED", "one_writer", "refuse_unowned"]

_MODULE = "keras.src.callbacks.backup_and_restore:BackupAndRestore"

#: The BackupAndRestore code the redirection relies on (the private paths
#: ``__init__`` derives from ``backup_dir``, and the methods that read and
#: write them), as `tfdist._compat.keras.fingerprint` hashes it.
VERIFIED: Mapping[str, str] = {
    f"{_MODULE}.__init__": "a0ede5494bb6441c",
    f"{_MODULE}._load_model": "375ba5218fb8f210",
    f"{_MODULE}._save_model": "94e4d072c55aef7b",
}

#: The hint of a refused directory, as `str.format` with field and directory.
FRESH = ("To start fresh, pass a new {field}, or delete {directory} yourself; "
         "tfdist never removes what it did not write")
_STAGING = ".tfdist-staging-"
_FIELD = re.compile(r"\{[^{}]*\}")  # A str.format field, as in "{epoch:02d}".
_SCRATCH = "tfdist-keras-"
# The callbacks a one_writer holds, kept off them (Keras lists them).
_held_now: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
_Scratch = Callable[[], str]


@contextlib.contextmanager
def one_writer(callbacks: Sequence[Any], *, chief: bool,
               refusal: Callable[..., Exception]) -> Iterator[None]:
  """Points Keras's writing callbacks as the table above says, for a block.

  Args:
    callbacks: Keras callbacks; other callbacks are left alone.
    chief: whether this process is the one that writes the real paths.
    refusal: builds the error for a directory that is not the callback's
      (`tfdist.ConfigError`).

  Yields:
    Nothing; the callbacks are changed in place and restored afterwards.
  """
  import keras  # pylint: disable=g-import-not-at-top
  pointers: list[tuple[type, Callable[..., Any]]] = [
      (keras.callbacks.BackupAndRestore,
       functools.partial(_backup_and_restore, refusal=refusal)),
      (keras.callbacks.ModelCheckpoint, _model_checkpoint),
      (keras.callbacks.TensorBoard, _stream("log_dir")),
      (keras.callbacks.CSVLogger, _stream("filename")),
  ]
  with contextlib.ExitStack() as stack:
    scratch: list[str] = []

    def scratch_dir(index: int) -> str:
      if not scratch:
        scratch.append(tempfile.mkdtemp(prefix=f"{_SCRATCH}{os.getpid()}-"))
        stack.callback(shutil.rmtree, scratch[0], True)
      path = os.path.join(scratch[0], str(index))
      os.makedirs(path, exist_ok=True)
      return path

    for index, callback in enumerate(callbacks):
      if _held_now.get(callback, False):
        continue
      for cls, point in pointers:
        if isinstance(callback, cls):
          stack.enter_context(_held(callback))
          stack.enter_context(point(
              callback, chief=chief,
              scratch=lambda index=index: scratch_dir(index)))
          break
    yield


@contextlib.contextmanager
def _held(callback: Any) -> Iterator[None]:
  _held_now[callback] = True
  try:
    yield
  finally:
    _held_now.pop(callback, None)


def _name(path: Any) -> str:
  return os.path.basename(os.fspath(path).rstrip("/")) or "out"


def _stream(attr: str) -> Callable[..., Any]:
  """Logs appended as training goes: the chief writes the real path."""
  @contextlib.contextmanager
  def point(callback: Any, *, chief: bool, scratch: _Scratch) -> Iterator[None]:
    if chief:
      yield
      return
    real = getattr(callback, attr)
    setattr(callback, attr, os.path.join(scratch(), _name(real)))
    try:
      yield
    finally:
      setattr(callback, attr, real)
  return point


@contextlib.contextmanager
def _after(callback: Any, events: Sequence[str],
           then: Callable[[], None]) -> Iterator[None]:
  """Runs ``then`` after each of the callback's ``events``, for a block."""
  own = {event: callback.__dict__.get(event) for event in events}
  for event in events:
    method = getattr(callback, event)

    def wrapped(*args, _method=method, **kwargs):
      result = _method(*args, **kwargs)
      then()
      return result
    setattr(callback, event, wrapped)
  try:
    yield
  finally:
    for event, before in own.items():
      if before is None:
        delattr(callback, event)
      else:
        setattr(callback, event, before)


@contextlib.contextmanager
def _model_checkpoint(callback: Any, *, chief: bool,
                      scratch: _Scratch) -> Iterator[None]:
  real = callback.filepath
  staged = None  # A glob of the chief's staging directories.
  if not chief:
    callback.filepath = os.path.join(scratch(), _name(real))
  elif "://" not in os.fspath(real):
    # Keras formats the whole path (``ckpt/{epoch}/m.keras``) and creates
    # the staging directory inside what it formatted, at its first save.
    directory = os.path.dirname(os.path.abspath(os.fspath(real)))
    staging = os.path.join(directory, f"{_STAGING}{os.getpid()}")
    callback.filepath = os.path.join(staging, _name(real))
    staged = _FIELD.sub("*", glob.escape(staging))
  events = ("on_epoch_end", "on_train_batch_end") if staged else ()
  try:
    with _after(callback, events, lambda: _publish_all(glob.glob(staged))):
      yield
  finally:
    callback.filepath = real
    for path in glob.glob(staged) if staged else ():
      shutil.rmtree(path, ignore_errors=True)


def _publish_all(stagings: Sequence[str]) -> None:
  """Renames every file staged onto its place beside the staging directory,
  which goes once empty."""
  for staging in stagings:
    target = os.path.dirname(staging)
    for name in os.listdir(staging):
      os.replace(os.path.join(staging, name), os.path.join(target, name))
    os.rmdir(staging)


def _point_backup(callback: Any, directory: str) -> None:
  """Sets the paths BackupAndRestore derives from ``backup_dir``, as its
  ``__init__`` does."""
  from keras.src.utils import file_utils  # pylint: disable=g-import-not-at-top
  callback.backup_dir = directory
  callback._weights_path = file_utils.join(directory, "latest.weights.h5")  # pylint: disable=protected-access
  callback._training_metadata_path = file_utils.join(  # pylint: disable=protected-access
      directory, "training_metadata.json")
  callback._prev_weights_path = f"{callback._weights_path}.bkp"  # pylint: disable=protected-access
  callback._prev_training_metadata_path = (  # pylint: disable=protected-access
      f"{callback._training_metadata_path}.bkp")  # pylint: disable=protected-access


@contextlib.contextmanager
def _backup_and_restore(callback: Any, *, chief: bool, scratch: _Scratch,
                        refusal: Callable[..., Exception]) -> Iterator[None]:
  real = callback.backup_dir
  local = "://" not in os.fspath(real)
  if local:  # Before Keras's callbacks start (TensorBoard writes at once).
    own = {os.path.basename(p) for p in (
        callback._weights_path, callback._prev_weights_path,  # pylint: disable=protected-access
        callback._training_metadata_path,  # pylint: disable=protected-access
        callback._prev_training_metadata_path)}  # pylint: disable=protected-access
    refuse_unowned(real, own=lambda n: n in own or n.startswith(_STAGING),
                   writer="Keras's BackupAndRestore", refusal=refusal,
                   field="backup_dir",
                   source="keras.callbacks.BackupAndRestore")
  if not chief:
    # Restore what the chief saved, then save where nobody reads.
    then = lambda: _point_backup(callback, scratch())
    try:
      with _after(callback, ("on_train_begin",), then):
        yield
    finally:
      _point_backup(callback, real)
    return
  if not local:
    yield
    return
  save = callback._save_model  # pylint: disable=protected-access
  callback._save_model = lambda: _staged_save(callback, save, real)  # pylint: disable=protected-access
  try:
    yield
  finally:
    del callback._save_model  # pylint: disable=protected-access


def refuse_unowned(directory: str, *, own: Callable[[str], bool], writer: str,
                   refusal: Callable[..., Exception], field: str,
                   source: str) -> None:
  """Refuses ``directory`` when it holds a name ``own`` does not accept.

  The one check of a backup directory, for tfdist's (through
  `tfdist.training.ownership`) and, under a tfdist strategy, Keras's:
  what tfdist did not write it never writes over or removes.

  Raises:
    The error ``refusal`` builds, naming up to 3 of the names.
  """
  if not os.path.lexists(directory):
    return
  names = os.listdir(directory) if os.path.isdir(directory) else [directory]
  foreign = sorted(n for n in names if not own(n))
  if foreign:
    held = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more"
                                     if len(foreign) > 3 else "")
    raise refusal(
        field=field, value=directory, source=source,
        expected=f"a new or empty directory, or one this job's backups were "
                 f"written to (it holds {held}, which {writer} did not write)",
        hint=FRESH.format(field=field, directory=directory))


def _staged_save(callback: Any, save: Callable[[], None], real: str) -> None:
  """Keras's save into a staging directory, then renamed into place.

  With ``double_checkpoint`` the files in place are first copied to their
  ``.bkp`` names (a copy, then a rename: the current files never go
  missing). Weights go in before the metadata naming their epoch, so a crash
  between the two repeats an epoch rather than skipping one (Keras's
  BackupAndRestore resumes at epoch boundaries, at least once).
  """
  os.makedirs(real, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=_STAGING, dir=real)
  try:
    _point_backup(callback, staging)
    try:
      save()
    finally:
      _point_backup(callback, real)
    pairs = [(callback._weights_path, callback._prev_weights_path),  # pylint: disable=protected-access
             (callback._training_metadata_path,  # pylint: disable=protected-access
              callback._prev_training_metadata_path)]  # pylint: disable=protected-access
    if callback.double_checkpoint:
      for current, previous in pairs:
        if os.path.exists(current):
          copy = os.path.join(staging, os.path.basename(previous))
          shutil.copyfile(current, copy)
          os.replace(copy, previous)
    for current, _ in pairs:
      os.replace(os.path.join(staging, os.path.basename(current)), current)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
