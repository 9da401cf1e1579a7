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

__all__ = ["task_of", "is_chief", "write_dir"]


def task_of(strategy: tf.distribute.Strategy) -> tuple[str | None, int | None, dict]:
  """``(task_type, task_id, cluster)`` of this process under ``strategy``."""
  # ParameterServerStrategy keeps its resolver where the public property
  # does not look (``cluster_resolver`` is None under TensorFlow 2.21).
  resolver = (getattr(strategy, "cluster_resolver", None)
              or getattr(strategy, "_cluster_resolver", None))
  if resolver is None:
    return None, None, {}
  cluster = resolver.cluster_spec().as_dict()
  if not cluster:
    return None, None, {}
  return resolver.task_type, resolver.task_id, cluster


def is_chief(strategy: tf.distribute.Strategy) -> bool:
  """True on the one process that writes checkpoints, logs and exports.

  That is the single process, the ``chief`` task (the coordinator under
  ParameterServerStrategy), or worker 0 when the cluster has no chief.
  """
  task_type, task_id, cluster = task_of(strategy)
  if task_type in (None, "chief"):
    return True
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    return True  # Only the coordinator runs training code.
  return task_type == "worker" and task_id == 0 and "chief" not in cluster


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
