"""Ready-made digit-classifier training: what the examples in examples/ run.

The examples are short absl scripts; the logic lives here so it is tested.
One recipe trains TensorFlow's multi-worker tutorial model (a small CNN on
28x28x1 images) on a TFDS dataset:

* ``tfdist_digits`` (the default) is built locally by a TFDS builder, so it
  works offline on a fresh machine;
* ``mnist`` and other TFDS image datasets with 28x28x1 images use TFDS's real
  data where present in ``--data_dir`` or downloadable.

The same script runs on a laptop, under ``tfdist launch``, under ``srun`` and
on a TPU VM: the strategy comes from ``--strategy`` (``auto`` by default).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from absl import flags
from absl import logging

__all__ = ["ExampleConfig", "define_example_flags", "example_config",
           "quiet_logs", "build_model", "dataset_fn", "train_with_fit",
           "train_with_custom_loop"]

_FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExampleConfig:
  """What the example scripts train.

  Attributes:
    dataset: a TFDS name; ``tfdist_digits`` builds offline.
    data_dir: the TFDS data directory (TFDS's default when ``None``).
    epochs: training epochs.
    steps_per_epoch: steps per epoch; a full pass over the split if ``None``.
    global_batch_size: the batch over all replicas.
    learning_rate: SGD's learning rate.
    model_dir: where the chief writes backups and TensorBoard logs.
    eval_steps: evaluation steps at the end; a full pass if ``None``.
  """
  dataset: str = "tfdist_digits"
  data_dir: str | None = None
  epochs: int = 3
  steps_per_epoch: int | None = None
  global_batch_size: int = 64
  learning_rate: float = 0.05
  model_dir: str | None = None
  eval_steps: int | None = None


def define_example_flags(flag_values: flags.FlagValues = _FLAGS) -> None:
  """Defines the examples' data and training flags."""
  d = ExampleConfig()
  flags.DEFINE_string("dataset", d.dataset, "TFDS dataset of 28x28x1 images; "
                      "tfdist_digits builds offline", flag_values=flag_values)
  flags.DEFINE_string("data_dir", d.data_dir, "TFDS data directory",
                      flag_values=flag_values)
  flags.DEFINE_integer("epochs", d.epochs, "training epochs", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_integer("steps_per_epoch", None, "steps per epoch (default: a "
                       "full pass)", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("global_batch_size", d.global_batch_size,
                       "batch size over all replicas", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_float("learning_rate", d.learning_rate, "SGD learning rate",
                     lower_bound=0.0, flag_values=flag_values)
  flags.DEFINE_string("model_dir", None, "backups and TensorBoard logs "
                      "(written by the chief)", flag_values=flag_values)
  flags.DEFINE_integer("eval_steps", None, "evaluation steps (default: a "
                       "full pass)", lower_bound=1, flag_values=flag_values)
  # Model Garden's names for the same flags.
  flags.DEFINE_alias("batch_size", "global_batch_size",
                     flag_values=flag_values)
  flags.DEFINE_alias("train_epochs", "epochs", flag_values=flag_values)


def example_config(flag_values: flags.FlagValues = _FLAGS) -> ExampleConfig:
  """The `ExampleConfig` the flags describe."""
  return ExampleConfig(**{f.name: flag_values[f.name].value
                          for f in dataclasses.fields(ExampleConfig)})


def build_model(num_classes: int = 10):
  """TensorFlow's multi-worker tutorial CNN."""
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential([
      keras.Input((28, 28, 1)),
      keras.layers.Rescaling(1 / 255.0),
      keras.layers.Conv2D(32, 3, activation="relu"),
      keras.layers.Flatten(),
      keras.layers.Dense(128, activation="relu"),
      keras.layers.Dense(num_classes),
  ])


def _split_size(config: ExampleConfig, split: str) -> int:
  from tfdist import data  # pylint: disable=g-import-not-at-top
  builder = data.tfds_builder(config.dataset, data_dir=config.data_dir)
  return builder.info.splits[split].num_examples


def dataset_fn(config: ExampleConfig, split: str, *, repeat: bool):
  """Per-replica batches of ``split`` for ``distribute_datasets_from_function``."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import data  # pylint: disable=g-import-not-at-top

  def to_float(image, label):
    return tf.cast(image, tf.float32), label
  return data.tfds_dataset_fn(
      config.dataset, split=split, global_batch_size=config.global_batch_size,
      data_dir=config.data_dir, map_fn=to_float,
      shuffle_buffer_size=1024 if split == "train" else 0, seed=0,
      repeat=repeat, drop_remainder=True)


def _steps(config: ExampleConfig) -> tuple[int, int]:
  from tfdist import data  # pylint: disable=g-import-not-at-top
  data.tfds_builder(config.dataset, data_dir=config.data_dir)  # Builds once.
  train = config.steps_per_epoch or max(
      1, _split_size(config, "train") // config.global_batch_size)
  test = config.eval_steps or max(
      1, _split_size(config, "test") // config.global_batch_size)
  return train, test


def quiet_logs(flag_values: flags.FlagValues = _FLAGS) -> None:
  """Shows warnings and errors only, unless ``--verbosity`` was given."""
  if "verbosity" not in flag_values or not flag_values["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def train_with_fit(strategy, config: ExampleConfig, *,
                   compile_kwargs: dict[str, Any] | None = None
                   ) -> dict[str, float]:
  """Trains with `tfdist.fit`; returns the final validation metrics."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top

  train_steps, eval_steps = _steps(config)
  with strategy.scope():
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.SGD(config.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], **(compile_kwargs or {}))
  validation = dataset_fn(config, "test", repeat=True)
  if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    validation = strategy.distribute_datasets_from_function(validation)
  history = tfdist.fit(
      model, dataset_fn(config, "train", repeat=True), epochs=config.epochs,
      steps_per_epoch=train_steps, validation_data=validation,
      validation_steps=eval_steps, verbose=1,
      backup_dir=_in(config.model_dir, "backup"),
      tensorboard_dir=_in(config.model_dir, "tensorboard"))
  final = {k: float(v[-1]) for k, v in history.history.items()}
  _report(strategy, final)
  return final


def train_with_custom_loop(strategy, config: ExampleConfig) -> dict[str, float]:
  """Trains with `tfdist.Runner`; returns the final evaluation metrics."""
  import keras  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top

  train_steps, eval_steps = _steps(config)
  with strategy.scope():
    model = build_model()
    optimizer = keras.optimizers.SGD(config.learning_rate)
    optimizer.build(model.trainable_variables)
    accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=None)

  def eval_step(batch):
    images, labels = batch
    logits = model(images, training=False)
    accuracy.update_state(labels, logits)
    return {"loss": tfdist.scaled_loss(loss_fn(labels, logits),
                                       config.global_batch_size)}

  runner = tfdist.Runner(
      strategy=strategy,
      train_step=tfdist.supervised_step(
          model, optimizer, loss_fn, global_batch_size=config.global_batch_size,
          metrics=[accuracy]),
      train_data=dataset_fn(config, "train", repeat=True),
      eval_step=eval_step, eval_data=dataset_fn(config, "test", repeat=True),
      checkpoint_items={"model": model, "optimizer": optimizer},
      metrics=[accuracy],
      options=tfdist.RunnerOptions(
          steps_per_loop=min(train_steps, 20),
          checkpoint_dir=_in(config.model_dir, "checkpoints"),
          checkpoint_every=train_steps,
          summary_dir=_in(config.model_dir, "tensorboard")))
  for epoch in range(runner.step // train_steps, config.epochs):
    logs = runner.train((epoch + 1) * train_steps)
    if tfdist.is_chief(strategy):
      print(f"epoch {epoch + 1}/{config.epochs}: " + _format(logs), flush=True)
  final = {f"val_{k}": v for k, v in runner.evaluate(eval_steps).items()}
  _report(strategy, final)
  return final


def _in(model_dir: str | None, name: str) -> str | None:
  return os.path.join(model_dir, name) if model_dir else None


def _format(logs: dict[str, float]) -> str:
  return " - ".join(f"{k}: {v:.4f}" for k, v in sorted(logs.items()))


def _report(strategy, metrics: dict[str, float]) -> None:
  import tfdist  # pylint: disable=g-import-not-at-top
  if tfdist.is_chief(strategy):
    print("final metrics: " + _format(metrics), flush=True)
  logging.info("final metrics: %s", metrics)
