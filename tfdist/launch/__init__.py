"""Starting the processes of a cluster; TensorFlow-free.

| module       | holds                                                       |
|--------------|-------------------------------------------------------------|
| `spec`       | `LaunchSpec`, its checks, and `preflight` (once per run)    |
| `local`      | the one supervision loop of ``tfdist launch``, any number of nodes |
| `rounds`     | who trains, round by round: the decisions (`Rounds`), and one node's rendezvous (`Solo`) |
| `rendezvous` | node 0's server and each node's member: `Rounds` over the network, proven by the job secret |
| `fingerprint`| what a node runs, and whether two nodes run the same       |
| `output`     | the tasks' prefixed output, progress bars and failure tails |
| `stopper`    | stopping each process with its whole group (the bench's too) |
| `sbatch`     | an sbatch script that starts the tasks with ``srun`` (``tfdist slurm``) |

Nothing here imports `tfdist.strategy`, `tfdist.training` or TensorFlow: a
launcher only starts programs that do.

Example:
  >>> spec = LaunchSpec(num_workers=2, command=("python", "train.py"))
  >>> launch(spec)  # doctest: +SKIP
"""

from tfdist.launch.local import Launcher
from tfdist.launch.local import launch
from tfdist.launch.sbatch import PRESETS
from tfdist.launch.sbatch import SbatchSpec
from tfdist.launch.sbatch import parse_time
from tfdist.launch.sbatch import render
from tfdist.launch.sbatch import template_name
from tfdist.launch.spec import MAX_RESTART_DELAY_SECONDS
from tfdist.launch.spec import LaunchSpec
from tfdist.launch.spec import preflight

__all__ = [
    "LaunchSpec",
    "Launcher",
    "MAX_RESTART_DELAY_SECONDS",
    "PRESETS",
    "SbatchSpec",
    "launch",
    "parse_time",
    "preflight",
    "render",
    "template_name",
]
