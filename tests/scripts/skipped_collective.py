"""One worker of a 2-process cluster where worker 1 skips a collective.

Usage: skipped_collective.py TRANSPORT WHICH TIMEOUT_S

Both workers build MultiWorkerMirroredStrategy (``tfdist.make_strategy``)
with TRANSPORT and a collective timeout of TIMEOUT_S (``timeout_seconds``,
and the socket transport's ``socket_timeout_seconds``), then take training
steps of a small model: worker 0 takes two, worker 1 takes only the first
(WHICH ``second``) or none (``first``) and then sleeps far longer than the
bound. Worker 0 prints ``{"error": ..., "message": ..., "seconds": ...}``:
the error its step waiting on worker 1 raised, and how long it waited; a
hang prints nothing.
"""

import json
import os
import sys
import time

import keras
import tensorflow as tf

import tfdist
from tfdist import perf

transport, which, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
strategy = tfdist.make_strategy("multi_worker_mirrored", transport=transport,
                                timeout_seconds=timeout_s)
rank = strategy.cluster_resolver.task_id
with strategy.scope():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  optimizer = perf.with_gradient_options(
      keras.optimizers.SGD(0.1),
      perf.GradientOptions(transport=transport,
                           socket_timeout_seconds=timeout_s,
                           socket_connect_timeout_seconds=timeout_s))


@tf.function
def step(x):
  def one(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss
  return strategy.run(one, args=(x,))


x = tf.ones((8, 4))
both = 1 if which == "second" else 0  # Steps both workers take.
for _ in range(both):
  step(x)
if rank == 1:
  time.sleep(600)  # Longer than any bound: the test kills it.
started = time.monotonic()  # Worker 0: the step worker 1 skips.
try:
  step(x)
  outcome = {"error": None}
except Exception as e:  # pylint: disable=broad-except
  outcome = {"error": type(e).__name__, "message": str(e)}
outcome["seconds"] = time.monotonic() - started
print(json.dumps(outcome), flush=True)
os._exit(0)  # Not TensorFlow's shutdown barrier, which waits for worker 1.
