"""The in-process half of the bench: tfdist's overhead and the Keras options.

Run by `tfdist.bench.overhead` in a fresh process:

  python -m tfdist.bench.overhead_worker --spec '{...}'

The CPU is split into 2 logical devices; each case pairs a tfdist path
(``fit``: `tfdist.fit`; ``keras_fit``: ``model.fit`` under tfdist's
strategy; ``runner``: `tfdist.Runner`) with hand-written code under a
hand-built ``tf.distribute.MirroredStrategy``, and each option a variant
with its baseline (``steps_per_execution``, ``xla``, ``autotune``,
``flight_recorder``), in alternating windows. Prints one JSON line: every
window's seconds (`tfdist.bench.overhead` makes the figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any, Callable

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
  """Parses ``--spec``, runs every case, prints the JSON line."""
  parser = argparse.ArgumentParser(prog="tfdist.bench.overhead_worker")
  parser.add_argument("--spec", required=True, help="the plan, as JSON")
  spec = json.loads(parser.parse_args(argv).spec)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
  import tfdist  # pylint: disable=g-import-not-at-top
  devices = ["/cpu:0", "/cpu:1"]
  ours = tfdist.make_strategy("mirrored", devices=devices)
  raw = tf.distribute.MirroredStrategy(devices)
  cases = _overhead_cases(spec, ours, raw)
  out = {"overhead": _compare(cases, spec),
         "options": _compare(_option_cases(spec, ours), spec)}
  print(json.dumps(out), flush=True)
  return 0


Pair = tuple[Callable[[int], Any], Callable[[int], Any]]


def _compare(cases: dict[str, Pair], spec: dict) -> dict:
  """Alternating timing windows of (variant, baseline): every window's
  seconds, ``{name: {"variant_s": [...], "baseline_s": [...]}}``."""
  steps = spec["steps"]
  for variant, baseline in cases.values():  # Trace and warm up first.
    variant(spec["warmup_steps"])
    baseline(spec["warmup_steps"])
  # The builds' garbage, collected before the timed windows (as in
  # cluster_worker): one collection of it took 6.6 s.
  gc.collect()
  times = {k: {"variant_s": [], "baseline_s": []} for k in cases}
  for r in range(spec["rounds"]):
    for name, fns in cases.items():
      order = (0, 1) if r % 2 == 0 else (1, 0)
      for i in order:
        start = time.perf_counter()
        fns[i](steps)
        times[name][("variant_s", "baseline_s")[i]].append(
            time.perf_counter() - start)
  return times


def _model(strategy, spec: dict, *, name: str = "mlp", jit: Any = "auto",
           steps_per_execution: int = 1):
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = models.MODELS[name].build()
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  jit_compile=jit, steps_per_execution=steps_per_execution)
    # Variables created inside a tf.range loop under Mirrored fail to
    # initialize ("You must feed a value for placeholder"): build them first.
    model.optimizer.build(model.trainable_variables)
  return model


def _data(spec: dict, name: str = "mlp", autotune: bool = True):
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  return models.synthetic_dataset(models.MODELS[name], spec["batch"],
                                  autotune=autotune)


def _keras_fit(model, data) -> Callable[[int], Any]:
  return lambda n: model.fit(data, epochs=1, steps_per_epoch=n, verbose=0)


def _overhead_cases(spec: dict, ours, raw) -> dict[str, Pair]:
  import keras  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  data = _data(spec)
  fit_model = _model(ours, spec)
  cases = {
      "fit": (lambda n: tfdist.fit(fit_model, data, steps_per_epoch=n,
                                   verbose=0),
              _keras_fit(_model(raw, spec), data)),
      "keras_fit": (_keras_fit(_model(ours, spec), data),
                    _keras_fit(_model(raw, spec), data)),
  }
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=None)
  per_replica = spec["batch"] // 2

  def dataset_fn(ctx):
    del ctx
    return _data({"batch": per_replica})

  def bare(strategy):
    model = _model(strategy, spec)
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    run = models.raw_loop(strategy, models.raw_step(
        model, model.optimizer, loss_fn, global_batch_size=spec["batch"]),
                          iterator)
    return lambda n: float(run(n))

  model = _model(ours, spec)
  runner = tfdist.Runner(
      strategy=ours, train_data=dataset_fn,
      train_step=tfdist.supervised_step(model, model.optimizer, loss_fn,
                                        global_batch_size=spec["batch"]),
      options=tfdist.RunnerOptions(steps_per_loop=spec["steps"]))
  cases["runner"] = (lambda n: runner.train(runner.step + n), bare(raw))
  return cases


def _option_cases(spec: dict, ours) -> dict[str, Pair]:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  data = _data(spec)

  def tfdist_fit(model, dataset):
    return lambda n: tfdist.fit(model, dataset, steps_per_epoch=n, verbose=0)

  default = tf.distribute.get_strategy()
  cnn = {"batch": spec["cnn_batch"]}

  def autotune():
    slow = _data(cnn, "cnn", autotune=False).map(_augment)
    fast = _data(cnn, "cnn", autotune=False).map(
        _augment, num_parallel_calls=tf.data.AUTOTUNE).prefetch(
            tf.data.AUTOTUNE)
    return (tfdist_fit(_model(ours, spec, name="cnn"), fast),
            tfdist_fit(_model(ours, spec, name="cnn"), slow))

  def flight_recorder():
    from tfdist import _flight  # pylint: disable=g-import-not-at-top
    model = _model(ours, spec)

    def fit(on):
      def run(n):
        _flight.set_recording(on)
        try:
          return model.fit(data, epochs=1, steps_per_epoch=n, verbose=0)
        finally:
          _flight.set_recording(True)
      return run
    return fit(True), fit(False)

  builders = {  # Built only when timed.
      "steps_per_execution": lambda: (
          tfdist_fit(_model(ours, spec, steps_per_execution=8), data),
          tfdist_fit(_model(ours, spec), data)),
      "xla_cnn": lambda: (
          _keras_fit(_model(default, spec, name="cnn", jit=True),
                     _data(cnn, "cnn")),
          _keras_fit(_model(default, spec, name="cnn", jit=False),
                     _data(cnn, "cnn"))),
      "autotune": autotune,
      "flight_recorder": flight_recorder,
  }
  if spec.get("quick"):  # CI checks the bench runs: one option.
    builders = {"flight_recorder": flight_recorder}
  return {name: build() for name, build in builders.items()}


def _augment(x, y):
  """Per-batch input work of the kind a real pipeline does."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x = tf.image.random_flip_left_right(x)
  x = tf.image.per_image_standardization(x)
  return x, y


if __name__ == "__main__":
  raise SystemExit(main())
