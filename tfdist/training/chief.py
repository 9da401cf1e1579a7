"""Who writes: the chief writes the real path, other workers a temporary one.

Under MultiWorkerMirroredStrategy every worker must take part in a save
(reading some distributed variables is a collective), but only the chief's
copy may land on the real path: two processes must never write one file.
Other workers write to a fresh temporary directory that is removed right after.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import tempfile
from typing import Iterator

import tensorflow as tf

from tfdist.strategy.introspect import is_chief
from tfdist.strategy.introspect import task_of

__all__ = ["write_dir"]


@contextlib.contextmanager
def write_dir(path: str, strategy: tf.distribute.Strategy) -> Iterator[str]:
  """Yields ``path`` on the chief, a temporary directory elsewhere.

  The temporary directory is removed when the block ends, even on error.
  """
  if is_chief(strategy):
    yield path
    return
  task_type, task_id, _ = task_of(strategy)
  _remove_orphans()
  tmp = tempfile.mkdtemp(prefix=f"tfdist-{task_type}-{task_id}-{os.getpid()}-")
  try:
    yield tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _remove_orphans() -> None:
  """Removes temporary directories left by killed tfdist workers.

  A worker killed with SIGKILL cannot clean up; its directory names its PID,
  so the next worker on the machine removes it once that PID is gone.
  """
  for path in glob.glob(os.path.join(tempfile.gettempdir(), "tfdist-*-*-*-*")):
    match = re.search(r"-(\d+)-[^-]+$", os.path.basename(path))
    if match and not _alive(int(match.group(1))):
      shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True
