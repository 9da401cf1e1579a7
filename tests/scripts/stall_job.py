"""A Keras fit where one worker falls behind; run under tfdist launch.

Usage: stall_job.py TRANSPORT TIMEOUT_S [--slow-worker K --at STEP]
  [--epochs E] [--steps-per-execution N]

Every worker builds MultiWorkerMirroredStrategy (``tfdist.make_strategy``)
with TRANSPORT and a collective timeout of TIMEOUT_S, prints
``{"pid": ...}``, and trains a small Dense model with Keras ``fit`` for E
epochs of 100 steps, printing ``{"trained": rank}`` after its first step.
Worker K sleeps in a callback after step STEP (the line `SLEEP_LINE`
names), far longer than the bound, so the others wait for it in the next
step (with N steps per execution, STEP ends an execution).
"""

import argparse
import json
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("transport")
parser.add_argument("timeout_s", type=float)
parser.add_argument("--slow-worker", type=int, default=-1)
parser.add_argument("--at", type=int, default=5)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--steps-per-execution", type=int, default=1)
args = parser.parse_args()

import keras  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

import tfdist  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist import perf  # pylint: disable=g-import-not-at-top,wrong-import-position

strategy = tfdist.make_strategy(
    "multi_worker_mirrored", transport=args.transport,
    timeout_seconds=args.timeout_s)
rank = strategy.cluster_resolver.task_id
print(json.dumps({"pid": os.getpid(), "rank": rank}), flush=True)


class Slow(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self._said = False

  def on_train_batch_end(self, batch, logs=None):
    if not self._said:
      self._said = True
      print(json.dumps({"trained": rank}), flush=True)
    if rank == args.slow_worker and batch + 1 == args.at:
      time.sleep(600)  # SLEEP_LINE: the stall report names this line.


with strategy.scope():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=perf.with_gradient_options(
      keras.optimizers.SGD(0.1),
      perf.GradientOptions(transport=args.transport,
                           socket_timeout_seconds=args.timeout_s)),
                loss="mse", steps_per_execution=args.steps_per_execution)
x = np.ones((800, 4), "float32")
model.fit(x, np.zeros((800, 2), "float32"), batch_size=8, epochs=args.epochs,
          verbose=0, callbacks=[Slow()], shuffle=False)
print(json.dumps({"done": rank}), flush=True)
