"""Trains a small deterministic model with tfdist.fit; prints JSON.

Usage: fit_job.py STRATEGY [--input arrays|shuffled|dataset|dataset_fn]
  [--epochs E] [--backup DIR] [--every K] [--die-at STEP] [--devices LIST]
  [--ps-local WORKERS] [--tensorboard DIR] [--checkpoint PATH] [--spe K]
  [--export PATH.keras]

--die-at ends the process abruptly (os._exit(3)) once that many steps are
applied, before the backup callback runs, like a kill between two steps
(every worker of a multi-worker cluster after the same step).
"{task}" in --backup is replaced by this task's index in TF_CONFIG, so
workers can be given different directories.
"""

import argparse
import json
import os
import time

import job_common
import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("strategy")
parser.add_argument("--input", default="arrays")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--backup")
parser.add_argument("--every", type=int)
parser.add_argument("--die-at", type=int)
parser.add_argument("--devices", default="")
parser.add_argument("--ps-local", type=int, default=0)
parser.add_argument("--tensorboard")
parser.add_argument("--checkpoint")
parser.add_argument("--spe", type=int, default=1)
parser.add_argument("--export")
args = parser.parse_args()

cluster = (job_common.local_ps_cluster(args.ps_local)
           if args.ps_local else None)
strategy = tfdist.make_strategy(
    args.strategy, cluster=cluster,
    **job_common.strategy_options(args.strategy, args.devices))

import keras  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

N = 48  # 6 steps per epoch.
x, y = job_common.data(N)
with strategy.scope():
  model = job_common.model()
  model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                metrics=["mae"], steps_per_execution=args.spe)


class DieAt(keras.callbacks.Callback):

  def on_train_batch_end(self, batch, logs=None):
    if args.die_at and int(self.model.optimizer.iterations.numpy()) >= args.die_at:
      if args.strategy == "multi_worker_mirrored":
        # Every worker dies after the same step. A worker that finished the
        # step's collectives may still be sending to one that has not: meet
        # first (bounded), or the slower one fails in the collective instead.
        from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
        context.context().wait_at_barrier("fit_job/die_at", 60_000)
        if task.get("index", 0) == 0:
          # Worker 0 serves the coordination service: leaving at once can
          # cut the others' barrier reply, and they fail (exit 1) instead.
          time.sleep(2)
      os._exit(3)


G = job_common.GLOBAL_BATCH
data = {
    "arrays": dict(x=x, y=y, batch_size=G, shuffle=False),
    "shuffled": dict(x=x, y=y, batch_size=G, shuffle=True),
    "dataset": dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(G)),
    "dataset_fn": dict(x=job_common.dataset_fn(x, y), steps_per_epoch=N // G),
}[args.input]
callbacks = [DieAt()]
if args.checkpoint:
  callbacks.append(keras.callbacks.ModelCheckpoint(args.checkpoint,
                                                   save_weights_only=True))
task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
backup = args.backup.format(task=task.get("index", 0)) if args.backup else None
history = tfdist.fit(model, epochs=args.epochs, callbacks=callbacks,
                     backup_dir=backup, backup_every_steps=args.every,
                     tensorboard_dir=args.tensorboard, verbose=2, **data)
exported = tfdist.save_model(model, args.export) if args.export else None
print(json.dumps({"weights": job_common.weights(model), "exported": exported,
                  "iterations": int(model.optimizer.iterations.numpy()),
                  "epochs": history.epoch,
                  "loss": history.history.get("loss"),
                  "replicas": strategy.num_replicas_in_sync}))
