"""Where this process runs: the cluster, read from TF_CONFIG, SLURM, a TPU VM
or the local machine (explicit > TF_CONFIG > SLURM > TPU > local).

Every module here but `resolver` is TensorFlow-free, and names load on first
use. One module per concept:

| module      | concept                                                       |
|-------------|---------------------------------------------------------------|
| `info`      | `ClusterInfo`, the frozen answer, and the one chief rule      |
| `resolve`   | `resolve_cluster`: the precedence that picks a source         |
| `tf_config` | TF_CONFIG parsing and checks                                  |
| `slurm`     | SLURM job variables, rank order, roles and ports              |
| `hostlist`  | SLURM hostlist expressions                                    |
| `requeue`   | the chief requeues its SLURM job after a preempted save       |
| `names`     | host names resolved within a bound, or refused by name        |
| `tpu`       | TPU VM and TPU name detection                                 |
| `local`     | the local machine's devices                                   |
| `resolver`  | TensorFlow `ClusterResolver`s for a `ClusterInfo`             |
"""

from tfdist import _lazy

_EXPORTS = {
    "ClusterInfo": "tfdist.cluster.info",
    "SlurmInfo": "tfdist.cluster.info",
    "is_chief_task": "tfdist.cluster.info",
    "resolve_cluster": "tfdist.cluster.resolve",
    "ClusterLike": "tfdist.cluster.resolve",
    "parse_tf_config": "tfdist.cluster.tf_config",
    "dump_tf_config": "tfdist.cluster.tf_config",
    "resolve_slurm": "tfdist.cluster.slurm",
    "parse_roles": "tfdist.cluster.slurm",
    "in_slurm_job": "tfdist.cluster.slurm",
    "is_slurm_step": "tfdist.cluster.slurm",
    "expand_hostlist": "tfdist.cluster.hostlist",
    "expand_tasks_per_node": "tfdist.cluster.hostlist",
    "resolve_host": "tfdist.cluster.names",
    "resolve_names": "tfdist.cluster.names",
    "detect_tpu": "tfdist.cluster.tpu",
    "resolve_tpu": "tfdist.cluster.tpu",
    "local_devices": "tfdist.cluster.local",
    "resolve_local": "tfdist.cluster.local",
    "StaticClusterResolver": "tfdist.cluster.resolver",
    "SlurmClusterResolver": "tfdist.cluster.resolver",
    "resolver_for": "tfdist.cluster.resolver",
}

_lazy.install(globals(), _EXPORTS)
