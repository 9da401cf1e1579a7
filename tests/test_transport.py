"""The socket transport, tfdist.strategy.transport: the ring under TensorFlow.

`GradientOptions(transport="socket")` checked in this process, then real
2-process MultiWorkerMirrored clusters (tests/scripts/socket_transport.py):
exact sums, training equal to TensorFlow's collectives, and a peer that
dies. The ring itself, seam by seam and as rings of threads, is
tests/test_ring.py.
"""

import contextlib
import functools
import io
import json
import os
import sys
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

import cluster_utils
from test_ring import WIRE_RTOL
import tfdist
from tfdist import perf
from tfdist.bench import models
from tfdist.strategy import packing
from tfdist.strategy import timeline
from tfdist.strategy import transport as transport_lib

DEVICES = ["/cpu:0", "/cpu:1"]
#: The entry points of socket_transport.py's ``default`` mode.
ENTRIES = ("keras_fit", "fit", "runner", "keras_fit_sparse")


def _data(n=64):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 4)).astype("float32")
  return x, (x @ rng.normal(size=(4, 1))).astype("float32")


def _fit(strategy, options):
  keras.utils.set_random_seed(1)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.05)
    if options is not None:
      optimizer = perf.with_gradient_options(optimizer, options)
    model.compile(optimizer=optimizer, loss="mse")
  x, y = _data()
  model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  return model.get_weights()


@pytest.mark.beside
@pytest.mark.timeout(120)
class OptionsTest(parameterized.TestCase):

  def test_transport_is_validated(self):
    with self.assertRaisesRegex(tfdist.ConfigError,
                                r"\['auto', 'collective', 'socket'\]"):
      perf.GradientOptions(transport="tcp")
    with self.assertRaisesRegex(
        tfdist.ConfigError, r"transport: received 'tcp'; expected one of "
        r"\['auto', 'collective', 'socket'\] \(make_strategy options\)"):
      tfdist.strategy.MultiWorkerMirroredOptions(transport="tcp")
    with self.assertRaisesRegex(tfdist.ConfigError, "bytes_per_pack"):
      perf.GradientOptions(transport="socket", bytes_per_pack=1024)
    with self.assertRaisesRegex(tfdist.ConfigError, "socket_timeout_seconds"):
      perf.GradientOptions(transport="socket", socket_timeout_seconds=0)
    self.assertEqual(perf.TRANSPORTS, ("auto", "collective", "socket"))
    self.assertEqual(perf.GradientOptions().transport, "auto")

  def test_public_surface(self):
    self.assertEqual(sorted(perf.__all__), perf.__all__)
    for name in ("SocketRing", "TRANSPORTS", "close_transports"):
      self.assertIn(name, perf.__all__)
      self.assertTrue(hasattr(perf, name))

  @parameterized.named_parameters(
      ("mirrored", "mirrored", {"devices": DEVICES}, "2 replicas in one"),
      ("central_storage", "central_storage", {"compute_devices": DEVICES},
       "keeps variables on one device"),
  )
  def test_unsupported_strategy_is_a_config_error(self, name, kwargs, why):
    strategy = tfdist.make_strategy(name, **kwargs)
    with strategy.scope():
      with self.assertRaisesRegex(tfdist.ConfigError, why) as caught:
        perf.with_gradient_options(keras.optimizers.SGD(0.1),
                                   perf.GradientOptions(transport="socket"))
    self.assertIn("transport='collective'", str(caught.exception))

  def test_unsupported_strategy_found_at_the_first_step(self):
    optimizer = perf.with_gradient_options(  # Outside any scope.
        keras.optimizers.SGD(0.1), perf.GradientOptions(transport="socket"))
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES)
    with strategy.scope():
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
      model.compile(optimizer=optimizer, loss="mse")
    with self.assertRaisesRegex(tfdist.ConfigError, "one replica per worker"):
      model.fit(*_data(), batch_size=16, epochs=1, verbose=0)

  def test_one_replica_passes_gradients_through(self):
    strategy = tfdist.make_strategy("default")
    with contextlib.redirect_stderr(io.StringIO()) as err:
      plain = _fit(strategy, None)
      socket_ = _fit(strategy, perf.GradientOptions(transport="socket"))
    for a, b in zip(plain, socket_):
      np.testing.assert_array_equal(a, b)
    self.assertNotIn("tfdist: gradients cross", err.getvalue())  # None do.

  def test_the_chief_says_what_carries_the_gradients_once(self):
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES)
    with contextlib.redirect_stderr(io.StringIO()) as err:
      _fit(strategy, None)
      _fit(strategy, None)
    choice = tfdist.gradient_transport(strategy)
    self.assertEqual(choice.transport, "collective")
    self.assertEqual(
        [line for line in err.getvalue().splitlines() if "cross" in line],
        [f"tfdist: gradients cross by TensorFlow's collectives "
         f"({choice.reason})"])
    self.assertEqual(choice.reason, "MirroredStrategy: the ring serves "
                     "MultiWorkerMirrored only")


CPU = ["/job:worker/replica:0/task:0/device:CPU:0"]
GPU = ["/job:worker/replica:0/task:0/device:GPU:0"]


@pytest.mark.beside
@pytest.mark.timeout(60)
class AutoRuleTest(parameterized.TestCase):
  """``auto``: the socket ring only where it is faster and closed to strangers."""

  @parameterized.named_parameters(
      ("two_cpu_workers_with_secret", 2, CPU, True, "socket", "2 CPU workers"),
      ("eight_cpu_workers_with_secret", 8, CPU, True, "socket", "8 CPU"),
      ("no_secret", 2, CPU, False, "collective", "TFDIST_JOB_SECRET"),
      ("one_worker", 1, CPU, True, "collective", "one worker"),
      ("gpu_replicas", 2, GPU, True, "collective", "accelerators"),
      ("two_replicas_a_worker", 2, CPU * 2, True, "collective",
       "2 replicas on each worker"),
  )
  def test_rule(self, workers, devices, secret, transport, why):
    got, reason = transport_lib.auto_rule(workers=workers,
                                          local_devices=devices, secret=secret)
    self.assertEqual(got, transport)
    self.assertIn(why, reason)

  @parameterized.named_parameters(
      ("forced_collective", "collective", "collective"),
      ("auto_one_replica", "auto", "collective"),
  )
  def test_environment_variable_decides_auto(self, value, transport):
    strategy = tfdist.make_strategy("default")
    choice = transport_lib.choose(strategy, "auto",
                                  environ={"TFDIST_TRANSPORT": value})
    self.assertEqual(choice.transport, transport)

  def test_environment_variable_is_validated(self):
    with self.assertRaisesRegex(
        tfdist.ConfigError, r"TFDIST_TRANSPORT: received 'tcp'; expected "
        r"one of \['auto', 'collective', 'socket'\] \(the TFDIST_TRANSPORT "
        r"environment variable\)"):
      transport_lib.choose(tfdist.make_strategy("default"), "auto",
                           environ={"TFDIST_TRANSPORT": "tcp"})

  @parameterized.named_parameters(
      ("transport", {"TFDIST_TRANSPORT": "tcp"}, "TFDIST_TRANSPORT",
       "one of ['auto', 'collective', 'socket']"),
      ("ring_ports", {"TFDIST_RING_PORTS": "9-1"}, "TFDIST_RING_PORTS",
       "a port or a range FIRST-LAST within 1-65535, e.g. 20000-20100"),
  )
  def test_every_strategy_refuses_a_bad_variable(self, env, variable,
                                                 expected):
    """A single process reads neither, yet a bad value is a mistake."""
    self.assertEqual(list(transport_lib.environment_problems(env)),
                     [variable])
    for name in ("default", "mirrored"):
      with mock.patch.dict(os.environ, env), self.assertRaises(
          tfdist.ConfigError) as e:
        tfdist.make_strategy(name)
      self.assertEqual((e.exception.field, e.exception.value,
                        e.exception.expected),
                       (variable, env[variable], expected))
      self.assertEqual(e.exception.source,
                       f"the {variable} environment variable")

  def test_usable_variables_are_no_problem(self):
    self.assertEqual(transport_lib.environment_problems(
        {"TFDIST_TRANSPORT": "socket", "TFDIST_RING_PORTS": "20000-20100"}),
                     {})
    self.assertEqual(transport_lib.environment_problems({}), {})

  def test_one_vocabulary_of_transport_names(self):
    self.assertIs(transport_lib.TRANSPORTS,
                  tfdist.strategy.options.GRADIENT_TRANSPORTS)

  def test_socket_for_a_strategy_it_cannot_serve_names_the_option(self):
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES)
    with self.assertRaisesRegex(tfdist.ConfigError,
                                "make_strategy option transport"):
      transport_lib.choose(strategy, "socket")

  def test_strategies_tfdist_did_not_build_keep_keras_code(self):
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    self.assertEqual(transport_lib.gradient_transport(strategy).transport,
                     "collective")
    plain = _fit(strategy, None)
    forced = _fit(strategy, perf.GradientOptions(transport="collective"))
    for a, b in zip(plain, forced):
      np.testing.assert_array_equal(a, b)


def _cluster(modes, *args, env=None):
  """Runs the script's ``modes`` in turn on 2 workers; the results, and each
  worker's JSON lines by mode."""
  results = cluster_utils.run_cluster(
      "socket_transport.py", cluster_utils.worker_configs(2),
      args=["+".join(modes), *args], timeout=300, env=env)
  outs = []
  for result in results:
    by_mode = {}
    for line in result.stdout.splitlines():
      if line.startswith("{"):
        out = json.loads(line)
        assert "crash" not in out, out["crash"]
        by_mode[out.pop("mode")] = out
    outs.append(by_mode)
  return results, outs


def _stderr_of(result, mode):
  """What a worker wrote on stderr while it ran ``mode``."""
  return result.stderr.split(f"socket_transport: mode {mode}\n", 1)[1].split(
      "socket_transport: mode ", 1)[0]


#: Each ClusterTest cluster: its job secret, the entry points ``default``
#: trains and the modes that follow (``die`` and ``ring_reset_in_fit`` end
#: the rings, so last).
WITH_A_SECRET = ("s3cret", ENTRIES, ("sums", "ring_reset_in_fit"))
# The same code paths; without a secret only the default differs.
WITHOUT_ONE = ("", ("keras_fit", "keras_fit_sparse"), ("die",))


@functools.cache
def _shared(secret, entries, then):
  """Mode ``default`` (of ``entries``) then ``then``, in one cluster."""
  return _cluster(("default", *then), *entries,
                  env={"TFDIST_JOB_SECRET": secret})


def _assert_both_workers_equal(outs):
  """Every figure the two workers printed is the same (the same bits)."""
  for key in outs[0]:
    if key != "rank":
      np.testing.assert_array_equal(outs[0][key], outs[1][key])


@pytest.mark.beside
@pytest.mark.timeout(400)
class PackingTest(parameterized.TestCase):
  """How gradients reach the ring, and the buffers their sums land in."""

  @parameterized.named_parameters(
      ("small_ones_packed", [10, 3, 5], [[0, 1, 2]]),
      ("large_ones_alone", [70_000, 65_536, 3, 5, 80_000, 7],
       [[0], [1], [2, 3], [4], [5]]),
      ("just_under_alone", [65_535, 65_535], [[0, 1]]),
      ("unknown_sizes_packed", [None, 70_000, None], [[0], [1], [2]]))
  def test_groups(self, sizes, expected):
    specs = [tf.TensorSpec([s], tf.float32) for s in sizes]
    self.assertEqual(transport_lib.ALONE_BYTES, 65_536 * 4)
    self.assertEqual(packing.groups(specs), expected)

  def test_a_buffer_is_reused_once_no_view_holds_it(self):
    buffers = packing.Buffers(keep=2)
    first = buffers.take(1000)
    view = first[10:20]
    address = first.ctypes.data
    del first
    second = buffers.take(1000)  # `view` still sees the first.
    self.assertFalse(np.shares_memory(second, view))
    self.assertEqual(second.ctypes.data % 64, 0)
    second_address = second.ctypes.data
    del second
    self.assertEqual(buffers.take(1000).ctypes.data, second_address)
    del view
    again = [buffers.take(1000) for _ in range(2)]
    self.assertCountEqual([a.ctypes.data for a in again],
                          [address, second_address])
    third = buffers.take(1000)  # Both in use, two kept: a new one.
    self.assertNotIn(third.ctypes.data, [address, second_address])
    self.assertEqual([a.size for a in again + [third]], [1000] * 3)


def _bucket_note(bucket, of, ready, began, ended, nbytes=8):
  return {"event": "bucket", "bucket": bucket, "of": of, "bytes": nbytes,
          "ready": ready, "began": began, "ended": ended}


@pytest.mark.beside
class TimelineTest(parameterized.TestCase):
  """`timeline.steps` and `summary` cut and read what a recording noted."""

  @parameterized.named_parameters(
      # Two whole steps of two buckets; the second ends 2 after its pass.
      ("two_steps",
       [{"event": "backward_start", "t": 10.0},
        _bucket_note(0, 2, 11.0, 11.0, 13.0),
        _bucket_note(1, 2, 14.0, 14.0, 15.0),
        {"event": "backward_start", "t": 20.0},
        _bucket_note(0, 2, 21.0, 22.0, 23.0),
        _bucket_note(1, 2, 24.0, 24.0, 26.0)],
       [(4.0, [(1.0, 1.0, 3.0), (4.0, 4.0, 5.0)]),
        (4.0, [(1.0, 2.0, 3.0), (4.0, 4.0, 6.0)])],
       {"steps": 2, "backward_s": 4.0, "first_ready_s": 1.0,
        "allreduce_s": 3.0, "hidden": (2 / 3 + 1 / 3) / 2, "exposed_s": 1.5,
        "bytes_per_s_during": (4.0 + 8.0) / 2, "bytes_per_s_after": 6.0}),
      # Opened mid-step: the step cut short is left out.
      ("cut_short",
       [_bucket_note(1, 2, 4.0, 4.0, 5.0),
        {"event": "backward_start", "t": 10.0},
        _bucket_note(0, 2, 12.0, 12.0, 13.0),
        _bucket_note(1, 2, 14.0, 15.0, 16.0)],
       [(4.0, [(2.0, 2.0, 3.0), (4.0, 5.0, 6.0)])],
       {"steps": 1, "backward_s": 4.0, "first_ready_s": 2.0,
        "allreduce_s": 2.0, "hidden": 0.5, "exposed_s": 2.0,
        "bytes_per_s_during": 8.0, "bytes_per_s_after": 8.0}),
      # No marker in the model: a step starts at its first bucket.
      ("unmarked", [_bucket_note(0, 1, 5.0, 5.5, 6.0)],
       [(0.0, [(0.0, 0.5, 1.0)])],
       {"steps": 1, "backward_s": 0.0, "first_ready_s": 0.0,
        "allreduce_s": 0.5, "hidden": 0.0, "exposed_s": 1.0,
        "bytes_per_s_during": 0.0, "bytes_per_s_after": 16.0}),
      ("nothing", [], [], {"steps": 0, "backward_s": 0.0, "first_ready_s": 0.0,
                           "allreduce_s": 0.0, "hidden": 0.0,
                           "exposed_s": 0.0, "bytes_per_s_during": 0.0,
                           "bytes_per_s_after": 0.0}),
  )
  def test_steps_and_summary(self, notes, expected, summary):
    steps = timeline.steps(notes)
    self.assertEqual(
        [(s["backward_s"][1], [(b["ready"], b["began"], b["ended"])
                               for b in s["buckets"]]) for s in steps],
        expected)
    for s in steps:
      self.assertEqual(s["backward_s"][0], 0.0)
      self.assertEqual([b["bucket"] for b in s["buckets"]],
                       list(range(len(s["buckets"]))))
    got = timeline.summary(steps)
    self.assertEqual(set(got), set(summary))
    for key, value in summary.items():
      self.assertAlmostEqual(got[key], value, msg=key)

  def test_a_marked_model_notes_each_backward_pass_only_while_recording(self):
    inner = models.MODELS["mlp"].build()
    model = models.marked(inner)
    self.assertEqual([v.name for v in model.trainable_variables],
                     [v.name for v in inner.trainable_variables])
    x, y = tf.ones((4, 784)), tf.zeros((4,), tf.int32)

    @tf.function
    def step():
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True), from_logits=True))
      return tape.gradient(loss, model.trainable_variables)

    step()  # Nothing records: nothing is noted.
    with timeline.recording() as notes:
      before = [g.numpy() for g in step()]
      step()
    step()
    self.assertEqual([n["event"] for n in notes], ["backward_start"] * 2)
    self.assertLess(notes[0]["t"], notes[1]["t"])
    # The marker passes the gradient through: the inner model's own.
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
          y, inner(x, training=True), from_logits=True))
    unmarked = tape.gradient(loss, model.trainable_variables)
    self.assertLen(before, 6)
    for got, want in zip(before, unmarked):
      np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.timeout(400)
class ClusterTest(parameterized.TestCase):
  """Two MultiWorkerMirrored processes on localhost: two clusters (`_shared`)
  serve all but one test."""

  def test_sums_exact_in_float32_and_close_compressed(self):
    _, outs = _shared(*WITH_A_SECRET)
    a, b = (out["sums"] for out in outs)
    self.assertEqual(a["cases"].keys(), b["cases"].keys())
    self.assertLen(a["cases"], 3 * 19)
    for out in (a, b):
      # Six steps whose sums were dropped took at most two new buffers (one
      # whose views TensorFlow has not let go of yet); three sums held at
      # once each kept their own values.
      self.assertLessEqual(out["reuse"]["allocations_for_6_dropped"], 2)
      self.assertTrue(out["reuse"]["kept_exact"])
    for case, got in a["cases"].items():
      # Both workers hold the same bits.
      self.assertEqual(got["digest"], b["cases"][case]["digest"], case)
      if "/none/" in case:
        self.assertEqual(got["max_error"], 0.0, case)
      else:
        rtol = 2 * WIRE_RTOL["float16" if "/fp16/" in case else "bfloat16"]
        self.assertLessEqual(got["max_error"], rtol * got["max_abs"], case)

  @parameterized.named_parameters(
      ("with_a_job_secret_the_ring", WITH_A_SECRET, "socket"),
      ("without_one_tensorflow_collectives", WITHOUT_ONE, "collective"))
  def test_training_by_default_forced_and_matching(self, run, default):
    results, outs = _shared(*run)
    entries = run[1]
    outs = [out["default"] for out in outs]
    # The chief says what carries the gradients, visibly, at the first step
    # (the default's), and again when an optimizer forces the other one.
    said = [line for line in _stderr_of(results[0], "default").splitlines()
            if line.startswith("tfdist: gradients cross by ")]
    self.assertLen(said, 2, results[0].stderr)
    self.assertIn(
        {"socket": "by the socket ring (auto: 2 CPU workers with a job "
                   "secret", "collective": "by TensorFlow's collectives "
                   "(auto: no job secret (TFDIST_JOB_SECRET)"}[default],
        said[0])
    self.assertIn("asked for by GradientOptions(transport=", said[1])
    self.assertNotIn("tfdist: gradients cross", results[1].stderr)
    for out in outs:
      self.assertEqual(out["transport"], default, out["reason"])
      for how in entries:
        calls = {t: out[f"{how}_{t}_ring_calls"]
                 for t in ("default", "options", "collective", "socket")}
        self.assertEqual(calls["collective"], 0, how)
        self.assertGreater(calls["socket"], 0, how)
        for t in ("default", "options"):
          self.assertEqual(calls[t] > 0, default == "socket", (how, t))
        for transport in ("default", "options", "socket"):  # Within 1e-5.
          np.testing.assert_allclose(out[f"{how}_{transport}"],
                                     out[f"{how}_collective"], atol=1e-5)
    _assert_both_workers_equal(outs)

  def test_workers_that_choose_differently_are_refused_at_start_up(self):
    argv = [sys.executable,
            os.path.join(cluster_utils.SCRIPTS, "socket_transport.py"),
            "default"]
    envs = [cluster_utils.base_env({"TF_CONFIG": json.dumps(config),
                                    "TFDIST_JOB_SECRET": secret})
            for config, secret in zip(cluster_utils.worker_configs(2),
                                      ("s3cret", ""))]  # worker:1 has none.
    results = cluster_utils.run_processes([argv, argv], envs, timeout=240)
    for result, mine, other, theirs in (
        (results[0], "socket", "worker:1", "collective"),
        (results[1], "collective", "worker:0", "socket")):
      self.assertNotEqual(result.returncode, 0)
      self.assertIn(f"ConfigError: transport: received '{mine} on ",
                    result.stderr)
      self.assertIn(f"the same on every worker; {other} chose {theirs}",
                    result.stderr)
      self.assertIn("TFDIST_JOB_SECRET and TFDIST_TRANSPORT alike",
                    result.stderr)

  def test_dead_peer_fails_fast_with_its_name(self):
    results, outs = _shared(*WITHOUT_ONE)
    survivor = outs[0]["die"]
    self.assertEqual(results[1].returncode, 3)  # os._exit(3) mid-loop.
    self.assertNotIn("die", outs[1])
    self.assertEqual(survivor["rank"], 0)
    self.assertIsNotNone(survivor["error"])
    self.assertGreater(survivor["calls"], 0)
    # Raised inside tf.numpy_function, it reaches Python as TensorFlow's
    # UnknownError; tfdist.fit's and Runner's worker_errors raise the ring's.
    self.assertEqual(survivor["error"], "WorkerLostError")
    self.assertEqual(survivor["cause"], "UnknownError")
    self.assertStartsWith(survivor["message"],
                          "socket transport: worker:0 lost worker:1")
    self.assertLess(survivor["after_death_s"], 30)

  def test_ring_reset_in_plain_fit_is_the_rings_error(self):
    """Plain ``model.fit``: the ring's error, not TensorFlow's UnknownError
    around it (the ``transport_errors`` Keras correction)."""
    _, outs = _shared(*WITH_A_SECRET)
    for out, start in zip(
        (out["ring_reset_in_fit"] for out in outs),
        ("socket transport: worker:0 lost worker:1",
         "socket transport: the ring of worker:1 was closed")):
      self.assertEqual(out["choice"], "socket")
      self.assertEqual(out["error"], "WorkerLostError", str(out))
      self.assertEqual(out["cause"], "UnknownError")
      self.assertStartsWith(out["message"], start)


if __name__ == "__main__":
  absltest.main()
