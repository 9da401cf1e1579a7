"""`resolve_cluster`: one documented precedence for where the cluster comes from.

    explicit argument  >  TF_CONFIG  >  SLURM step  >  TPU  >  the local machine

* **explicit**: ``cluster=`` given as a `ClusterInfo`, a TF_CONFIG-shaped dict or
  its JSON text (validated like TF_CONFIG), or ``tpu=`` given.
* **TF_CONFIG**: the variable is set (an empty value is an error, not "unset").
* **SLURM**: the process is a task of an ``srun`` step. Inside an allocation
  but outside a step (a batch script, ``salloc``) this source is skipped, so a
  single ``python train.py`` trains locally; ``source="slurm"`` makes that an
  error instead.
* **TPU**: a TPU VM or TPU node is detected (see `tfdist.cluster.tpu`).
* **local**: everything else: one process with this machine's devices.

Resolvers return values and never write ``os.environ``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from tfdist.cluster import local as local_lib
from tfdist.cluster import slurm as slurm_lib
from tfdist.cluster import tf_config as tf_config_lib
from tfdist.cluster import tpu as tpu_lib
from tfdist.cluster.info import ClusterInfo
from tfdist.errors import ConfigError

__all__ = ["resolve_cluster", "ClusterLike", "SOURCE_CHOICES"]

#: What ``cluster=`` accepts: a resolved cluster, a TF_CONFIG dict, or JSON text.
ClusterLike = ClusterInfo | Mapping[str, Any] | str

#: Values of ``source=``.
SOURCE_CHOICES = ("auto", "tf_config", "slurm", "tpu", "local")


def resolve_cluster(cluster: ClusterLike | None = None, *,
                    source: str = "auto",
                    tpu: str | None = None,
                    slurm_roles: Mapping[str, int] | None = None,
                    port_base: int | None = None,
                    environ: Mapping[str, str] | None = None) -> ClusterInfo:
  """Resolves the cluster this process belongs to.

  Args:
    cluster: an explicit cluster; wins over everything else.
    source: ``auto`` follows the precedence above; any other of
      `SOURCE_CHOICES` insists on that source and fails if it is absent.
    tpu: an explicit TPU (``local``, a name or ``grpc://host:port``).
    slurm_roles: job names for SLURM ranks in rank order, e.g.
      ``{"chief": 1, "ps": 1, "worker": 2}``; all ``worker`` by default.
    port_base: first port for SLURM tasks; derived from the job id by default.
    environ: the environment to read; `os.environ` by default.

  Returns:
    A frozen `ClusterInfo`; never ``None``.

  Raises:
    ConfigError: the chosen source is malformed or, with ``source`` set,
      absent.
  """
  environ = os.environ if environ is None else environ
  if source not in SOURCE_CHOICES:
    raise ConfigError(field="source", value=source,
                      expected=f"one of {sorted(SOURCE_CHOICES)}",
                      source="argument source=")
  if cluster is not None:
    return _explicit(cluster)
  if tpu is not None:
    return tpu_lib.resolve_tpu(tpu)

  if source in ("auto", "tf_config"):
    info = tf_config_lib.from_environ(environ)
    if info is not None:
      return info
    if source == "tf_config":
      raise ConfigError(field="TF_CONFIG", expected="a TF_CONFIG JSON object",
                        source="the environment (source='tf_config')",
                        hint="Set TF_CONFIG, or use tfdist launch")
  if source in ("auto", "slurm"):
    if source == "slurm" or slurm_lib.is_slurm_step(environ):
      return slurm_lib.resolve_slurm(environ, roles=slurm_roles,
                                     port_base=port_base)
  if source in ("auto", "tpu"):
    info = tpu_lib.resolve_tpu(None, environ)
    if info is not None:
      return info
    if source == "tpu":
      raise ConfigError(
          field="tpu", expected="a TPU VM or TPU_NAME/COLAB_TPU_ADDR",
          source="the environment (source='tpu')",
          hint="Pass tpu='local' on a TPU VM or a grpc://host:port address")
  return local_lib.resolve_local()


def _explicit(cluster: ClusterLike) -> ClusterInfo:
  if isinstance(cluster, ClusterInfo):
    return cluster
  if isinstance(cluster, (str, Mapping)):
    return tf_config_lib.parse_tf_config(cluster, source="argument cluster=",
                                         explicit=True)
  raise ConfigError(
      field="cluster", value=cluster, source="argument cluster=",
      expected="a ClusterInfo, a TF_CONFIG-shaped dict or its JSON text")


def describe(info: ClusterInfo) -> str:
  """One line on a cluster, for logs."""
  if not info.cluster:
    return f"single process ({info.origin})"
  jobs = ", ".join(f"{len(v)} {k}" for k, v in info.cluster.items())
  return (f"{jobs}; this task {info.task_type}:{info.task_id} "
          f"({info.origin})")


