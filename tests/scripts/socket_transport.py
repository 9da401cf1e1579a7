"""One worker of a 2-process cluster exercising the socket transport.

Usage: socket_transport.py MODE[+MODE...] [ENTRY...]; modes run in turn:

* ``sums``: all-reduces gradients of many shapes (scalars, empty, odd
  lengths, multi-block) through the optimizer hook, and numpy buffers
  through the ring itself, for every wire dtype. Prints, per case, the
  largest error against the float32 sum of both workers' inputs and a digest
  of the result's bytes (equal digests: equal bits on both workers).
* ``default``: trains the same model with plain Keras code (``model.fit``),
  `tfdist.fit` and `tfdist.Runner`, each with an optimizer given no options
  (the transport ``make_strategy`` chose), given default options (the
  same), forced to TensorFlow's collectives, and forced to the socket
  transport; prints the choice, the
  weights of each and how many calls each made on the socket ring.
* ``die``: all-reduces a large buffer over and over; worker 1 ends itself
  abruptly (``os._exit``) during that loop; worker 0 prints the error it got
  and how long after worker 1's planned death it came.
* ``ring_reset_in_fit``: plain ``model.fit`` under the transport
  ``make_strategy`` chose; after its third step worker 1 closes its ring
  (as a connection reset would: both processes live on, so TensorFlow's
  collectives notice nothing); each worker prints the error ``fit`` raised
  and its cause.

Each worker prints one JSON line per mode, named by its "mode" key (on
stderr, ``socket_transport: mode NAME`` marks where each mode begins), and
ends with ``os._exit`` (a surviving worker does not wait for TensorFlow's
shutdown barrier of a dead peer). ``die`` and ``ring_reset_in_fit`` end the
rings: only the last mode may be one of them.
"""

import hashlib
import json
import os
import sys
import threading
import time
import traceback

import job_common
import numpy as np
import tfdist

MODES = sys.argv[1].split("+")
strategy = tfdist.make_strategy("multi_worker_mirrored")  # First TF work.
RANK = tfdist.resolve_cluster().task_id

import keras  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfdist import perf  # pylint: disable=g-import-not-at-top
from tfdist.strategy import introspect  # pylint: disable=g-import-not-at-top
from tfdist.strategy import transport  # pylint: disable=g-import-not-at-top
from tfdist.training import _worker_errors  # pylint: disable=g-import-not-at-top

# Gradient shapes: a scalar, empty, odd lengths, more than one 512 KiB block;
# those of 256 KiB and more (transport.ALONE_BYTES) reach the ring unpacked,
# first, between packed runs and last.
SHAPES = [(70_001,), (), (0,), (1,), (3,), (5, 7), (300_001,), (1001,),
          (3, 0), (200, 400)]
DYNAMIC_SHAPES = [(17,), (5,)]
RING_SIZES = [0, 1, 2, 3, 5, 1001, (1 << 20) + 3]
WIRES = {"none": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _inputs(rank, shape, case):
  rng = np.random.default_rng([rank, case])
  return rng.normal(size=shape).astype(np.float32)


def _check(result, case, shape):
  expected = _inputs(0, shape, case) + _inputs(1, shape, case)  # float32.
  result = np.asarray(result, np.float32)
  assert result.shape == expected.shape, (result.shape, expected.shape)
  error = float(np.max(np.abs(result - expected))) if result.size else 0.0
  scale = float(np.max(np.abs(expected))) if result.size else 0.0
  return {"max_error": error, "max_abs": scale,
          "digest": hashlib.sha256(result.tobytes()).hexdigest()}


def sums():
  out = {}
  for compression in WIRES:
    with strategy.scope():
      optimizer = perf.with_gradient_options(
          keras.optimizers.SGD(0.1),
          perf.GradientOptions(transport="socket", compression=compression,
                               socket_connect_timeout_seconds=120,
                               socket_timeout_seconds=60))
      variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    grads = [tf.constant(_inputs(RANK, s, i)) for i, s in enumerate(SHAPES)]

    @tf.function
    def reduce(optimizer=optimizer, variables=variables, grads=grads):
      def fn():
        # pylint: disable-next=protected-access
        pairs = optimizer._all_reduce_sum_gradients(zip(grads, variables))
        return [g for g, _ in pairs]
      return strategy.run(fn)

    results = reduce()
    for i, (shape, r) in enumerate(zip(SHAPES, results)):
      out[f"hook/{compression}/{shape}"] = _check(r.numpy(), i, shape)
    # Shapes known only when the graph runs (padding computed in the graph).
    unknown = tf.TensorSpec([None], tf.float32)

    @tf.function(input_signature=[unknown, unknown])
    def dynamic(a, b, compression=compression):
      return strategy.run(lambda: transport.socket_all_reduce(
          [a, b], compression=compression, connect_timeout_s=120,
          timeout_s=60, fallback=None))

    for shape, r in zip(DYNAMIC_SHAPES, dynamic(*[
        tf.constant(_inputs(RANK, s, 50 + i))
        for i, s in enumerate(DYNAMIC_SHAPES)])):
      case = 50 + DYNAMIC_SHAPES.index(shape)
      out[f"dynamic/{compression}/{shape}"] = _check(r.numpy(), case, shape)
    ring = transport.ring_for(strategy, connect_timeout_s=120, timeout_s=60)
    for j, size in enumerate(RING_SIZES):
      case = 100 + j
      r = ring.all_reduce(_inputs(RANK, (size,), case),
                          wire=WIRES[compression])
      out[f"ring/{compression}/{size}"] = _check(r, case, (size,))
  return {"cases": out, "reuse": _reuse()}


def _reuse():
  """The sums' buffers: reused by later calls once no tensor holds a sum,
  never while one does (tfdist.strategy.packing.Buffers)."""
  big = tf.constant(_inputs(RANK, (300_001,), 7))  # Reaches the ring alone.

  @tf.function
  def step(scale):
    return strategy.experimental_local_results(strategy.run(
        lambda: transport.socket_all_reduce(
            [big * scale], compression="none", connect_timeout_s=120,
            timeout_s=60, fallback=None)[0]))[0]

  sums = introspect.record_of(strategy).sums
  step(tf.constant(1.0))  # Traces.
  before = sums.allocations
  for _ in range(6):  # As training does: each sum used, then dropped.
    float(tf.reduce_sum(step(tf.constant(1.0))))
  dropped = sums.allocations - before
  scales = [1.0, 2.0, 4.0]  # Powers of 2: scaled sums are exact.
  kept = [step(tf.constant(s)) for s in scales]
  expected = _inputs(0, (300_001,), 7) + _inputs(1, (300_001,), 7)
  return {"allocations_for_6_dropped": dropped,
          "kept_exact": all(np.array_equal(k.numpy(), expected * s)
                            for k, s in zip(kept, scales))}


def _model_and_optimizer(options, build=job_common.model):
  """In the strategy's scope: the model, and SGD with ``options`` if any."""
  with strategy.scope():
    model = build()
    optimizer = keras.optimizers.SGD(0.05)
    if options is not None:
      optimizer = perf.with_gradient_options(optimizer, options)
  return model, optimizer


def _embedding_model():
  """A model with an Embedding: its gradient is sparse (IndexedSlices)."""
  keras.utils.set_random_seed(3)
  return keras.Sequential([keras.Input((4,), dtype="int32"),
                           keras.layers.Embedding(50, 3),
                           keras.layers.Flatten(), keras.layers.Dense(1)])


def _embedding_data(n):
  rng = np.random.default_rng(0)
  return (rng.integers(0, 50, size=(n, 4)).astype("int32"),
          rng.normal(size=(n, 1)).astype("float32"))


def _fitted(options, fit, build=job_common.model, data=job_common.data):
  """The weights after ``fit(model, x, y)`` of a compiled model."""
  x, y = data(48)
  model, optimizer = _model_and_optimizer(options, build)
  with strategy.scope():
    model.compile(optimizer=optimizer, loss="mse")
  fit(model, x, y)
  return job_common.weights(model)


def _tfdist_fit(model, x, y):
  tfdist.fit(model, x=x, y=y, batch_size=job_common.GLOBAL_BATCH, epochs=2,
             shuffle=False, verbose=0)


def _keras_fit(model, x, y):
  model.fit(x, y, batch_size=job_common.GLOBAL_BATCH, epochs=2,
            shuffle=False, verbose=0)


def _runner(options):
  x, y = job_common.data(512)
  model, optimizer = _model_and_optimizer(options)
  with strategy.scope():
    optimizer.build(model.trainable_variables)
  step = tfdist.supervised_step(
      model, optimizer, keras.losses.MeanSquaredError(reduction=None),
      global_batch_size=job_common.GLOBAL_BATCH)
  runner = tfdist.Runner(strategy=strategy, train_step=step,
                         train_data=job_common.dataset_fn(x, y),
                         options=tfdist.RunnerOptions(steps_per_loop=4))
  runner.train(12)
  return job_common.weights(model)


def default():
  """Every entry point (or those named after the mode) by each transport."""
  choice = transport.gradient_transport(strategy)
  out = {"transport": choice.transport, "reason": choice.reason}
  for name, run in (
      ("keras_fit", lambda o: _fitted(o, _keras_fit)),
      ("fit", lambda o: _fitted(o, _tfdist_fit)),
      ("runner", _runner),
      ("keras_fit_sparse", lambda o: _fitted(
          o, _keras_fit, build=_embedding_model, data=_embedding_data))):
    if sys.argv[2:] and name not in sys.argv[2:]:
      continue
    for how, options in (
        ("default", None),
        ("options", perf.GradientOptions()),  # transport="auto", given.
        ("collective", perf.GradientOptions(transport="collective")),
        ("socket", perf.GradientOptions(transport="socket"))):
      before = sum(r.calls for r in transport.rings_of(strategy))
      out[f"{name}_{how}"] = run(options)
      out[f"{name}_{how}_ring_calls"] = sum(
          r.calls for r in transport.rings_of(strategy)) - before
  return out


def _error_report(error):
  """What a worker reports of the error that ended its loop."""
  return {"error": type(error).__name__, "message": str(error)[-3000:],
          "cause": type(error.__cause__).__name__}


def die():
  options = perf.GradientOptions(transport="socket",
                                 socket_connect_timeout_seconds=120,
                                 socket_timeout_seconds=120)
  with strategy.scope():
    optimizer = perf.with_gradient_options(keras.optimizers.SGD(0.1), options)
    var = tf.Variable(tf.zeros([8 << 20]))
  grad = tf.ones([8 << 20])

  @tf.function
  def reduce():
    def fn():
      # pylint: disable-next=protected-access
      (g, _), = optimizer._all_reduce_sum_gradients([(grad, var)])
      return g[0]
    return strategy.run(fn)

  reduce()  # Connected and warm on both workers.
  delay = 1.0
  planned = time.time() + delay
  if RANK == 1:
    threading.Timer(delay, os._exit, (3,)).start()
  calls = 0
  try:
    # As tfdist.fit and Runner do: the ring's error, not TensorFlow's
    # UnknownError around it.
    with _worker_errors.worker_errors(strategy):
      while time.time() < planned + 300:
        reduce()
        calls += 1
  except Exception as e:  # pylint: disable=broad-exception-caught
    return {**_error_report(e), "after_death_s": time.time() - planned,
            "calls": calls}
  return {"error": None, "calls": calls}


def ring_reset_in_fit():
  model, optimizer = _model_and_optimizer(None)
  with strategy.scope():
    model.compile(optimizer=optimizer, loss="mse")
  x, y = job_common.data(40 * job_common.GLOBAL_BATCH)

  class Reset(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if RANK == 1 and batch == 2:
        transport.close_transports()

  try:
    model.fit(x, y, batch_size=job_common.GLOBAL_BATCH, epochs=1, verbose=0,
              shuffle=False, callbacks=[Reset()])
  except Exception as e:  # pylint: disable=broad-exception-caught
    return {**_error_report(e),
            "choice": transport.gradient_transport(strategy).transport}
  return {"error": None}


modes = {"sums": sums, "default": default, "die": die,
         "ring_reset_in_fit": ring_reset_in_fit}
for mode in MODES:
  print(f"socket_transport: mode {mode}", file=sys.stderr, flush=True)
  try:
    result = {"rank": RANK, "mode": mode, **modes[mode]()}
  except Exception:  # pylint: disable=broad-exception-caught
    result = {"rank": RANK, "mode": mode,
              "crash": traceback.format_exc()[-3000:]}
  print(json.dumps(result), flush=True)
  if "crash" in result:
    break
sys.stderr.flush()
os._exit(0)
