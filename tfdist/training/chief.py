"""Who writes, and where: the chief the real path, other workers a temporary one.

Under MultiWorkerMirroredStrategy every worker must take part in a save
(reading some distributed variables is a collective), but only the chief's
copy may land on the real path: two processes must never write one file.
Other workers write to a fresh temporary directory of their own, removed right
after. tfdist removes nothing it did not create in this process: a worker
killed with SIGKILL leaves its ``tfdist-<task>-<pid>-*`` directory behind, and
no later run guesses which directories in the temporary folder are whose.

Paths are read against the working directory when they are given, once
(`absolute`), so a relative path means the same directory everywhere, however
TensorFlow joins paths later.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import tensorflow as tf

from tfdist.strategy.introspect import is_chief
from tfdist.strategy.introspect import task_of

__all__ = ["absolute", "write_dir"]


def absolute(path: str | os.PathLike) -> str:
  """``path`` relative to the working directory made absolute.

  Trailing separators go (``"out/model/"`` is ``out/model``) and ``.`` and
  ``..`` are resolved; a URL such as ``gs://bucket/dir`` is returned as is.
  """
  path = os.fspath(path)
  return path if "://" in path else os.path.abspath(path)


@contextlib.contextmanager
def write_dir(path: str, strategy: tf.distribute.Strategy) -> Iterator[str]:
  """Yields ``path`` on the chief, a temporary directory elsewhere.

  The temporary directory is created by this call and removed when the block
  ends, even on error.
  """
  if is_chief(strategy):
    yield path
    return
  task_type, task_id, _ = task_of(strategy)
  tmp = tempfile.mkdtemp(prefix=f"tfdist-{task_type}-{task_id}-{os.getpid()}-")
  try:
    yield tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
