"""A TensorFlow-free SLURM task for the in-process requeue tests.

Does what a tfdist training task does once it saved on USR1, without the
training: prints ``RESULT {"procid": R, "restart": N, "waiting": true}``,
waits for USR1 (at most ``--wait`` seconds), is deaf to SIGTERM from then
on (as `tfdist.training.preemption` is after a preemption), then the chief
(rank 0) calls `tfdist.cluster.requeue.requeue_after_save` (the call
`tfdist.training.preemption.PreemptionWatcher.exit` makes) and prints its
line as ``tfdist: LINE``, and every task exits 42. Without USR1 it exits 0.
"""

import argparse
import json
import os
import signal
import sys
import time

from tfdist.cluster import requeue
from tfdist.errors import PREEMPTED_EXIT_CODE

parser = argparse.ArgumentParser()
parser.add_argument("--wait", type=float, default=60.0)
args = parser.parse_args()

got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(time.time()))
# The task's rank: its TF_CONFIG index under tfdist launch, else srun's.
procid = (json.loads(os.environ["TF_CONFIG"])["task"]["index"]
          if "TF_CONFIG" in os.environ else int(os.environ["SLURM_PROCID"]))
print("RESULT " + json.dumps({
    "procid": procid,
    "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    "waiting": True}), flush=True)
deadline = time.time() + args.wait
while not got and time.time() < deadline:
  time.sleep(0.1)
if not got:
  sys.exit(0)
# As tfdist's watcher after a preemption: a later SIGTERM (SLURM stops the
# step as the chief requeues the job) cannot end the task before its line.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if procid == 0:
  line = requeue.requeue_after_save()
  if line:
    print(f"tfdist: {line}", flush=True)
sys.exit(PREEMPTED_EXIT_CODE)
