"""tfdist: TensorFlow distribution strategies that work where users need them.

Resolve the cluster (explicit > TF_CONFIG > SLURM > TPU > local machine) and
build the matching `tf.distribute.Strategy`::

    import tfdist
    strategy = tfdist.make_strategy("auto")
    with strategy.scope():
      model = ...

Names that need TensorFlow load on first use, so ``tfdist --help`` and
TF_CONFIG or hostlist parsing do not pay for importing it.
"""

from __future__ import annotations

import importlib
from typing import Any

from tfdist.cluster.hostlist import expand_hostlist
from tfdist.cluster.hostlist import expand_tasks_per_node
from tfdist.cluster.info import ClusterInfo
from tfdist.cluster.info import SlurmInfo
from tfdist.cluster.tf_config import parse_tf_config
from tfdist.errors import CheckpointError
from tfdist.errors import ConfigError
from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import PreemptedError
from tfdist.errors import StartupTimeoutError
from tfdist.errors import TfdistError
from tfdist.errors import TpuUnavailableError
from tfdist.errors import WorkerLostError

__version__ = "0.1.0"

# Public name -> the module that defines it; imported on first access.
_LAZY = {
    "resolve_cluster": "tfdist.cluster.resolve",
    "SlurmClusterResolver": "tfdist.cluster.slurm",
    "make_strategy": "tfdist.strategy.factory",
    "choose_strategy": "tfdist.strategy.factory",
    "STRATEGY_NAMES": "tfdist.strategy.factory",
    "serve": "tfdist.strategy.server",
    "fit": "tfdist.training.fit",
    "BackupAndRestore": "tfdist.training.backup",
    "Runner": "tfdist.training.runner",
    "RunnerOptions": "tfdist.training.runner",
    "supervised_step": "tfdist.training.runner",
    "scaled_loss": "tfdist.training.runner",
    "chief_aware": "tfdist.training.callbacks",
    "save_model": "tfdist.training.callbacks",
    "is_chief": "tfdist.training.chief",
    "PreemptionWatcher": "tfdist.training.preemption",
    "DefaultOptions": "tfdist.strategy.options",
    "OneDeviceOptions": "tfdist.strategy.options",
    "MirroredOptions": "tfdist.strategy.options",
    "MultiWorkerMirroredOptions": "tfdist.strategy.options",
    "ParameterServerOptions": "tfdist.strategy.options",
    "CentralStorageOptions": "tfdist.strategy.options",
    "TPUOptions": "tfdist.strategy.options",
}

__all__ = [
    "BackupAndRestore",
    "CentralStorageOptions",
    "CheckpointError",
    "ClusterInfo",
    "ConfigError",
    "DefaultOptions",
    "MirroredOptions",
    "MultiWorkerMirroredOptions",
    "OneDeviceOptions",
    "PREEMPTED_EXIT_CODE",
    "ParameterServerOptions",
    "PreemptedError",
    "PreemptionWatcher",
    "Runner",
    "RunnerOptions",
    "STRATEGY_NAMES",
    "SlurmClusterResolver",
    "SlurmInfo",
    "StartupTimeoutError",
    "TPUOptions",
    "TfdistError",
    "TpuUnavailableError",
    "WorkerLostError",
    "__version__",
    "chief_aware",
    "choose_strategy",
    "expand_hostlist",
    "expand_tasks_per_node",
    "fit",
    "is_chief",
    "make_strategy",
    "parse_tf_config",
    "resolve_cluster",
    "save_model",
    "scaled_loss",
    "serve",
    "supervised_step",
]


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))
