"""Mixed precision under MultiWorkerMirroredStrategy, one worker overflowing.

Usage: mixed_precision_job.py [--upstream]

Trains a small model with the ``mixed_float16`` policy and Keras's
LossScaleOptimizer in a custom loop (``optimizer.apply``), once with
TensorFlow's collectives and once with the socket ring. Worker 1's inputs are
large enough that its scaled float16 gradients overflow at the first steps;
worker 0's are not. Prints ``step K`` after each step, then one JSON line:
per transport, the weights, the loss scale, the steps applied and the
socket ring's calls.
``--upstream`` builds the strategy with TensorFlow directly, with none of
tfdist's corrections, and trains with the collectives only.
"""

import argparse
import json

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--upstream", action="store_true")
args = parser.parse_args()

import keras  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

if args.upstream:
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
  import tfdist  # pylint: disable=g-import-not-at-top
  strategy = tfdist.make_strategy("multi_worker_mirrored",
                                  timeout_seconds=60)

STEPS = 6
PER_WORKER = 4


def _dataset_fn(ctx):
  big = 10.0 if ctx.input_pipeline_id == 1 else 1.0
  rng = np.random.default_rng(ctx.input_pipeline_id)
  x = (big * rng.uniform(0.5, 1.0, size=(STEPS * PER_WORKER, 4))).astype(
      "float32")
  y = np.zeros((STEPS * PER_WORKER, 1), "float32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(PER_WORKER)


def train(transport):
  keras.mixed_precision.set_global_policy("mixed_float16")
  with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                              keras.layers.Dense(1, dtype="float32")])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-6))
    if transport:
      from tfdist import perf  # pylint: disable=g-import-not-at-top
      optimizer = perf.with_gradient_options(
          optimizer, perf.GradientOptions(transport=transport))
    optimizer.build(model.trainable_variables)
  data = iter(strategy.distribute_datasets_from_function(_dataset_fn))

  @tf.function
  def step(batch):
    def one(x, y):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / (
            2 * PER_WORKER)
        scaled = optimizer.scale_loss(loss)
      grads = tape.gradient(scaled, model.trainable_variables)
      optimizer.apply(grads, model.trainable_variables)
    strategy.run(one, args=batch)

  calls = _ring_calls()
  for k in range(STEPS):
    step(next(data))
    print(f"step {k + 1}", flush=True)
  return {"weights": [w.tolist() for w in model.get_weights()],
          "scale": float(optimizer.dynamic_scale.numpy()),
          "applied": int(optimizer.inner_optimizer.iterations.numpy()),
          "ring_calls": _ring_calls() - calls}


def _ring_calls():
  if args.upstream:
    return 0
  from tfdist.strategy import transport  # pylint: disable=g-import-not-at-top
  return sum(r.calls for r in transport.rings_of(strategy))


print(json.dumps({t or "upstream": train(t) for t in (
    [None] if args.upstream else ["collective", "socket"])}))
