"""Every backup entry point, stopped and resumed; run on any number of workers.

Usage: resize_job.py ROOT [--stop K] [--stop-epoch E] [--per-replica-steps P]
                       [--ps WORKERS PS] [--only ENTRY ...] [--reference DIR]

One task per worker (TF_CONFIG; none for one process). The entry points run
one after another in this process, each backing up to ROOT/<entry>:

* ``fit_arrays``, ``fit_dataset``: ``tfdist.fit`` on arrays (shuffled with a
  seed) and on a ``tf.data`` dataset of global batches (unshuffled: a
  seeded shuffle under MultiWorkerMirroredStrategy gives another order than
  in one process, so no single-process run could be the reference);
* ``keras_tfdist``: plain ``model.fit`` with ``tfdist.BackupAndRestore``;
* ``keras_own``: plain ``model.fit`` with Keras's own ``BackupAndRestore``,
  which resumes at epoch starts: it stops after epoch E;
* ``runner``: ``tfdist.Runner`` with a ``checkpoint_dir``;
* ``fit_per_replica``: ``tfdist.fit`` on a ``dataset_fn`` of per-replica
  batches of 4, so the global batch is 4 per worker (another global batch
  on another size); it stops after P steps of this run.

With ``--ps`` the chief of a local ParameterServerStrategy cluster runs
``ps_fit`` (``tfdist.fit``), ``ps_runner`` (``Runner``) and
``ps_embedding`` (a ``Runner`` over an embedding table in one shard per ps
task) instead.

The others share global batch 12 and back up every step; they stop once
step K is backed up (a `Stop` raised before step K + 1), or train to the end
without ``--stop``. The last line is JSON: per entry, ``weights`` after each
step this run saw (by the optimizer's iterations, the restored ones first)
and ``start``, the iterations when training began.

With ``--reference DIR`` (one process) the entry points of global batch 12
then run again in this process, uninterrupted, backing up under DIR; their
records are under ``reference`` in the JSON.
"""

import argparse
import functools
import gc
import json
import os

import job_common
import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("root")
parser.add_argument("--stop", type=int, default=None)
parser.add_argument("--stop-epoch", type=int, default=None)
parser.add_argument("--per-replica-steps", type=int, default=None)
parser.add_argument("--only", nargs="*", help="these entry points alone")
parser.add_argument("--reference", default=None, metavar="DIR",
                    help="then an uninterrupted run, backing up under DIR")
parser.add_argument("--ps", nargs=2, type=int, default=None,
                    metavar=("WORKERS", "PS"),
                    help="ParameterServerStrategy on a local cluster")
args = parser.parse_args()

if args.ps:
  os.environ["TF_CONFIG"] = json.dumps(job_common.local_ps_cluster(*args.ps))
  # Variables of 1 KiB and more in a shard per ps task: the embedding table
  # of ps_embedding, not the Keras models (Keras 3 cannot train a
  # ShardedVariable: its gradient asks the variable for a handle).
  strategy = tfdist.make_strategy("parameter_server",
                                  variable_partitioner="min_size",
                                  min_shard_bytes=1024)
else:
  strategy = tfdist.make_strategy("multi_worker_mirrored"
                                  if "TF_CONFIG" in os.environ else "default")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

G, N, EPOCHS = 12, 48, 5  # 4 steps per epoch, 20 in all.
x, y = job_common.data(N)
root = args.root
results = out = {}


class Stop(Exception):
  """Ends an entry point once its backup holds the stop step."""


class Record(keras.callbacks.Callback):
  """Records the weights per step; stops before the step after ``stop``."""

  def __init__(self, entry: str, stop: int | None, relative: bool = False):
    super().__init__()
    self._out = results.setdefault(entry, {"weights": {}, "start": None})
    self._stop, self._relative = stop, relative

  def _step(self) -> int:
    return int(self.model.optimizer.iterations.numpy())

  def on_train_begin(self, logs=None):
    if self._out["start"] is None:
      self._out["start"] = self._step()
    self.on_train_batch_end(None)

  def on_train_batch_begin(self, batch, logs=None):
    done = self._step() - (self._out["start"] if self._relative else 0)
    if self._stop is not None and done >= self._stop:
      raise Stop()

  def on_train_batch_end(self, batch, logs=None):
    self._out["weights"][self._step()] = job_common.weights(self.model)


def model():
  with strategy.scope():
    m = job_common.model()
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  return m


def directory(entry: str) -> str:
  return os.path.join(root, entry)


def fit_arrays(stop):
  tfdist.fit(model(), x, y, batch_size=G, epochs=EPOCHS, seed=1, verbose=0,
             backup_dir=directory("fit_arrays"), backup_every_steps=1,
             callbacks=[Record("fit_arrays", stop)])


def fit_dataset(stop):
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(G)
  tfdist.fit(model(), data, epochs=EPOCHS, verbose=0,
             backup_dir=directory("fit_dataset"), backup_every_steps=1,
             callbacks=[Record("fit_dataset", stop)])


def keras_tfdist(stop):
  model().fit(x, y, batch_size=G, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[tfdist.BackupAndRestore(directory("keras_tfdist"),
                                                 save_freq=1),
                         Record("keras_tfdist", stop)])


def keras_own(stop):
  if stop is not None and args.stop_epoch is not None:
    stop = args.stop_epoch * N // G
  else:
    stop = None
  model().fit(x, y, batch_size=G, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(
                  directory("keras_own")), Record("keras_own", stop)])


def ps_fit(stop):
  tfdist.fit(model(), job_common.dataset_fn(x, y, G), epochs=EPOCHS,
             steps_per_epoch=N // G, verbose=0, backup_dir=directory("ps_fit"),
             backup_every_steps=1, callbacks=[Record("ps_fit", stop)])


def ps_embedding(stop):
  """A Runner over an embedding table in one shard per ps task."""
  ids = tf.range(N) % 512
  with strategy.scope():
    table = tf.Variable(tf.random.stateless_normal((512, 4), [1, 2]))
    out_w = tf.Variable(tf.ones((4, 1)))
  out = results.setdefault("ps_embedding", {"weights": {}, "start": None,
                                            "shards": None})

  def step(batch):
    i, target = batch
    with tf.GradientTape() as tape:
      y = tf.nn.embedding_lookup(table, i) @ out_w
      loss = tf.nn.compute_average_loss(tf.square(y[:, 0] - target[:, 0]),
                                        global_batch_size=G)
    shards = getattr(table, "variables", [table])
    grads = tape.gradient(loss, [*shards, out_w])
    for var, grad in zip([*shards, out_w], grads):
      var.assign_sub(0.05 * tf.convert_to_tensor(grad))
    return {"loss": loss}

  def weights():
    return np.concatenate([tf.convert_to_tensor(table).numpy().ravel(),
                           out_w.numpy().ravel()]).tolist()

  run = tfdist.Runner(
      strategy=strategy, train_step=step,
      train_data=lambda ctx: tf.data.Dataset.from_tensor_slices(
          (ids, y)).repeat().batch(G),
      checkpoint_items={"table": table, "out": out_w},
      options=tfdist.RunnerOptions(checkpoint_dir=directory("ps_embedding"),
                                   checkpoint_every=1, ps_synchronous=True))
  out["start"], out["shards"] = run.step, len(getattr(table, "variables", ()))
  out["weights"][run.step] = weights()
  while run.step < (stop or EPOCHS * N // G):
    run.train(run.step + 1)
    out["weights"][run.step] = weights()
  run.close()


def runner(stop, entry="runner"):
  m = model()
  out = results.setdefault(entry, {"weights": {}, "start": None})
  run = tfdist.Runner(
      strategy=strategy, train_data=job_common.dataset_fn(x, y, G),
      train_step=tfdist.supervised_step(
          m, m.optimizer, keras.losses.MeanSquaredError(reduction=None),
          global_batch_size=G),
      checkpoint_items={"model": m, "optimizer": m.optimizer},
      options=tfdist.RunnerOptions(checkpoint_dir=directory(entry),
                                   checkpoint_every=1, ps_synchronous=True))
  out["start"] = run.step
  out["weights"][run.step] = job_common.weights(m)
  while run.step < (stop or EPOCHS * N // G):
    run.train(run.step + 1)
    out["weights"][run.step] = job_common.weights(m)
  run.close()


def fit_per_replica(stop):
  del stop
  replicas = strategy.num_replicas_in_sync  # One per worker here.

  def dataset_fn(ctx):
    data = tf.data.Dataset.from_tensor_slices((x, y)).shard(
        ctx.num_input_pipelines, ctx.input_pipeline_id)
    return data.repeat().batch(4, drop_remainder=True)
  tfdist.fit(model(), dataset_fn, epochs=2, steps_per_epoch=N // (4 * replicas),
             verbose=0, backup_dir=directory("fit_per_replica"),
             backup_every_steps=1,
             callbacks=[Record("fit_per_replica", args.per_replica_steps,
                               relative=True)])


entries = {"ps_fit": ps_fit, "ps_runner": functools.partial(
    runner, entry="ps_runner"), "ps_embedding": ps_embedding} if args.ps else {
        f.__name__: f for f in (fit_arrays, fit_dataset, keras_tfdist,
                                keras_own, runner, fit_per_replica)}
for name, entry in entries.items():
  if args.only and name not in args.only:
    continue
  try:
    entry(args.stop)
  except Stop:
    pass
  # Each entry's models now: garbage left to pile up over several models
  # costs one generation-2 collection of 10-30 s while the others wait.
  gc.collect()
if args.reference:
  root, results = args.reference, out.setdefault("reference", {})
  for name, entry in entries.items():
    if name != "fit_per_replica":
      entry(None)
      gc.collect()
print(json.dumps(out), flush=True)
