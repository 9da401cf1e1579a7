"""TensorFlow `ClusterResolver`s backed by a resolved `ClusterInfo`.

The only module of `tfdist.cluster` that imports TensorFlow: strategies take a
`ClusterResolver`, and `resolver_for` turns any `ClusterInfo` into one.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.cluster import slurm as slurm_lib
from tfdist.cluster.info import ClusterInfo

__all__ = ["StaticClusterResolver", "SlurmClusterResolver", "resolver_for"]

class StaticClusterResolver(tf.distribute.cluster_resolver.SimpleClusterResolver):
  """Serves a resolved `ClusterInfo` through TensorFlow's resolver interface."""

  def __init__(self, info: ClusterInfo):
    super().__init__(info.cluster_spec(), task_type=info.task_type,
                     task_id=info.task_id,
                     num_accelerators=dict(info.accelerators),
                     rpc_layer=info.rpc_layer)
    self._info = info

  def master(self, task_type=None, task_id=None, rpc_layer=None):
    """This task's address (TensorFlow's resolver gives ``""`` unless told)."""
    task_type = self.task_type if task_type is None else task_type
    task_id = self.task_id if task_id is None else task_id
    if task_type is None or task_id is None:
      return ""
    return super().master(task_type, task_id, rpc_layer)

  @property
  def info(self) -> ClusterInfo:
    """The resolved cluster this resolver serves."""
    return self._info


class SlurmClusterResolver(StaticClusterResolver):
  """A TF ``ClusterResolver`` for the current srun step.

  Unlike ``tf.distribute.cluster_resolver.SlurmClusterResolver`` it keeps
  SLURM's rank order, works without GPUs and never writes the environment
  (tensorflow/tensorflow#56894).
  """

  def __init__(self, *, roles: slurm_lib.Roles | None = None,
               port_base: int | None = None,
               environ: slurm_lib.Environ | None = None):
    """Resolves with `tfdist.cluster.slurm.resolve_slurm` (same arguments).

    Raises:
      ConfigError: as `resolve_slurm`.
    """
    super().__init__(slurm_lib.resolve_slurm(environ, roles=roles,
                                             port_base=port_base))


def resolver_for(info: ClusterInfo) -> StaticClusterResolver:
  """A `tf.distribute.cluster_resolver.ClusterResolver` serving ``info``."""
  return StaticClusterResolver(info)
