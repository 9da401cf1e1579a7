"""A ParameterServerStrategy training job for fault tests.

Usage: ps_fault_job.py DIR [--sleep S] [--epochs E] [--backup-every K]
                           [--no-reads] [--chief-timeout T]

The same script runs on every task, as under ``tfdist launch``:

* ps and worker tasks serve the chief through ``tfdist.make_strategy``,
  which says ``served the chief`` on stderr once the chief has come and
  gone (``tfdist.serve(chief_timeout=T)`` with ``--chief-timeout``, then
  ``served`` on stdout);
* the chief trains with ``tfdist.fit`` (E epochs of 6 steps, backup_dir=DIR,
  a backup every K steps). After scheduling each step it prints
  ``step K applied M``: K steps scheduled, counted over restarts (from the
  iterations restored at the start), and M the optimizer's iterations read
  from the ps (``?`` with ``--no-reads``, so that only tfdist.fit itself
  talks to the ps). It then sleeps S seconds, or not at all once the file
  ``DIR.fast`` exists. At the end it prints one JSON line: ``start`` (the
  iterations when training began, i.e. restored), ``scheduled`` (steps this
  run scheduled), ``iterations`` and ``weights``.

Every train step runs ``tf.print`` on the worker that executes it, so each
worker's own stderr shows ``TRAIN_STEP`` once per step it ran.
"""

import argparse
import json
import os
import sys
import time

import job_common
import tfdist

TRAIN_STEP = "tfdist-test: train step ran here"

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("--sleep", type=float, default=0.3)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--backup-every", type=int, default=2)
parser.add_argument("--chief-timeout", type=float, default=None)
parser.add_argument("--no-reads", action="store_true",
                    help="do not read the optimizer's iterations per step")
args = parser.parse_args()

task_type = json.loads(os.environ["TF_CONFIG"])["task"]["type"]
if task_type != "chief" and args.chief_timeout is not None:
  tfdist.serve(chief_timeout=args.chief_timeout)
  print("served", flush=True)
  os._exit(0)  # As make_strategy ends a server: teardown can hang.
print("building", flush=True)
# On ps and worker tasks this serves the chief, then ends the process with 0
# after "tfdist: ... served the chief until it ended" on stderr.
strategy = tfdist.make_strategy("parameter_server")

import keras  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

STEPS = 6  # Per epoch: 48 examples in global batches of 8.


class Traced(keras.Sequential):
  """Prints on the worker that runs each train step."""

  def train_step(self, data):
    tf.print(TRAIN_STEP, output_stream=sys.stderr)
    return super().train_step(data)


x, y = job_common.data(STEPS * job_common.GLOBAL_BATCH)
with strategy.scope():
  init = keras.initializers.GlorotUniform
  model = Traced([
      keras.Input((6,)),
      keras.layers.Dense(4, activation="tanh", kernel_initializer=init(1)),
      keras.layers.Dense(1, kernel_initializer=init(2)),
  ])
  model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")


class Progress(keras.callbacks.Callback):
  """Prints progress; records where this run started and what it scheduled."""

  start = None
  scheduled = 0

  def on_train_begin(self, logs=None):
    # The backup, if any, is restored before training begins.
    Progress.start = int(self.model.optimizer.iterations.numpy())

  def on_train_batch_end(self, batch, logs=None):
    Progress.scheduled += 1
    applied = ("?" if args.no_reads
               else int(self.model.optimizer.iterations.numpy()))
    print(f"step {Progress.start + Progress.scheduled} applied {applied}",
          flush=True)
    if not os.path.exists(args.dir + ".fast"):
      time.sleep(args.sleep)


tfdist.fit(model, job_common.dataset_fn(x, y), epochs=args.epochs,
           steps_per_epoch=STEPS, callbacks=[Progress()], backup_dir=args.dir,
           backup_every_steps=args.backup_every, verbose=0)
print(json.dumps({"start": Progress.start, "scheduled": Progress.scheduled,
                  "iterations": int(model.optimizer.iterations.numpy()),
                  "weights": job_common.weights(model)}), flush=True)
