"""A real parameter-server cluster on localhost, driven through tfdist.

Starts `tf.distribute.Server`s for 2 workers and 1 ps, each in a process of
its own (`job_common.local_ps_cluster`: `tfdist.serve`, whose worker servers
get inter-op threads >= workers + 1), builds
the strategy with tfdist as the chief, and schedules steps that add to a
variable on the ps. Usage: parameter_server.py [STRATEGY_NAME]. Prints JSON.
"""

import json
import os
import sys

import tensorflow as tf

import job_common
import tfdist

chief = job_common.local_ps_cluster(2)
name = sys.argv[1] if len(sys.argv) > 1 else "parameter_server"
strategy = tfdist.make_strategy(name, cluster=chief)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
  counter = tf.Variable(0.0)


@tf.function
def step():
  def replica_fn():
    counter.assign_add(1.0)
    return tf.constant(1.0)
  return strategy.run(replica_fn)


results = [coordinator.schedule(step) for _ in range(20)]
coordinator.join()
print(json.dumps({
    "is_pss": isinstance(strategy,
                         tf.distribute.experimental.ParameterServerStrategy),
    "counter": float(counter.numpy()),
    "results": sum(float(r.fetch()) for r in results),
    "variable_device": counter.device,
}), flush=True)
# Past the result, skip the interpreter's teardown of the coordinator's
# threads: there TensorFlow segfaulted once in a suite run (2026-11-26).
os._exit(0)  # pylint: disable=protected-access
