"""A 2-worker MultiWorkerMirrored task that all-reduces once, then ends.

Usage: clean_exit.py --linger_task N --linger S [--exit_timeout S|none]
                     [--fail_task N [--fail raise|exit|os_exit|signal]]

Task ``linger_task`` stays S seconds after the all-reduce (as a slow teardown
would); task ``fail_task`` fails instead of ending, by ``--fail``: an uncaught
exception (the default), ``sys.exit(3)``, ``os._exit(5)`` or SIGKILL, after
printing ``FAILS_AT <time>`` on stderr. Each task prints one
JSON line when its program is done (``done_at``) and, from an ``atexit``
handler registered before the strategy (so it runs after tfdist's exit
wait), ``left_at`` on stderr as ``LEFT_AT <time>``.
"""

import argparse
import atexit
import json
import os
import signal
import sys
import time

atexit.register(lambda: print(f"LEFT_AT {time.time()}", file=sys.stderr,
                              flush=True))

import tfdist  # pylint: disable=g-import-not-at-top

parser = argparse.ArgumentParser()
parser.add_argument("--linger_task", type=int, default=-1)
parser.add_argument("--linger", type=float, default=0.0)
parser.add_argument("--exit_timeout", default="60")
parser.add_argument("--fail_task", type=int, default=-1)
parser.add_argument("--fail", default="raise",
                    choices=("raise", "exit", "os_exit", "signal"))
args = parser.parse_args()

exit_timeout = None if args.exit_timeout == "none" else float(
    args.exit_timeout)
strategy = tfdist.make_strategy("multi_worker_mirrored",
                                exit_timeout_seconds=exit_timeout)
task = tfdist.resolve_cluster().task_id

import tensorflow as tf  # pylint: disable=g-import-not-at-top

total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                        strategy.run(lambda: tf.constant(1.0)), axis=None)
if task == args.fail_task:
  print(f"FAILS_AT {time.time()}", file=sys.stderr, flush=True)
  if args.fail == "exit":
    sys.exit(3)
  if args.fail == "os_exit":
    os._exit(5)
  if args.fail == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
  raise RuntimeError(f"task {task} fails on purpose")
if task == args.linger_task:
  time.sleep(args.linger)
print(json.dumps({"task": task, "sum": float(total), "done_at": time.time()}),
      flush=True)
