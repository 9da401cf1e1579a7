"""A worker that trains a few steps and reports start-up time and peak RSS.

  python -m tfdist.bench.startup_worker --mode {raw,tfdist} --steps N \
      [--model NAME]

``raw`` is a bare TensorFlow script: MultiWorkerMirroredStrategy built by hand
and a hand-written step. ``tfdist`` builds the strategy with
`tfdist.make_strategy` and trains with `tfdist.Runner`. Both train the same
bench model (`tfdist.bench.models.MODELS`, ``mlp`` unless ``--model``) on the
same data. Prints one JSON line: ``first_step_unix`` (wall clock
when the first step returned) and ``peak_rss_bytes`` after ``N`` steps.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
  """Trains and prints the JSON line."""
  parser = argparse.ArgumentParser(prog="tfdist.bench.startup_worker")
  parser.add_argument("--mode", choices=("raw", "tfdist"), required=True)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--model", default="mlp")
  args = parser.parse_args(argv)
  first = (_tfdist if args.mode == "tfdist" else _raw)(args.steps, args.model)
  print(json.dumps({
      "mode": args.mode, "first_step_unix": first,
      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                        * 1024}), flush=True)
  return 0


def _sgd_model(strategy, spec):
  """``spec``'s model and SGD built under ``strategy``, and the loss."""
  import keras  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    model = spec.build()
    optimizer = keras.optimizers.SGD(0.01)
  return model, optimizer, keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)


def _raw(steps: int, model_name: str) -> float:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  spec = models.MODELS[model_name]
  model, optimizer, loss_fn = _sgd_model(strategy, spec)
  batch = 32 * strategy.num_replicas_in_sync
  iterator = iter(strategy.distribute_datasets_from_function(
      lambda ctx: models.synthetic_dataset(spec, 32, examples=256)))

  step = models.raw_step(model, optimizer, loss_fn, global_batch_size=batch)

  @tf.function
  def train_step():
    return strategy.reduce(tf.distribute.ReduceOp.SUM,
                           strategy.run(step, args=(next(iterator),)),
                           axis=None)

  float(train_step())
  first = time.time()
  for _ in range(steps - 1):
    train_step()
  return first


def _tfdist(steps: int, model_name: str) -> float:
  import tfdist  # pylint: disable=g-import-not-at-top
  strategy = tfdist.make_strategy()
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  spec = models.MODELS[model_name]
  model, optimizer, loss_fn = _sgd_model(strategy, spec)
  runner = tfdist.Runner(
      strategy=strategy,
      train_step=tfdist.supervised_step(
          model, optimizer, loss_fn,
          global_batch_size=32 * strategy.num_replicas_in_sync),
      train_data=lambda ctx: models.synthetic_dataset(spec, 32, examples=256))
  runner.train(1)
  first = time.time()
  runner.train(steps)
  return first


if __name__ == "__main__":
  raise SystemExit(main())
