"""Trains the TF multi-worker Keras tutorial model with Keras 3 `model.fit`.

The model is the one of tensorflow.org/tutorials/distribute/multi_worker_with_keras
(28x28 inputs, a small CNN) on synthetic data of the same shapes; the only
change from the tutorial is that tfdist builds the strategy.

Usage: keras_fit.py [--strategy NAME] [--upstream] [--steps_per_execution N]
  [--jit_compile] [--epochs N] [--steps N] [--global_batch B] [--seed S]
  [--write_dir DIR] [--verbose auto|0|1|2] [--evaluate_dir DIR]

``--upstream`` builds the strategy with TensorFlow directly, so Keras runs
without tfdist's corrections. ``--write_dir`` trains with Keras's own writing
callbacks (ModelCheckpoint, BackupAndRestore, TensorBoard, CSVLogger) on paths
under DIR, the same on every worker, as a user would write them;
``--evaluate_dir`` then evaluates with TensorBoard under DIR and predicts,
with Keras's default ``verbose="auto"``. Prints one
JSON line: the weight checksum, the history, or the error fit raised.
"""

import argparse
import json
import os
import sys
import traceback

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="multi_worker_mirrored")
parser.add_argument("--upstream", action="store_true")
parser.add_argument("--fixes", default="",
                    help="with --upstream: comma-separated corrections to apply")
parser.add_argument("--steps_per_execution", type=int, default=1)
parser.add_argument("--jit_compile", action="store_true")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps", type=int, default=4, help="steps per epoch")
parser.add_argument("--global_batch", type=int, default=16)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--write_dir", default=None)
parser.add_argument("--verbose", default="0", help="fit's verbose: auto, 0-2")
parser.add_argument("--evaluate_dir", default=None,
                    help="then model.evaluate with TensorBoard under DIR")
args = parser.parse_args()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

# The strategy comes first: collective ops must be configured at start-up.
if args.upstream:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy = {
      "multi_worker_mirrored": tf.distribute.MultiWorkerMirroredStrategy,
      "default": tf.distribute.get_strategy,
  }[args.strategy]()
  if args.fixes:
    from tfdist._compat import keras as keras_compat  # pylint: disable=g-import-not-at-top
    keras_compat.apply(args.fixes.split(","))
else:
  import tfdist  # pylint: disable=g-import-not-at-top
  strategy = tfdist.make_strategy(args.strategy)

import numpy as np  # pylint: disable=g-import-not-at-top
import keras  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top,reimported
from tfdist._compat import keras as keras_compat  # pylint: disable=g-import-not-at-top


def build_and_compile_cnn_model():
  model = keras.Sequential([
      keras.layers.InputLayer(shape=(28, 28)),
      keras.layers.Reshape(target_shape=(28, 28, 1)),
      keras.layers.Conv2D(32, 3, activation="relu"),
      keras.layers.Flatten(),
      keras.layers.Dense(128, activation="relu"),
      keras.layers.Dense(10),
  ])
  model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=keras.optimizers.SGD(learning_rate=0.001),
      metrics=["accuracy"],
      steps_per_execution=args.steps_per_execution,
      jit_compile=args.jit_compile)
  return model


keras.utils.set_random_seed(args.seed)  # Same initial weights everywhere.
n = args.global_batch * args.steps
rng = np.random.default_rng(args.seed)
x = rng.random((n, 28, 28), dtype=np.float32)
y = rng.integers(0, 10, size=(n,)).astype(np.int64)
# Every worker holds the whole dataset; tf.distribute shards it.
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch)



def writing_callbacks(root):
  return [
      keras.callbacks.ModelCheckpoint(
          os.path.join(root, "ckpt", "epoch-{epoch}.weights.h5"),
          save_weights_only=True),
      keras.callbacks.ModelCheckpoint(os.path.join(root, "best.keras"),
                                      monitor="loss", save_best_only=True),
      keras.callbacks.BackupAndRestore(os.path.join(root, "backup"),
                                       delete_checkpoint=False,
                                       double_checkpoint=True),
      keras.callbacks.TensorBoard(os.path.join(root, "tb")),
      keras.callbacks.CSVLogger(os.path.join(root, "log.csv")),
  ]


result = {"replicas": strategy.num_replicas_in_sync, "pid": os.getpid(),
          "strategy": type(strategy).__name__,
          "applied": list(keras_compat.applied_fixes())}
try:
  with strategy.scope():
    model = build_and_compile_cnn_model()
  callbacks = writing_callbacks(args.write_dir) if args.write_dir else None
  verbose = args.verbose if args.verbose == "auto" else int(args.verbose)
  history = model.fit(dataset, epochs=args.epochs, verbose=verbose,
                      callbacks=callbacks)
  if args.evaluate_dir:  # Keras's defaults: verbose="auto".
    model.evaluate(dataset, callbacks=[keras.callbacks.TensorBoard(
        os.path.join(args.evaluate_dir, "tb"))])
    model.predict(x[:args.global_batch], batch_size=args.global_batch)
  weights = model.get_weights()
  result.update(
      ok=True,
      history={k: [float(v) for v in vs] for k, vs in history.history.items()},
      iterations=int(model.optimizer.iterations.numpy()),
      checksum=float(sum(np.sum(w.astype(np.float64)) for w in weights)),
      abs_checksum=float(sum(np.sum(np.abs(w.astype(np.float64)))
                             for w in weights)),
      jit_compile=bool(model.jit_compile))
except Exception as e:  # pylint: disable=broad-except
  traceback.print_exc()
  result.update(ok=False, error_type=type(e).__name__, error=str(e)[:2000])
print(json.dumps(result), flush=True)
