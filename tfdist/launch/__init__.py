"""Starting the processes of a cluster; TensorFlow-free.

One module per way of starting them:

| module   | how                                                             |
|----------|-----------------------------------------------------------------|
| `local`  | every task as a process on this machine (``tfdist launch``), one node of several with ``nnodes`` |
| `rendezvous` | node 0 hands every node its part of one cluster, members proven by the job secret |
| `sbatch` | an sbatch script that starts them with ``srun`` (``tfdist slurm``) |

Nothing here imports `tfdist.strategy`, `tfdist.training` or TensorFlow: a
launcher only starts programs that do.

Example:
  >>> spec = LaunchSpec(num_workers=2, command=("python", "train.py"))
  >>> launch(spec)  # doctest: +SKIP
"""

from tfdist.launch.local import MAX_RESTART_DELAY_SECONDS
from tfdist.launch.local import Launcher
from tfdist.launch.local import LaunchSpec
from tfdist.launch.local import TaskFailure
from tfdist.launch.local import launch
from tfdist.launch.local import preflight
from tfdist.launch.sbatch import PRESETS
from tfdist.launch.sbatch import SbatchSpec
from tfdist.launch.sbatch import parse_time
from tfdist.launch.sbatch import render
from tfdist.launch.sbatch import template_name

__all__ = [
    "LaunchSpec",
    "Launcher",
    "MAX_RESTART_DELAY_SECONDS",
    "PRESETS",
    "SbatchSpec",
    "TaskFailure",
    "launch",
    "parse_time",
    "preflight",
    "render",
    "template_name",
]
