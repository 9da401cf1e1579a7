"""A slow deterministic training job for fault tests; prints JSON at the end.

Usage: fault_job.py STRATEGY {fit,keras,runner} DIR [--sleep S] [--steps N]
                    [--pause S]

``fit`` trains with tfdist.fit (3 epochs of 6 steps, backup_dir=DIR, a backup
every 2 steps); ``keras`` the same with plain ``model.fit`` and
``tfdist.BackupAndRestore(DIR, save_freq=2)``; ``runner`` with tfdist.Runner (N steps, checkpoints in DIR
every 3 steps). Each step prints ``step K`` (K counted over restarts) and
sleeps S seconds, so a test can signal or kill a task mid-training.
``--batch G`` sets the global batch (8; 12 splits over 2 and 3 workers).
``--pause S`` prints ``paused`` once the model is built and sleeps S seconds
before training starts: the window of start-up and restore.
"""

import argparse
import json
import os
import time

import job_common
import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("strategy")
parser.add_argument("loop", choices=["fit", "keras", "runner"])
parser.add_argument("dir")
parser.add_argument("--sleep", type=float, default=0.3)
parser.add_argument("--steps", type=int, default=18)
parser.add_argument("--timeout", type=float, default=None)
parser.add_argument("--startup-timeout", type=float, default=None)
parser.add_argument("--pause", type=float, default=0)
parser.add_argument("--batch", type=int, default=job_common.GLOBAL_BATCH)
args = parser.parse_args()

options = {"timeout_seconds": args.timeout} if args.timeout else {}
if args.startup_timeout:
  options["startup_timeout_seconds"] = args.startup_timeout
print(f"pid {os.getpid()}", flush=True)  # For a test to signal it.
print("building", flush=True)
strategy = tfdist.make_strategy(args.strategy, **options)

import keras  # pylint: disable=g-import-not-at-top

G = args.batch
if args.loop in ("fit", "keras"):
  x, y = job_common.data(6 * G)  # 6 steps per epoch.
  with strategy.scope():
    model = job_common.model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

  if args.pause:
    print("paused", flush=True)
    time.sleep(args.pause)

  class Slow(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      print(f"step {int(self.model.optimizer.iterations.numpy())}", flush=True)
      time.sleep(args.sleep)

  if args.loop == "fit":
    tfdist.fit(model, x, y, batch_size=G, shuffle=False, epochs=3,
               callbacks=[Slow()], backup_dir=args.dir, backup_every_steps=2,
               verbose=0)
  else:
    model.fit(x, y, batch_size=G, shuffle=False, epochs=3, verbose=0,
              callbacks=[Slow(), tfdist.BackupAndRestore(args.dir,
                                                         save_freq=2)])
  iterations = int(model.optimizer.iterations.numpy())
  start = None
else:
  x, y = job_common.data(512)
  with strategy.scope():
    model = job_common.model()
    optimizer = keras.optimizers.SGD(0.05)
    optimizer.build(model.trainable_variables)
  inner = tfdist.supervised_step(
      model, optimizer, keras.losses.MeanSquaredError(reduction=None),
      global_batch_size=G)
  runner = tfdist.Runner(
      strategy=strategy, train_step=inner,
      train_data=job_common.dataset_fn(x, y),
      checkpoint_items={"model": model, "optimizer": optimizer},
      options=tfdist.RunnerOptions(steps_per_loop=1, checkpoint_dir=args.dir,
                                   checkpoint_every=3, ps_synchronous=True))
  start = runner.step
  while runner.step < args.steps:
    runner.train(runner.step + 1)
    print(f"step {runner.step}", flush=True)
    time.sleep(args.sleep)
  iterations = int(optimizer.iterations.numpy())
print(json.dumps({"weights": job_common.weights(model),
                  "iterations": iterations, "start": start}))
