"""tfdist.data under a real ParameterServerStrategy, fed by its coordinator.

Starts 2 worker and 1 ps `tf.distribute.Server`s, each in a process of its
own (`job_common.local_ps_cluster`), builds the strategy as the chief, and:

* calls `tfdist.data.distribute` without a coordinator (a ConfigError) and
  `tfdist.data.distribute_dataset` (a ConfigError: use ``distribute``);
* calls ``tfdist.data.distribute(strategy, ..., coordinator=...)`` with a
  ``map_fn``, gets per-worker iterators and consumes batches on the workers
  through ``coordinator.schedule`` of a step that calls ``strategy.run``.

Prints one JSON line: the errors' fields, the InputContexts the examples
function was given, the dataset's type and every fetched batch.
"""

import json

import job_common

import tfdist

chief = job_common.local_ps_cluster(2)
strategy = tfdist.make_strategy("parameter_server", cluster=chief)

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfdist import data  # pylint: disable=g-import-not-at-top

GLOBAL_BATCH = 4
NUM_EXAMPLES = 16
STEPS = 10

errors = {}
try:
  data.distribute(strategy, lambda ctx: tf.data.Dataset.range(8),
                  global_batch_size=GLOBAL_BATCH)
except tfdist.ConfigError as e:
  errors["no_coordinator"] = [e.field, str(e)]
try:
  data.distribute_dataset(
      strategy, tf.data.Dataset.range(8).batch(GLOBAL_BATCH, True))
except tfdist.ConfigError as e:
  errors["distribute_dataset"] = [e.field, str(e)]

contexts = []


def examples_fn(ctx):
  # Runs on the chief while the dataset function is traced; the dataset
  # itself is then created and iterated on each worker.
  contexts.append([ctx.num_input_pipelines, ctx.input_pipeline_id,
                   ctx.num_replicas_in_sync])
  return tf.data.Dataset.range(NUM_EXAMPLES)


coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
per_worker = data.distribute(strategy, examples_fn,
                             global_batch_size=GLOBAL_BATCH,
                             map_fn=lambda x: x * 10, repeat=True,
                             coordinator=coordinator)
iterators = iter(per_worker)


@tf.function
def step(iterator):
  return strategy.run(tf.identity, args=(next(iterator),))


results = [coordinator.schedule(step, args=(iterators,)) for _ in range(STEPS)]
coordinator.join()
batches = [r.fetch().tolist() for r in results]

print(json.dumps({
    "is_pss": isinstance(strategy,
                         tf.distribute.experimental.ParameterServerStrategy),
    "replicas": strategy.num_replicas_in_sync,
    "errors": errors,
    "contexts": contexts,
    "dataset_type": type(per_worker).__name__,
    "batches": batches,
}))
