"""One worker of a cluster: bucketed, overlapped gradients vs collectives.

Usage: overlap_job.py

Each case of `CASES` trains the same model twice under
MultiWorkerMirroredStrategy: with TensorFlow's collectives, and with the
socket ring cutting the gradients into buckets of `BUCKET_BYTES` (every
gradient of the model a bucket of its own). Prints one JSON line: per case,
the largest relative difference of the weights (to each one's largest
value), a digest of the bucketed
run's weights, the ring calls it made and the buckets its gradients make.
"""

import gc
import hashlib
import json
import os
import sys

import numpy as np
import tfdist

strategy = tfdist.make_strategy(  # First TF work.
    "multi_worker_mirrored", timeout_seconds=60)

import keras  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfdist import perf  # pylint: disable=g-import-not-at-top
from tfdist.strategy import transport  # pylint: disable=g-import-not-at-top

GLOBAL_BATCH = 12  # Splits evenly over 2 and 3 workers.
STEPS = 3
BUCKET_BYTES = 64  # Smaller than any gradient below: one bucket each.


def _data(n=GLOBAL_BATCH * STEPS):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 6)).astype("float32")
  return x, (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")


def _model():
  keras.utils.set_random_seed(1)
  return keras.Sequential([
      keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
      keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])


def _embedding_model():
  keras.utils.set_random_seed(3)
  return keras.Sequential([keras.Input((4,), dtype="int32"),
                           keras.layers.Embedding(50, 3),
                           keras.layers.Flatten(), keras.layers.Dense(1)])


def _embedding_data():
  rng = np.random.default_rng(0)
  n = GLOBAL_BATCH * STEPS
  return (rng.integers(0, 50, size=(n, 4)).astype("int32"),
          rng.normal(size=(n, 1)).astype("float32"))


class OwnStep(keras.Sequential):
  """A model whose own ``train_step`` calls ``optimizer.apply``."""

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
    grads = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply(grads, self.trainable_variables)
    return {"loss": loss}


def _own_step_model():
  keras.utils.set_random_seed(1)
  return OwnStep([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                   keras.layers.Dense(1)])


def _compiled(options, *, build=_model, optimizer=None, prepare=None):
  with strategy.scope():
    model = build()
    optimizer = perf.with_gradient_options(
        (optimizer or (lambda: keras.optimizers.SGD(0.05)))(), options)
    model.compile(optimizer=optimizer, loss="mse")
  if prepare is not None:
    prepare(model)
  return model


def _keras_fit(options, data=_data, **kwargs):
  model = _compiled(options, **kwargs)
  x, y = data()
  model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
  return model


def _tfdist_fit(options):
  model = _compiled(options)
  x, y = _data()
  tfdist.fit(model, x=x, y=y, batch_size=GLOBAL_BATCH, epochs=1,
             shuffle=False, verbose=0)
  return model


def _dataset_fn():
  x, y = _data()

  def fn(ctx):
    per_replica = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).unbatch().shard(
        ctx.num_input_pipelines, ctx.input_pipeline_id).batch(per_replica)
  return fn


def _runner(options):
  model = _compiled(options)
  with strategy.scope():
    model.optimizer.build(model.trainable_variables)
  step = tfdist.supervised_step(
      model, model.optimizer, keras.losses.MeanSquaredError(reduction=None),
      global_batch_size=GLOBAL_BATCH)
  tfdist.Runner(strategy=strategy, train_step=step,
                train_data=_dataset_fn()).train(STEPS)
  return model


def _apply_loop(options):
  """A custom loop: ``strategy.run`` of a step calling ``optimizer.apply``."""
  model = _compiled(options)
  optimizer = model.optimizer
  with strategy.scope():
    optimizer.build(model.trainable_variables)
  data = iter(strategy.distribute_datasets_from_function(_dataset_fn()))

  @tf.function
  def step(batch):
    def fn(x, y):
      with tf.GradientTape() as tape:
        per_example = tf.square(model(x, training=True) - y)
        loss = tf.reduce_sum(per_example) / GLOBAL_BATCH
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply(grads, model.trainable_variables)
    strategy.run(fn, args=batch)

  for _ in range(STEPS):
    step(next(data))
  return model


def _small_targets():
  x, y = _data()
  return x, y / 100


def _mixed_precision(options):
  """``fit`` under ``mixed_float16``: Keras wraps the optimizer in a
  LossScaleOptimizer, whose inner optimizer sums the gradients. The targets
  are small enough that no step overflows at the first loss scale (2**15):
  every step crosses."""
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    return _keras_fit(options, data=_small_targets)
  finally:
    keras.mixed_precision.set_global_policy("float32")


#: case -> (train(options) -> model, the reference's GradientOptions).
CASES = {
    "keras_fit": (_keras_fit, {}),
    "tfdist_fit": (_tfdist_fit, {}),
    "runner": (_runner, {}),
    "apply_loop": (_apply_loop, {}),
    "own_train_step": (lambda o: _keras_fit(o, build=_own_step_model), {}),
    # The ring sums 16-bit values in float32 where TensorFlow's collectives
    # add them in 16 bits: the reference is the ring in one bucket (equal to
    # the wire's precision: which worker rounds which sum to 16 bits
    # depends on where the ring cuts its buffer).
    "bf16": (_keras_fit, {"transport": "socket", "compression": "bf16",
                          "bucket_bytes": 0}),
    "fp16": (_keras_fit, {"transport": "socket", "compression": "fp16",
                          "bucket_bytes": 0}),
    "accumulation": (lambda o: _keras_fit(
        o, prepare=lambda m: perf.with_accumulation(m, 2)), {}),
    "clipnorm": (lambda o: _keras_fit(
        o, optimizer=lambda: keras.optimizers.SGD(0.05, clipnorm=0.05)), {}),
    "global_clipnorm": (lambda o: _keras_fit(
        o, optimizer=lambda: keras.optimizers.SGD(
            0.05, global_clipnorm=0.05)), {}),
    "sparse": (lambda o: _keras_fit(o, build=_embedding_model,
                                    data=_embedding_data), {}),
    "mixed_precision": (_mixed_precision, {}),
}


def _calls():
  return sum(r.calls for r in transport.rings_of(strategy))


def main():
  out = {}
  for name in sys.argv[1:] or CASES:
    train, reference = CASES[name]
    compression = reference.get("compression", "none")
    expected = train(perf.GradientOptions(
        **{"transport": "collective", **reference}))
    before = _calls()
    bucketed = train(perf.GradientOptions(
        transport="socket", compression=compression,
        bucket_bytes=BUCKET_BYTES))
    calls = _calls() - before
    shapes = [tf.zeros(v.shape) for v in bucketed.trainable_variables]
    # Each weight's largest difference relative to its largest value.
    diffs = [float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
             for a, b in zip(bucketed.get_weights(), expected.get_weights())]
    digest = hashlib.sha256(b"".join(
        np.asarray(w).tobytes() for w in bucketed.get_weights())).hexdigest()
    out[name] = {"max_rel_diff": max(diffs), "ring_calls": calls,
                 "weights_digest": digest,
                 "buckets": len(transport.buckets(shapes, BUCKET_BYTES))}
    # Each case's models and traced functions are collected now. Left to
    # pile up over 8 cases, one generation-2 collection took 10-30 s (47318
    # objects) while the other workers waited in a collective; after each
    # case it takes 0.2 s.
    gc.collect()
  print(json.dumps(out), flush=True)
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  main()
