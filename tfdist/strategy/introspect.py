"""Reading a running strategy: its cluster, this task, who is chief.

Everything in tfdist that asks a built `tf.distribute.Strategy` where it runs
asks here, so the chief rule (`tfdist.cluster.info.is_chief_task`) and the
quirks of reading a strategy's cluster are written once; and what tfdist
knows about a strategy is one `Record`, kept here (`record_of`).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import tensorflow as tf

from tfdist.cluster.info import ClusterInfo
from tfdist.cluster.info import is_chief_task
from tfdist.strategy.packing import Buffers

__all__ = ["Record", "record_of", "records", "task_of", "is_chief",
           "is_parameter_server", "num_workers", "num_input_workers",
           "record_task"]

_PSS = tf.distribute.experimental.ParameterServerStrategy


@dataclasses.dataclass(kw_only=True, eq=False)
class Record:
  """What tfdist knows about one strategy.

  Attributes:
    built_for: ``(task_type, task_id, cluster)`` `tfdist.make_strategy`
      built it for: a one-process strategy has no resolver to ask (an
      evaluator, or a worker that opted out with "default", is not the chief).
    transport: the `tfdist.strategy.transport.Choice` of its gradients.
    announced: the transports its chief has said carry them.
    rings: its socket rings, by their settings (`tfdist.strategy.rings`).
    sums: the buffers its gradients' sums land in where they are one
      bucket (`tfdist.strategy.buckets`).
    saved: the exports `tfdist.save_model` wrote under it.
    clean_exit: its `tfdist.strategy.clean_exit.CleanExit`, if armed.
    lock: held while ``rings`` or ``announced`` change.
  """
  built_for: tuple | None = None
  transport: Any = None
  announced: set[str] = dataclasses.field(default_factory=set)
  rings: dict[tuple, Any] = dataclasses.field(default_factory=dict)
  sums: Buffers = dataclasses.field(default_factory=Buffers)
  saved: set[str] = dataclasses.field(default_factory=set)
  clean_exit: Any = None
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_records: "weakref.WeakKeyDictionary[Any, Record]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def record_of(strategy: tf.distribute.Strategy) -> Record:
  """The `Record` of ``strategy`` (an empty one the first time)."""
  with _lock:
    record = _records.get(strategy)
    if record is None:  # Made once: a record holds the sums' buffers.
      record = _records[strategy] = Record()
    return record


def records() -> list[Record]:
  """The `Record` of every strategy of this process still alive."""
  with _lock:
    return list(_records.values())


def record_task(strategy: tf.distribute.Strategy, info: ClusterInfo) -> None:
  """Remembers the task ``strategy`` was built for (`make_strategy` does).

  The default strategy is one object per process: the last record wins.
  """
  record_of(strategy).built_for = (info.task_type, info.task_id,
                                   dict(info.cluster))


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
  """Whether ``strategy`` is a ParameterServerStrategy (this is its chief)."""
  return isinstance(strategy, _PSS)


def task_of(strategy: tf.distribute.Strategy
            ) -> tuple[str | None, int | None, dict[str, Any]]:
  """``(task_type, task_id, cluster)`` of this process under ``strategy``.

  ``(None, None, {})`` for single-process strategies. ``cluster`` maps job
  names to a list of addresses, or to ``{index: address}`` for sparse jobs.
  """
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
  ParameterServerStrategy, the only task that runs training code there), or
  worker 0 when the cluster has no chief; never the evaluator. A one-process
  strategy answers for the task `tfdist.make_strategy` built it for.
  """
  if is_parameter_server(strategy):
    return True
  task = task_of(strategy)
  if task[0] is None:
    task = record_of(strategy).built_for or task
  return is_chief_task(*task)


def num_workers(strategy: tf.distribute.Strategy) -> int:
  """Chief and worker tasks of ``strategy``'s cluster; 1 for one process."""
  _, _, cluster = task_of(strategy)
  return max(1, len(cluster.get("chief", ())) + len(cluster.get("worker", ())))


def num_input_workers(strategy: tf.distribute.Strategy) -> int:
  """The input pipelines ``strategy`` reads from: one per worker host.

  One for single-process strategies; the chief and worker tasks for
  MultiWorkerMirroredStrategy; the worker tasks for ParameterServerStrategy
  and the TPU hosts for TPUStrategy.
  """
  _, _, cluster = task_of(strategy)
  if is_parameter_server(strategy):
    return max(1, len(cluster.get("worker", ())))
  return num_workers(strategy)
