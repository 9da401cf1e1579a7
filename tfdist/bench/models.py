"""The bench's reference models, data and thread settings.

* ``mlp``: 784-256-256-10, 269,322 parameters. Little compute per byte of
  gradient: the step is communication-bound across workers.
* ``cnn``: three 3x3 convolutions on 32x32x3 images, about 57k parameters and
  ~30 MFLOP per sample: compute-bound.
* ``wide_mlp``: 1024-4096-1024-10, 8,403,978 parameters: 33.6 MB of float32
  gradients a step, for the bench across hosts, where the link is the limit.
* ``deep_mlp``: 2048, eight Dense(2048), 10: 33,591,306 parameters, 134 MB
  of gradients, mostly eight kernels of 16.8 MB that the backward pass makes
  one after another: where buckets crossing during the pass matter most.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

__all__ = ["ModelSpec", "MODELS", "set_threads", "synthetic_dataset",
           "raw_step", "raw_loop", "marked"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
  """A reference model.

  Attributes:
    name: registry name.
    input_shape: one example's shape.
    classes: output classes.
    build: returns a new, uncompiled Keras model.
  """
  name: str
  input_shape: tuple[int, ...]
  classes: int
  build: Callable[[], "object"]


def _dense_stack(inputs: int, hidden: tuple[int, ...], classes: int = 10):
  """``inputs``, ReLU layers of ``hidden`` widths, ``classes`` logits."""
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential(
      [keras.Input((inputs,))]
      + [keras.layers.Dense(w, activation="relu") for w in hidden]
      + [keras.layers.Dense(classes)])


def _cnn():
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential([
      keras.Input((32, 32, 3)),
      keras.layers.Conv2D(32, 3, activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Conv2D(64, 3, activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Conv2D(64, 3, activation="relu"),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(10),
  ])


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(name="mlp", input_shape=(784,), classes=10,
                     build=functools.partial(_dense_stack, 784, (256, 256))),
    "cnn": ModelSpec(name="cnn", input_shape=(32, 32, 3), classes=10,
                     build=_cnn),
    "wide_mlp": ModelSpec(name="wide_mlp", input_shape=(1024,), classes=10,
                          build=functools.partial(_dense_stack, 1024,
                                                  (4096, 1024))),
    "deep_mlp": ModelSpec(name="deep_mlp", input_shape=(2048,), classes=10,
                          build=functools.partial(_dense_stack, 2048,
                                                  (2048,) * 8)),
}


def marked(model):
  """``model`` whose output's gradient notes the backward pass's start
  (`tfdist.strategy.timeline.mark_backward_start`); same variables, same
  order. The note is one Python call a step, also when nothing records."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.strategy import timeline  # pylint: disable=g-import-not-at-top

  @tf.custom_gradient
  def mark(x):
    def gradient(dy):
      marked_dy = tf.numpy_function(timeline.mark_backward_start, [dy],
                                    dy.dtype, stateful=True)
      marked_dy.set_shape(dy.shape)
      return marked_dy
    return tf.identity(x), gradient

  return keras.Sequential([model, keras.layers.Lambda(mark)])


def set_threads(intra: int, inter: int) -> None:
  """Fixes TensorFlow's thread pools; call before any TensorFlow op."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(intra)
  tf.config.threading.set_inter_op_parallelism_threads(inter)


def synthetic_dataset(spec: ModelSpec, batch: int, *, examples: int = 1024,
                      seed: int = 0, autotune: bool = True):
  """An infinite dataset of ``batch``-sized (x, y) batches, the same each run.

  Args:
    spec: the model the data is for.
    batch: examples per batch.
    examples: distinct examples, cycled.
    seed: the data seed.
    autotune: prefetch with ``tf.data.AUTOTUNE``; off gives the plain
      pipeline the bench compares against.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  g = tf.random.Generator.from_seed(seed)
  x = g.normal((examples,) + spec.input_shape)
  y = g.uniform((examples,), maxval=spec.classes, dtype=tf.int32)
  data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
      batch, drop_remainder=True)
  return data.prefetch(tf.data.AUTOTUNE) if autotune else data


def raw_step(model, optimizer, loss_fn, *, global_batch_size: int):
  """The hand-written per-replica step of TensorFlow's custom-loop tutorial.

  The baseline that tfdist's own steps are measured against.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)),
                                        global_batch_size=global_batch_size)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step


def raw_loop(strategy, step, iterator) -> Callable[[int], "object"]:
  """``run(n)``: ``n`` tutorial steps in one `tf.function`, the loss reduced
  each step (as TensorFlow's custom-loop tutorial); returns the mean loss."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @tf.function
  def loop(n):
    total = tf.constant(0.0)
    for _ in tf.range(n):
      total += strategy.reduce(tf.distribute.ReduceOp.SUM,
                               strategy.run(step, args=(next(iterator),)),
                               axis=None)
    return total / tf.cast(n, tf.float32)

  return lambda n: loop(tf.constant(n))
