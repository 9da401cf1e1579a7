"""PreemptionWatcher's agreement between 2 MultiWorkerMirrored workers.

Usage: agreement.py SLEEP SIGNAL_AT CHECK_SECONDS [CHECK_SECONDS ...]

For each CHECK_SECONDS in turn, a watcher of its own: each worker calls
should_stop once per simulated step (SLEEP s). Worker 1 alone "receives" a
signal at step SIGNAL_AT (its handler's effect is set directly). Prints one
JSON line per watcher: its check_seconds, the step each worker stopped at
and how many agreements (all-reduces) it took part in. Every worker stops
the same watcher at the same step, so the next one starts together.
"""

import json
import os
import sys
import time

import tfdist

sleep, signal_at = float(sys.argv[1]), int(sys.argv[2])
strategy = tfdist.make_strategy("multi_worker_mirrored")
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def run(check_seconds):
  """Steps until ``check_seconds``'s watcher stops: the step, agreements."""
  watcher = tfdist.PreemptionWatcher(strategy, check_seconds=check_seconds)
  agreements = 0
  inner = watcher._all_workers_sum  # pylint: disable=protected-access

  def counted(*args):
    nonlocal agreements
    agreements += 1
    return inner(*args)

  watcher._all_workers_sum = counted  # pylint: disable=protected-access
  for step in range(1, 2000):
    time.sleep(sleep)
    if task == 1 and step == signal_at:
      watcher._on_signal(15, None)  # pylint: disable=protected-access
    if watcher.should_stop():
      return step, agreements
  return None, agreements


for check in sys.argv[3:]:
  stopped, agreements = run(float(check))
  print(json.dumps({"check_seconds": float(check), "stopped": stopped,
                    "agreements": agreements}), flush=True)
