"""Preparing a TFDS dataset once for a whole cluster: the chief prepares.

When every worker of a job calls TFDS's ``download_and_prepare`` on a shared
``data_dir`` at once, they race on the same files. `prepared` gives each
dataset one writer: the chief (`tfdist.cluster.info.is_chief_task`, one
process alone being its own chief) prepares it behind an exclusive ``fcntl``
lock on ``<data_dir>/.tfdist-<name>.lock`` (which also keeps two jobs that
share a ``data_dir`` apart; the kernel drops it when its holder dies), and the
other workers wait, with a bound, until the dataset is prepared, then read it.
A worker never writes into ``data_dir``.

A chief whose preparation fails leaves ``<data_dir>/.tfdist-<name>.failed``
with the error, so the waiting workers fail at once with it instead of
waiting out their bound; the next preparation removes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from typing import Callable, Iterator, TypeVar

from absl import logging

from tfdist.errors import ConfigError

__all__ = ["prepared", "file_lock", "WAIT_TIMEOUT_SECONDS"]

#: How long a worker waits for the chief to prepare a dataset by default.
WAIT_TIMEOUT_SECONDS = 1800.0
_POLL_SECONDS = 0.5

Builder = TypeVar("Builder")


@contextlib.contextmanager
def file_lock(path: str, timeout_s: float, *, what: str) -> Iterator[None]:
  """Holds an exclusive ``fcntl`` lock on ``path``, waiting at most timeout_s.

  Raises:
    ConfigError: another process held it past ``timeout_s``; names ``what``.
  """
  with open(path, "a+", encoding="utf-8") as handle:
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        if time.monotonic() >= deadline:
          raise ConfigError(
              field="data_dir", value=os.path.dirname(path), source=what,
              expected=f"the lock {path} released within {timeout_s:g} s",
              hint=("Another process is still preparing the dataset there; "
                    "wait for it, raise the timeout, or use another "
                    "data_dir")) from None
        time.sleep(0.1)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def prepared(make_builder: Callable[[], Builder],
             prepare: Callable[[Builder], None], *, name: str,
             data_dir: str, chief: bool | None = None,
             timeout_s: float = WAIT_TIMEOUT_SECONDS) -> Builder:
  """``make_builder()``, once the dataset is prepared under ``data_dir``.

  Args:
    make_builder: builds a fresh builder (it re-reads what is on disk).
    prepare: prepares it (``download_and_prepare``); run by the chief only.
    name: the dataset, for paths and messages.
    data_dir: the TFDS data directory holding it.
    chief: whether this process prepares; the resolved cluster's chief by
      default (a process alone is its own chief).
    timeout_s: the longest wait: for the lock on the chief, for the chief's
      preparation on the others.

  Returns:
    A prepared builder.

  Raises:
    ConfigError: the chief's preparation failed (on the other workers too),
      or the wait outlived ``timeout_s``; names the dataset and directory.
  """
  builder = make_builder()
  if _is_prepared(builder):
    return builder
  if chief is None:
    from tfdist.cluster import resolve  # pylint: disable=g-import-not-at-top
    chief = resolve.resolve_cluster().is_chief
  failed = os.path.join(data_dir, f".tfdist-{name}.failed")
  if chief:
    os.makedirs(data_dir, exist_ok=True)
    with file_lock(os.path.join(data_dir, f".tfdist-{name}.lock"), timeout_s,
                   what=f"preparing {name}"):
      builder = make_builder()
      if not _is_prepared(builder):
        with contextlib.suppress(FileNotFoundError):
          os.remove(failed)
        logging.info("tfdist: preparing %s under %s", name, data_dir)
        try:
          prepare(builder)
        except BaseException as e:
          with open(failed, "w", encoding="utf-8") as f:
            f.write(f"{type(e).__name__}: {e}"[:2000])
          raise
        builder = make_builder()
    return builder
  deadline = time.monotonic() + timeout_s
  logging.info("tfdist: waiting for the chief to prepare %s under %s", name,
               data_dir)
  while True:
    builder = make_builder()
    if _is_prepared(builder):
      return builder
    if os.path.exists(failed):
      with open(failed, encoding="utf-8") as f:
        why = f.read().strip()
      raise ConfigError(
          field="dataset", value=name, source="the chief's preparation",
          expected=f"{name} prepared under {data_dir} by the chief",
          hint=f"The chief failed: {why}")
    if time.monotonic() >= deadline:
      raise ConfigError(
          field="dataset", value=name, source="waiting for the chief",
          expected=(f"{name} prepared under {data_dir} by the chief within "
                    f"{timeout_s:g} s"),
          hint=("The chief prepares TFDS datasets and the other workers "
                "wait: check the chief's output, give every worker the same "
                "(shared) data_dir, or prepare the dataset before training"))
    time.sleep(_POLL_SECONDS)


def _is_prepared(builder) -> bool:
  try:
    return builder.is_prepared()
  except (OSError, ValueError):  # Half-written files of a build under way.
    return False
