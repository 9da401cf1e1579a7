"""`ClusterInfo`: what tfdist knows about the cluster this process belongs to.

Resolvers (TF_CONFIG, SLURM, TPU, the local machine) each return one frozen
`ClusterInfo`. It converts to what TensorFlow wants: a `tf.train.ClusterSpec`
or a TF_CONFIG dict (`tfdist.cluster.resolver.resolver_for` makes a
`ClusterResolver` of it). Resolvers never write `os.environ`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

from tfdist.errors import ConfigError

__all__ = ["ClusterInfo", "SlurmInfo", "FrozenMapping", "SOURCES", "JOB_NAMES",
           "is_chief_task"]

#: Where a `ClusterInfo` can come from, in the order of precedence.
SOURCES = ("explicit", "tf_config", "slurm", "tpu", "local")

#: Job names TensorFlow documents for TF_CONFIG.
JOB_NAMES = ("chief", "worker", "ps", "evaluator")


def is_chief_task(task_type: str | None, task_id: int | None,
                  cluster: Mapping[str, Any]) -> bool:
  """The one rule for who writes checkpoints, logs and exports.

  That is the single local process (no task type), the ``chief`` task, or
  worker 0 when the cluster has no chief. Never the ``evaluator`` (it only
  reads training state) nor a ``ps`` task. `ClusterInfo.is_chief` and
  `tfdist.is_chief` both apply it.
  """
  if task_type in (None, "chief"):
    return True
  return task_type == "worker" and task_id == 0 and "chief" not in cluster


class FrozenMapping(Mapping):
  """A read-only, hashable, picklable mapping."""

  __slots__ = ("_data",)

  def __init__(self, data: Mapping[str, Any]):
    object.__setattr__(self, "_data", dict(data))

  def __getitem__(self, key):
    return self._data[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._data)

  def __len__(self) -> int:
    return len(self._data)

  def __hash__(self) -> int:
    return hash(tuple(self._data.items()))

  def __eq__(self, other) -> bool:
    return isinstance(other, Mapping) and dict(self) == dict(other)

  def __repr__(self) -> str:
    return repr(self._data)

  def __reduce__(self):
    return (FrozenMapping, (self._data,))


@dataclasses.dataclass(frozen=True)
class SlurmInfo:
  """The SLURM facts behind a cluster resolved from SLURM variables.

  Attributes:
    job_id: ``SLURM_JOB_ID``.
    step_id: ``SLURM_STEP_ID`` (``None`` outside a step).
    node: ``SLURMD_NODENAME``, the node this task runs on.
    local_id: ``SLURM_LOCALID``, the task's index on its node.
    proc_id: ``SLURM_PROCID``, the task's global rank.
    num_tasks: the number of tasks in the step.
    nodes: the step's nodes, in SLURM's order.
    tasks_per_node: tasks on each node of ``nodes``.
    array_job_id: ``SLURM_ARRAY_JOB_ID`` for array jobs, else ``None``.
    array_task_id: ``SLURM_ARRAY_TASK_ID`` for array jobs, else ``None``.
  """
  job_id: str
  step_id: str | None
  node: str
  local_id: int
  proc_id: int
  num_tasks: int
  nodes: tuple[str, ...]
  tasks_per_node: tuple[int, ...]
  array_job_id: str | None = None
  array_task_id: str | None = None


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
  """A resolved cluster and this process's place in it.

  Attributes:
    source: one of `SOURCES`: ``explicit``, ``tf_config``, ``slurm``, ``tpu``
      or ``local``.
    cluster: job name to the ``host:port`` addresses of its tasks, in task
      order. Empty for a single local process.
    task_type: this task's job name, or ``None`` for a single local process.
    task_id: this task's index within its job, or ``None``.
    rpc_layer: the RPC layer, ``grpc`` unless configured otherwise.
    accelerators: accelerator kind to count per task, e.g. ``{"GPU": 2}``.
    origin: where the information came from, in words, for messages.
    slurm: SLURM details when ``source == "slurm"``.
    tpu: the TPU to connect to (``"local"``, a name or a grpc address) when
      the cluster is a TPU.
  """
  source: str
  cluster: Mapping[str, tuple[str, ...]] = dataclasses.field(
      default_factory=dict)
  task_type: str | None = None
  task_id: int | None = None
  rpc_layer: str = "grpc"
  accelerators: Mapping[str, int] = dataclasses.field(default_factory=dict)
  origin: str = "the local machine"
  slurm: SlurmInfo | None = None
  tpu: str | None = None

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
    frozen = {job: tuple(addrs) for job, addrs in self.cluster.items()}
    evaluators = frozen.get("evaluator", ())
    if len(evaluators) > 1 or (self.task_type == "evaluator"
                               and self.task_id not in (0, None)):
      raise ConfigError(
          field="cluster.evaluator" if len(evaluators) > 1 else "task_id",
          value=(list(evaluators) if len(evaluators) > 1 else self.task_id),
          expected="at most one evaluator (index 0), as TensorFlow allows",
          source=self.origin,
          hint="Run one evaluator task; make the others workers")
    object.__setattr__(self, "cluster", FrozenMapping(frozen))
    object.__setattr__(self, "accelerators", FrozenMapping(self.accelerators))

  @property
  def num_workers(self) -> int:
    """Chief plus worker tasks: the tasks that compute gradients."""
    return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

  @property
  def num_ps(self) -> int:
    return len(self.cluster.get("ps", ()))

  @property
  def is_chief(self) -> bool:
    """True on the task that writes checkpoints and logs.

    That is the ``chief`` task, or worker 0 when the cluster has no chief, or
    the single local process.
    """
    return is_chief_task(self.task_type, self.task_id, self.cluster)

  @property
  def address(self) -> str | None:
    """This task's ``host:port``, or ``None`` if it has none in `cluster`."""
    addrs = self.cluster.get(self.task_type or "", ())
    if self.task_id is not None and 0 <= self.task_id < len(addrs):
      return addrs[self.task_id]
    return None

  def to_dict(self) -> dict[str, Any]:
    """A JSON-ready dict of every field."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["cluster"] = {job: list(addrs) for job, addrs in self.cluster.items()}
    out["accelerators"] = dict(self.accelerators)
    if self.slurm is not None:
      out["slurm"] = dataclasses.asdict(self.slurm)
    return out

  def cluster_spec(self):
    """This cluster as a `tf.train.ClusterSpec`."""
    import tensorflow as tf  # Deferred: parsing needs no TensorFlow.
    return tf.train.ClusterSpec(
        {job: list(addrs) for job, addrs in self.cluster.items()})
