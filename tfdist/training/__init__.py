"""Training under a strategy: Keras ``fit``, a custom loop, checkpoints.

One module per job:

| module           | job                                                         |
|------------------|-------------------------------------------------------------|
| `fit`            | `fit`: Keras ``fit`` plus what a distributed run needs      |
| `_input`         | input that resumes mid-epoch, shared by fit and Runner      |
| `_ps_loop`       | fit's ClusterCoordinator loop under ParameterServerStrategy |
| `_worker_errors` | lost peers as `tfdist.WorkerLostError`                      |
| `backup`         | `BackupAndRestore`: exact mid-epoch resume, preemption      |
| `runner`         | `Runner`, `RunnerOptions`: an Orbit-style custom loop       |
| `steps`          | `supervised_step`, `scaled_loss`: per-replica steps         |
| `checkpoints`    | the one chief-aware save; restoring the newest readable     |
| `ownership`      | a backup directory's owner record; what tfdist may remove   |
| `chief`          | `write_dir`: the chief writes the real path, others a temp  |
| `callbacks`      | `chief_aware` Keras callbacks; `save_model` from the chief  |
| `preemption`     | `PreemptionWatcher`: SIGTERM/SIGUSR1, agreed by all workers |

Example::

    from tfdist import training

    history = training.fit(model, dataset_fn, epochs=3, steps_per_epoch=100,
                           backup_dir="/shared/backup")
"""

from tfdist.training.backup import BackupAndRestore
from tfdist.training.callbacks import chief_aware
from tfdist.training.callbacks import save_model
from tfdist.training.checkpoints import restore_latest
from tfdist.training.chief import write_dir
from tfdist.training.fit import fit
from tfdist.training.preemption import PreemptionWatcher
from tfdist.training.runner import Runner
from tfdist.training.runner import RunnerOptions
from tfdist.training.steps import StepFn
from tfdist.training.steps import scaled_loss
from tfdist.training.steps import supervised_step

__all__ = [
    "BackupAndRestore",
    "PreemptionWatcher",
    "Runner",
    "RunnerOptions",
    "StepFn",
    "chief_aware",
    "fit",
    "restore_latest",
    "save_model",
    "scaled_loss",
    "supervised_step",
    "write_dir",
]
