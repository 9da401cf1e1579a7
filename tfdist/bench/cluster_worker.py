"""One worker of a bench cluster: training throughput and all-reduce sweeps.

Run by `tfdist.bench.scaling` with TF_CONFIG set, one process per worker:

  python -m tfdist.bench.cluster_worker --spec '{"variants": [...], ...}'

Every worker runs the same plan; the collectives keep them in step. Worker 0
prints one JSON line ``{"train": {...}, "allreduce": {...}}``; every worker
prints ``{"worker": i, "cores": [...]}``, the cores it ran on, and with
``alone_steps`` its single ``alone`` steps' seconds. The variants (``raw``,
``tfdist``, ``alone``), core pinning and the timeline are described in
docs/benchmarks.md ("Method"). The strategy is built once (a process joins
one cluster) with ``transport="collective"``: exactly
``tf.distribute.MultiWorkerMirroredStrategy`` as ``raw`` measures it;
options that differ are given per optimizer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

__all__ = ["main", "train_variants"]


def main(argv: list[str] | None = None) -> int:
  """Parses ``--spec`` and runs the plan; returns the exit code."""
  parser = argparse.ArgumentParser(prog="tfdist.bench.cluster_worker")
  parser.add_argument("--spec", required=True, help="the plan, as JSON")
  spec = json.loads(parser.parse_args(argv).spec)
  allowed = sorted(os.sched_getaffinity(0))
  cores = ([allowed[_task_index() % len(allowed)]] if spec.get("pin_cores")
           else allowed)
  print(json.dumps({"worker": _task_index(), "cores": cores}), flush=True)
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  models.set_threads(spec["intra_threads"], spec["inter_threads"])
  import tfdist  # pylint: disable=g-import-not-at-top
  strategy = tfdist.make_strategy("multi_worker_mirrored",
                                  transport="collective")
  out: dict[str, Any] = {"workers": strategy.num_replicas_in_sync}
  out["train"] = train_variants(strategy, spec, cores)
  if spec.get("alone_steps"):
    steps_s = out["train"].pop("alone_steps_s")
    print(json.dumps({"worker": _task_index(), "alone_steps_s": steps_s,
                      "gradients_allreduce_s": _gradients_allreduce_s(
                          strategy, list(steps_s))}), flush=True)
  if spec.get("allreduce_mb") and strategy.num_replicas_in_sync > 1:
    from tfdist.bench import allreduce  # pylint: disable=g-import-not-at-top
    # Every method moves bytes between the workers, whose threads (gRPC's,
    # TensorFlow's) do best where the OS puts them: unpinned, as the
    # loopback stream it is compared with.
    _set_affinity(allowed)
    out["allreduce"] = allreduce.sweep(
        strategy, sizes_mb=spec["allreduce_mb"],
        methods=spec["allreduce_methods"],
        iterations=spec["allreduce_iterations"])
  if tfdist.is_chief(strategy) or _task_index() == 0:
    print(json.dumps(out), flush=True)
  return 0


def _gradients_allreduce_s(strategy, names: list[str]) -> dict[str, float]:
  """Seconds of one all-reduce of each model's gradients, by the
  recommended transport (`tfdist.bench.scaling.RECOMMENDED`)."""
  from tfdist.bench import allreduce  # pylint: disable=g-import-not-at-top
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  from tfdist.bench import scaling  # pylint: disable=g-import-not-at-top
  method = allreduce.method_name(scaling.RECOMMENDED["transport"],
                                 scaling.RECOMMENDED["compression"])
  return {name: allreduce.time_shapes(
      strategy,
      [v.shape for v in models.MODELS[name].build().trainable_weights],
      method=method, iterations=5) for name in names}


def _set_affinity(cores: list[int]) -> None:
  """Binds every thread of this process to ``cores``.

  Threads started later inherit the binding from the thread starting them.
  """
  for tid in os.listdir("/proc/self/task"):
    try:
      os.sched_setaffinity(int(tid), cores)
    except OSError:  # A thread that ended meanwhile.
      pass


def _task_index() -> int:
  return int(json.loads(os.environ.get("TF_CONFIG", "{}"))
             .get("task", {}).get("index", 0))


def train_variants(strategy, spec: dict, cores: list[int]) -> dict:
  """samples/s of every (model, variant), windows interleaved over rounds.

  Building and warming up use every core; the timed windows run on
  ``cores``. Each variant's ``machine_busy`` and ``softirq_share``
  (`tfdist.bench.allreduce.busy_share`) are this machine's over its windows.
  """
  loops = {}
  for name, variants in spec["models"].items():
    for variant in variants:
      loops[(name, variant["name"])] = _make_loop(strategy, name, variant, spec)
  for loop in loops.values():  # Compile and warm up before any timing.
    loop(spec["warmup_steps"])
  # The builds' garbage, collected before the timed windows: a
  # generation-2 collection of it blocked for 1-10 s (almost none of it
  # CPU), which inside a window would count as training time.
  gc.collect()
  _set_affinity(cores)
  from tfdist.bench import allreduce  # pylint: disable=g-import-not-at-top
  times: dict[tuple[str, str], list[float]] = {k: [] for k in loops}
  ticks: dict[tuple[str, str], list] = {k: [] for k in loops}
  keys = list(loops)
  for r in range(spec["rounds"]):
    order = keys if r % 2 == 0 else keys[::-1]
    for key in order:
      before, start = allreduce.processor_ticks(), time.perf_counter()
      loops[key](spec["steps"])
      times[key].append(time.perf_counter() - start)
      ticks[key].append((before, allreduce.processor_ticks()))
  result: dict[str, dict] = {}
  timelines = {}
  if spec.get("timeline_steps"):
    from tfdist.strategy import timeline  # pylint: disable=g-import-not-at-top
    for (name, variant), loop in loops.items():
      if variant == "tfdist":
        with timeline.recording() as notes:
          loop(spec["timeline_steps"])
        timelines[(name, variant)] = timeline.steps(notes)
  if spec.get("alone_steps"):
    result["alone_steps_s"] = {
        name: _one_by_one(loop, spec["alone_steps"])
        for (name, variant), loop in loops.items() if variant == "alone"}
  for (name, variant), ts in times.items():
    per_step = statistics.median(ts) / spec["steps"]
    k = next(v.get("accumulation_steps", 1) for v in spec["models"][name]
             if v["name"] == variant)
    global_batch = spec["batch"][name] * k * strategy.num_replicas_in_sync
    result.setdefault(name, {})[variant] = {
        "samples_per_s": global_batch / per_step,
        "windows_s": ts,
        **allreduce.busy_share(ticks[(name, variant)]),
    }
    if (name, variant) in timelines:
      result[name][variant]["timeline"] = timelines[(name, variant)]
  return result


def _one_by_one(loop, steps: int) -> list[float]:
  """Seconds of each of ``steps`` calls of ``loop(1)``."""
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    loop(1)
    times.append(time.perf_counter() - start)
  return times


def _make_loop(strategy, name: str, variant: dict, spec: dict):
  """A function ``run(n)`` that trains ``n`` steps of one variant."""
  import keras  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  from tfdist import perf  # pylint: disable=g-import-not-at-top
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  model_spec = models.MODELS[name]
  if variant["name"] == "alone":
    return _alone_loop(model_spec, spec["batch"][name],
                       marked=bool(spec.get("timeline_steps")))
  k = variant.get("accumulation_steps", 1)
  per_replica = spec["batch"][name] * k  # Samples per update on a replica.
  global_batch = per_replica * strategy.num_replicas_in_sync
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = model_spec.build()
    if spec.get("timeline_steps"):  # Every variant runs the marker.
      model = models.marked(model)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    options = {key: v for key, v in variant.items()
               if key not in ("name", "accumulation_steps", "loss_each_step")}
    loss_metric = keras.metrics.Mean("loss")
    if variant["name"] != "raw":
      optimizer = perf.with_gradient_options(
          optimizer, perf.GradientOptions(**options))
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)

  def dataset_fn(ctx):
    return models.synthetic_dataset(model_spec, per_replica,
                                    seed=ctx.input_pipeline_id)

  if variant["name"] == "raw":
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    return models.raw_loop(strategy, models.raw_step(
        model, optimizer, loss_fn, global_batch_size=global_batch), iterator)
  train_step = perf.accumulating_step(
      model, optimizer, loss_fn, global_batch_size=global_batch,
      accumulation_steps=k)
  metrics = []
  if not variant.get("loss_each_step"):
    replicas = strategy.num_replicas_in_sync
    inner, metrics = train_step, [loss_metric]

    def train_step(batch):  # The loss is reduced once per loop, not per step.
      loss_metric.update_state(inner(batch)["loss"] * replicas)

  runner = tfdist.Runner(
      strategy=strategy, train_step=train_step, train_data=dataset_fn,
      metrics=metrics, options=tfdist.RunnerOptions(steps_per_loop=spec["steps"]))
  return lambda n: runner.train(runner.step + n)


def _alone_loop(model_spec, batch: int, *, marked: bool):
  """``run(n)``: ``n`` steps of a model of this worker's own, no strategy.

  The same model, batch, optimizer and data as the other variants, with
  nothing exchanged between the workers.
  """
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = models.marked(model_spec.build()) if marked else model_spec.build()
  optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  iterator = iter(models.synthetic_dataset(model_spec, batch,
                                           seed=_task_index()))

  @tf.function
  def loop(n):
    total = tf.constant(0.0)
    for _ in tf.range(n):
      x, y = next(iterator)
      with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      total += loss
    return total / tf.cast(n, tf.float32)

  return lambda n: loop(tf.constant(n))


if __name__ == "__main__":
  raise SystemExit(main())
