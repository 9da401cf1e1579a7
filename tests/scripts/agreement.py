"""PreemptionWatcher's agreement between 2 MultiWorkerMirrored workers.

Each worker calls should_stop once per simulated step (SLEEP s). Worker 1
alone "receives" a signal at step SIGNAL_AT (its handler's effect is set
directly). Prints JSON: the step each worker stopped at and how many
agreements (all-reduces) it took part in.
"""

import json
import os
import sys
import time

import tfdist

check_seconds, sleep, signal_at = (float(a) for a in sys.argv[1:4])
strategy = tfdist.make_strategy("multi_worker_mirrored")
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
watcher = tfdist.PreemptionWatcher(strategy, check_seconds=check_seconds)
agreements = 0
inner = watcher._all_workers_sum  # pylint: disable=protected-access


def counted(*args):
  global agreements
  agreements += 1
  return inner(*args)


watcher._all_workers_sum = counted  # pylint: disable=protected-access
stopped = None
for step in range(1, 2000):
  time.sleep(sleep)
  if task == 1 and step == signal_at:
    watcher._on_signal(15, None)  # pylint: disable=protected-access
  if watcher.should_stop():
    stopped = step
    break
print(json.dumps({"stopped": stopped, "agreements": agreements}))
