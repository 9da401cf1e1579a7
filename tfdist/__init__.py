"""tfdist: TensorFlow distribution strategies that work where users need them.

Resolve the cluster (explicit > TF_CONFIG > SLURM > TPU > local machine) and
build the matching `tf.distribute.Strategy`::

    import tfdist
    strategy = tfdist.make_strategy("auto")
    with strategy.scope():
      model = ...

Every public name is listed once, in `_EXPORTS`, with the module that defines
it. Names load on first use, so ``tfdist --help`` and TF_CONFIG or hostlist
parsing do not pay for importing TensorFlow. `tfdist.data`, `tfdist.perf` and
`tfdist.flags` are subpackages with faces of their own.
"""

from __future__ import annotations

from tfdist import _lazy
from tfdist.strategy import OPTION_CLASSES as _OPTION_CLASSES

__version__ = "0.3.0"

# Public name -> the module that defines it, grouped by floor.
_EXPORTS: dict[str, str] = {
    # The cluster: where this process runs (TensorFlow-free but the resolvers).
    "ClusterInfo": "tfdist.cluster.info",
    "SlurmInfo": "tfdist.cluster.info",
    "resolve_cluster": "tfdist.cluster.resolve",
    "parse_tf_config": "tfdist.cluster.tf_config",
    "expand_hostlist": "tfdist.cluster.hostlist",
    "expand_tasks_per_node": "tfdist.cluster.hostlist",
    "SlurmClusterResolver": "tfdist.cluster.resolver",
    "resolver_for": "tfdist.cluster.resolver",
    # The strategy: what to build there.
    "make_strategy": "tfdist.strategy.factory",
    "choose_strategy": "tfdist.strategy.factory",
    "STRATEGY_NAMES": "tfdist.strategy.catalog",
    **dict.fromkeys(_OPTION_CLASSES, "tfdist.strategy.options"),
    "serve": "tfdist.strategy.server",
    "is_chief": "tfdist.strategy.introspect",
    "gradient_transport": "tfdist.strategy.transport",
    # Training: Keras fit, custom loops, checkpoints and preemption.
    "fit": "tfdist.training.fit",
    "BackupAndRestore": "tfdist.training.backup",
    "Runner": "tfdist.training.runner",
    "RunnerOptions": "tfdist.training.runner",
    "supervised_step": "tfdist.training.steps",
    "scaled_loss": "tfdist.training.steps",
    "chief_aware": "tfdist.training.callbacks",
    "save_model": "tfdist.training.callbacks",
    "PreemptionWatcher": "tfdist.training.preemption",
    # Launching from a notebook cell.
    "notebook_launcher": "tfdist.launch.notebook",
    # Errors and the process contract.
    "TfdistError": "tfdist.errors",
    "ConfigError": "tfdist.errors",
    "TpuUnavailableError": "tfdist.errors",
    "StartupTimeoutError": "tfdist.errors",
    "PreemptedError": "tfdist.errors",
    "WorkerLostError": "tfdist.errors",
    "CheckpointError": "tfdist.errors",
    "DiskFullError": "tfdist.errors",
    "WorkerFailedError": "tfdist.errors",
    "PREEMPTED_EXIT_CODE": "tfdist.errors",
    "PREEMPTION_SIGNALS": "tfdist.errors",
}

# Names that moved in 0.2.0, kept for one release (CHANGELOG.md):
# old -> (module, new name); "" is the module itself.
_ALIASES: dict[str, tuple[str, str]] = {
    "localhost": ("tfdist._net", ""),
    "slurm_script": ("tfdist.launch.sbatch", ""),
    "info": ("tfdist.report", ""),
}

__all__ = ["__version__"]
_lazy.install(globals(), _EXPORTS, _ALIASES)
