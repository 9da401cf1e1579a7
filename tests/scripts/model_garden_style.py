"""A training script in the shape of TensorFlow Model Garden's, on tfdist.

Only the imports differ from Model Garden (official/utils/flags,
official/common/distribute_utils): tfdist.flags defines the same flags
(--distribution_strategy, --num_gpus, --all_reduce_alg, --num_packs, --tpu,
--tpu_zone, --tpu_project, --dtype, --loss_scale) and tfdist.recipes the
training ones (--batch_size, --train_epochs). Prints one JSON line.
"""

import json

from absl import flags
import numpy as np

import tfdist.flags as flags_core  # Model Garden: official.utils.flags.core
from tfdist import recipes

FLAGS = flags.FLAGS


def define_flags():
  flags_core.define_flags()
  recipes.define_example_flags()


def main(_):
  strategy = flags_core.strategy_from_flags()  # distribute_utils.get_...()
  flags_core.apply_mixed_precision()
  options = flags_core.training_options()
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                              keras.layers.Dense(2)])
    model.compile(
        optimizer=options.loss_scale_optimizer(keras.optimizers.SGD(0.01)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype("float32")
  y = rng.integers(0, 2, size=(64,))
  history = model.fit(x, y, batch_size=FLAGS.global_batch_size,
                      epochs=FLAGS.epochs, verbose=0)
  print(json.dumps({
      "mirrored": isinstance(strategy, tf.distribute.MirroredStrategy),
      "policy": keras.mixed_precision.global_policy().name,
      "epochs": len(history.history["loss"]),
      "batch_size": FLAGS.global_batch_size,
      "optimizer": type(model.optimizer).__name__}), flush=True)


if __name__ == "__main__":
  define_flags()
  flags_core.run(main)
