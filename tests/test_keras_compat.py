"""Keras 3 `model.fit` under tfdist strategies, with real clusters.

Single-process strategies run in this process on the 2 logical CPUs that
conftest.py sets up; MultiWorkerMirroredStrategy runs 2 real processes through
tests/scripts/keras_fit.py. The ``Upstream*`` tests run Keras without the
corrections and fail, on purpose, the day upstream fixes a bug.
"""

import contextlib
import functools
import inspect
import json
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist._compat import keras as keras_compat
from tfdist.strategy import factory
from tfdist.strategy import keras_hooks
import cluster_utils

ALL_FIXES = ("atomic_assign_add", "chief_aware_callbacks",
             "distributed_input_autotune", "flight_steps",
             "jit_compile_multi_replica",
             "lazy_optimizer_build", "loss_scale_agreement",
             "multi_worker_scalar_mean", "scope_errors", "steps_per_execution",
             "strategy_transport", "symbolic_build_reduce", "transport_errors")
_REDUCE = "keras.src.backend.tensorflow.trainer:reduce_per_replica"
DEVICES = ["/cpu:0", "/cpu:1"]


def _model(seed: int = 0) -> keras.Model:
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((28, 28)),
      keras.layers.Reshape((28, 28, 1)),
      keras.layers.Conv2D(4, 3, activation="relu"),
      keras.layers.Flatten(),
      keras.layers.Dense(10),
  ])


def _data(n: int = 64, seed: int = 0):
  rng = np.random.default_rng(seed)
  return (rng.random((n, 28, 28), dtype=np.float32),
          rng.integers(0, 10, size=(n,)).astype(np.int64))


def _dense_model(seed: int = 0) -> keras.Model:
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten(),
                           keras.layers.Dense(16, activation="relu"),
                           keras.layers.Dense(10)])


def _fit(strategy, *, epochs: int = 1, batch_size: int = 16, weights=None,
         model_fn=_model, **compile_kw) -> keras.Model:
  with strategy.scope():
    model = model_fn()
    if weights is not None:
      model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kw)
  x, y = _data()
  model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
            verbose=0)
  return model


@contextlib.contextmanager
def _upstream_keras():
  """Runs the body with Keras's own trainer, then puts the corrections back."""
  keras_compat.restore()
  try:
    yield
  finally:
    keras_compat.apply()


def _upstream_fixed(fix: str) -> str:
  return (f"upstream fixed {fix} in keras {keras.__version__} without "
          "changing the code tfdist's correction fingerprints: drop the "
          f"correction {fix!r} from tfdist/_compat/keras.py")


@pytest.mark.beside
class FingerprintTest(parameterized.TestCase):
  """Corrections apply where Keras still has the code they were verified on."""

  def setUp(self):
    super().setUp()
    factory.install_keras_hooks()  # The host: tfdist's hooks, too.

  def test_installed_keras_has_the_verified_code(self):
    # Fails when the venv moves to a Keras whose code changed: re-verify.
    self.assertEqual({f.name: keras_compat.changed_targets(f)
                      for f in keras_compat.FIXES + keras_hooks.HOOKS},
                     {name: () for name in ALL_FIXES})
    self.assertIn(keras.__version__, keras_compat.VERIFIED_VERSIONS)

  def test_fingerprint_reads_keras_code_under_the_corrections(self):
    keras_compat.restore()
    try:
      before = keras_compat.fingerprint(_REDUCE)
      keras_compat.apply()
      self.assertEqual(keras_compat.fingerprint(_REDUCE), before)
      self.assertRegex(before, r"^[0-9a-f]{16}$")
    finally:
      keras_compat.apply()

  @parameterized.named_parameters(
      ("changed_code", {_REDUCE: "0123456789abcdef"}, (_REDUCE,)),
      ("no_source", {"builtins:len": "0123456789abcdef"}, ("builtins:len",)),
      ("missing_function", {f"{_REDUCE}_gone": None}, (f"{_REDUCE}_gone",)),
      ("missing_module", {"keras.src.gone:f": "0123456789abcdef"},
       ("keras.src.gone:f",)),
      ("public_signature_only", {"keras:Model.fit": None}, ()),
  )
  def test_changed_targets(self, verified, changed):
    fix = keras_compat.Fix("probe", verified, "none")
    self.assertEqual(keras_compat.changed_targets(fix), changed)
    self.assertEqual(keras_compat.needed_fixes([fix]), () if changed else (fix,))

  def test_a_changed_fix_is_left_out_and_said_once(self):
    changed = keras_compat.Fix("multi_worker_scalar_mean",
                               {_REDUCE: "0123456789abcdef"}, "none")
    fixes = tuple(changed if f.name == changed.name else f
                  for f in keras_compat.FIXES)
    keras_compat.restore()
    try:
      with mock.patch.object(keras_compat, "FIXES", fixes):
        with self.assertLogs("absl", "WARNING") as logs:
          applied = keras_compat.apply()
          keras_compat.apply()
      self.assertNotIn("multi_worker_scalar_mean", applied)
      self.assertEqual(sorted(applied),
                       sorted(set(ALL_FIXES) - {"multi_worker_scalar_mean"}))
      said = [r for r in logs.output if "multi_worker_scalar_mean" in r]
      self.assertLen(said, 1)
      self.assertIn(f"{_REDUCE} changed in Keras {keras.__version__} / "
                    f"TensorFlow {tf.__version__}", said[0])
    finally:
      keras_compat.restore()
      keras_compat.apply()

  def test_apply_is_idempotent_and_reversible(self):
    from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
    keras_compat.restore()
    original = trainer.reduce_per_replica
    try:
      self.assertEqual(keras_compat.apply(), ALL_FIXES)
      patched = trainer.reduce_per_replica
      self.assertIsNot(patched, original)
      self.assertEqual(keras_compat.apply(), ALL_FIXES)
      self.assertIs(trainer.reduce_per_replica, patched)
      keras_compat.restore()
      self.assertIs(trainer.reduce_per_replica, original)
      self.assertEqual(keras_compat.applied_fixes(), ())
    finally:
      keras_compat.apply()

  def test_make_strategy_applies(self):
    keras_compat.restore()
    tfdist.make_strategy("default")
    self.assertEqual(keras_compat.applied_fixes(), ALL_FIXES)


@pytest.mark.beside
@pytest.mark.timeout(120)
class MirroredFitTest(parameterized.TestCase):
  """Fit on 2 replicas in this process; every case failed or was untested."""

  def setUp(self):
    super().setUp()
    keras_compat.apply()
    self.addCleanup(keras.config.set_dtype_policy, "float32")

  @parameterized.named_parameters(
      ("spe3", "mirrored", None, dict(steps_per_execution=3)),
      ("mixed_float16", "mirrored", "mixed_float16", {}),
      ("mixed_bfloat16", "mirrored", "mixed_bfloat16", {}),
      ("central_storage", "central_storage", None, {}),
      ("central_storage_spe2", "central_storage", None,
       dict(steps_per_execution=2)),
  )
  def test_fit_trains(self, name, policy, compile_kw):
    if policy:
      keras.config.set_dtype_policy(policy)
    devices = ({"devices": DEVICES} if name == "mirrored"
               else {"compute_devices": DEVICES})
    strategy = tfdist.make_strategy(name, **devices)
    self.assertEqual(strategy.num_replicas_in_sync, 2)
    model = _fit(strategy, epochs=2, **compile_kw)
    # 64 samples / batch 16 = 4 steps per epoch, 2 epochs.
    self.assertEqual(int(model.optimizer.iterations.numpy()), 8)
    if policy == "mixed_float16":
      self.assertIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    for w in model.get_weights():
      self.assertTrue(np.all(np.isfinite(w)))

  @parameterized.named_parameters(
      ("jit", dict(jit_compile=True)),
      ("jit_spe2", dict(jit_compile=True, steps_per_execution=2)),
  )
  def test_jit_compile_on_two_replicas_is_refused(self, compile_kw):
    # Upstream fails deep in XLA (UpstreamMirroredTest); tfdist says why at
    # the first fit instead of training without XLA behind the user's back.
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES)
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(strategy, **compile_kw)
    self.assertEqual(caught.exception.field, "jit_compile")
    self.assertIs(caught.exception.value, True)
    self.assertEqual(caught.exception.source, "Model.compile")
    self.assertIn("MirroredStrategy with 2 replicas", str(caught.exception))
    self.assertIn("jit_compile='auto'", str(caught.exception))

  def test_jit_compile_on_one_replica_is_honoured(self):
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES[:1])
    model = _fit(strategy, jit_compile=True)
    self.assertIs(model.jit_compile, True)
    self.assertGreater(int(model.optimizer.iterations.numpy()), 0)

  def test_two_replicas_match_one_device(self):
    # Global batch 16 on 2 replicas of 8 == batch 16 on one device.
    init = _model().get_weights()
    single = _fit(tf.distribute.get_strategy(), epochs=2, weights=init)
    mirrored = _fit(tfdist.make_strategy("mirrored", devices=DEVICES),
                    epochs=2, weights=init, steps_per_execution=2)
    self.assertEqual(int(mirrored.optimizer.iterations.numpy()), 8)
    for a, b in zip(single.get_weights(), mirrored.get_weights()):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    self.assertGreater(
        max(np.max(np.abs(a - b)) for a, b in zip(init, single.get_weights())),
        1e-3)  # It did train.

  def test_a_global_batch_split_unevenly_trains(self):
    # Batch 7 on 2 replicas is 4 + 3 rows (and 64 samples end in a batch of
    # 1): upstream fails (UpstreamMirroredTest). Each replica's loss is the
    # mean of its rows, as in upstream's last partial batch (so the weights
    # are not one device's). Dense layers: on some processors (an AMD EPYC
    # here) TensorFlow 2.21's oneDNN convolution fails the gradient of an
    # empty batch, even on one device with no strategy (its output is given
    # its input's shape), so the last batch's empty replica would fail there.
    init = _dense_model().get_weights()
    mirrored = _fit(tfdist.make_strategy("mirrored", devices=DEVICES),
                    batch_size=7, weights=init, model_fn=_dense_model)
    self.assertEqual(int(mirrored.optimizer.iterations.numpy()), 10)
    moved = [np.max(np.abs(a - b)) for a, b in zip(init, mirrored.get_weights())]
    self.assertTrue(all(np.isfinite(moved)))
    self.assertGreater(max(moved), 1e-3)

  def test_no_strategy_runs_upstream_code(self):
    def weights():
      return _fit(tf.distribute.get_strategy(), steps_per_execution=2,
                  jit_compile=True).get_weights()
    patched = weights()
    with _upstream_keras():
      upstream = weights()
    for a, b in zip(patched, upstream):
      np.testing.assert_array_equal(a, b)


def _tutorial_loop(strategy, *, steps: int = 4) -> list:
  """tensorflow.org's custom-training-loop tutorial shape: model (no
  keras.Input) and optimizer made in the scope, both built lazily inside
  `strategy.run`; returns the trained weights."""
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    optimizer = keras.optimizers.Adam(0.01)
    loss_object = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16 * steps, 5)).astype("float32")
  y = rng.integers(0, 3, size=(16 * steps,))
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(16))

  def train_step(inputs):
    features, labels = inputs
    with tf.GradientTape() as tape:
      predictions = model(features, training=True)
      loss = tf.nn.compute_average_loss(loss_object(labels, predictions),
                                        global_batch_size=16)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss

  @tf.function
  def distributed_train_step(inputs):
    losses = strategy.run(train_step, args=(inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

  for batch in dataset:
    distributed_train_step(batch)
  assert int(optimizer.iterations.numpy()) == steps
  return model.get_weights()


@pytest.mark.beside
@pytest.mark.timeout(120)
class LazyBuildTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    keras_compat.apply()

  def test_tutorial_loop_on_two_replicas_matches_one_device(self):
    mirrored = _tutorial_loop(tfdist.make_strategy("mirrored",
                                                   devices=DEVICES))
    single = _tutorial_loop(tf.distribute.get_strategy())
    for a, b in zip(single, mirrored):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)

  def test_upstream_still_fails_on_two_replicas(self):
    with _upstream_keras():
      try:
        _tutorial_loop(tf.distribute.MirroredStrategy(DEVICES))
      except tf.errors.InvalidArgumentError as e:
        self.assertIn("You must feed a value for placeholder tensor", str(e))
      else:
        self.fail(_upstream_fixed("lazy_optimizer_build"))


@pytest.mark.beside
@pytest.mark.timeout(120)
class ScopeErrorsTest(parameterized.TestCase):
  """An optimizer or model made outside strategy.scope(), on 2 replicas."""

  def setUp(self):
    super().setUp()
    keras_compat.apply()
    self.strategy = tfdist.make_strategy("mirrored", devices=DEVICES)

  def _fit(self, model, optimizer, via):
    with self.strategy.scope():
      model.compile(optimizer=optimizer, loss="mse")
    fit = model.fit if via == "model.fit" else functools.partial(tfdist.fit,
                                                                 model)
    fit(np.ones((16, 4), np.float32), np.zeros((16, 2), np.float32),
        batch_size=8, epochs=1, verbose=0)

  @parameterized.named_parameters(
      ("adam", keras.optimizers.Adam, "model.fit"),
      ("sgd", keras.optimizers.SGD, "model.fit"),
      ("adam_tfdist_fit", keras.optimizers.Adam, "tfdist.fit"))
  def test_optimizer_made_outside_names_its_line(self, optimizer_class, via):
    optimizer = optimizer_class(0.01)
    line = inspect.currentframe().f_lineno - 1
    with self.strategy.scope():
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with self.assertRaises(tfdist.ConfigError) as caught:
      self._fit(model, optimizer, via)
    e = caught.exception
    self.assertEqual((e.field, e.value, e.source),
                     ("optimizer", optimizer_class.__name__,
                      f"created at {__file__}:{line}"))
    self.assertEqual(e.hint, "Move `optimizer = optimizer_class(0.01)` inside "
                     "`with strategy.scope():`, before model.compile")
    if optimizer_class is keras.optimizers.Adam:  # Its slots: upstream fails.
      self.assertIsInstance(e.__cause__, RuntimeError)
      self.assertIn("Mixing different tf.distribute.Strategy objects",
                    str(e.__cause__))
    else:  # Upstream trains, counting 2 iterations a step: refused first.
      self.assertIsNone(e.__cause__)
    self.assertEqual(int(optimizer.iterations.numpy()), 0)

  def test_one_replica_applied_outside_the_scope_trains_as_upstream(self):
    strategy = tfdist.make_strategy("one_device", device="/cpu:0")
    with strategy.scope():
      model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      optimizer = keras.optimizers.SGD(0.1)
      optimizer.build(model.trainable_variables)
    with tf.GradientTape() as tape:  # An eager loop, outside the scope.
      loss = tf.reduce_sum(model(tf.ones((4, 2))))
    before = model.get_weights()
    optimizer.apply(tape.gradient(loss, model.trainable_variables),
                    model.trainable_variables)
    self.assertEqual(int(optimizer.iterations.numpy()), 1)
    self.assertFalse(np.allclose(before[0], model.get_weights()[0]))

  def test_model_made_outside_is_named(self):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with self.assertRaises(tfdist.ConfigError) as caught:
      self._fit(model, "sgd", "model.fit")
    e = caught.exception
    self.assertEqual(e.field, "model")
    self.assertIn("where its optimizer (SGD) was created", e.expected)
    self.assertEqual(
        e.hint, "Build and compile the model inside `with strategy.scope():`")
    self.assertIsInstance(e.__cause__, AssertionError)  # Upstream's, bare.


@pytest.mark.beside
@pytest.mark.timeout(120)
class UpstreamMirroredTest(parameterized.TestCase):
  """Keras's own code still fails in the known way; fails once it does not."""

  @parameterized.named_parameters(
      ("steps_per_execution", dict(steps_per_execution=2),
       "You must feed a value for placeholder tensor"),
      ("jit_compile_multi_replica", dict(jit_compile=True),
       "Trying to access resource"),
      ("symbolic_build_reduce", dict(batch_size=7),
       "Inputs to operation AddN of type AddN must have the same size"),
  )
  def test_still_broken(self, compile_kw, message):
    fix = self._testMethodName.split("_", 3)[-1]
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    with _upstream_keras():
      try:
        _fit(strategy, **compile_kw)
      except tf.errors.InvalidArgumentError as e:
        self.assertIn(message, str(e))
      else:
        self.fail(_upstream_fixed(fix))


@pytest.mark.timeout(300)
class MultiWorkerFitTest(parameterized.TestCase):
  """MultiWorkerMirroredStrategy on 2 real processes on localhost."""

  def _run(self, *args, workers=2):
    results = cluster_utils.run_cluster(
        "keras_fit.py", cluster_utils.worker_configs(workers), args=args,
        timeout=150)
    return [r.json() for r in results], results

  def test_jit_compile_is_refused_on_every_worker(self):
    outs, _ = self._run("--strategy", "multi_worker_mirrored", "--jit_compile",
                        "--epochs", "1")
    for out in outs:
      self.assertFalse(out["ok"], out)
      self.assertEqual(out["error_type"], "ConfigError")
      self.assertIn("jit_compile: received True; expected False or 'auto' "
                    "under MultiWorkerMirroredStrategy with 2 replicas",
                    out["error"])

  # No "auto" row: in a 2-worker cluster it builds this same strategy
  # (test_strategy's MultiProcessStrategyTest, all-reduce under "auto"), and
  # the examples train with model.fit under "auto" (test_examples'
  # test_under_tfdist_launch_keras_fit).
  @parameterized.named_parameters(
      ("tutorial", "multi_worker_mirrored", ()),
      ("steps_per_execution_2", "multi_worker_mirrored",
       ("--steps_per_execution", "2", "--steps", "5", "--epochs", "2")),
  )
  def test_fit_trains_identically(self, strategy, args):
    outs, results = self._run("--strategy", strategy, *args)
    for out, result in zip(outs, results):
      self.assertTrue(out["ok"], f"{out}\n{result.stderr[-3000:]}")
      self.assertEqual(out["replicas"], 2)
      self.assertEqual(out["strategy"], "CollectiveAllReduceStrategy")
      self.assertEqual(result.returncode, 0)
    epochs = int(args[args.index("--epochs") + 1]) if "--epochs" in args else 3
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 4
    self.assertEqual(outs[0]["iterations"], epochs * steps)
    self.assertEqual(len(outs[0]["history"]["loss"]), epochs)
    # Identical weights on both workers: same checksums, bit for bit.
    self.assertEqual(outs[0]["checksum"], outs[1]["checksum"])
    self.assertEqual(outs[0]["abs_checksum"], outs[1]["abs_checksum"])
    self.assertEqual(outs[0]["history"], outs[1]["history"])
    if strategy == "multi_worker_mirrored" and not args:
      # 2 workers x batch 8 == 1 process x batch 16.
      single = cluster_utils.run_script(
          "keras_fit.py", args=("--strategy", "default"), timeout=120).json()
      self.assertTrue(single["ok"], single)
      self.assertAlmostEqual(single["checksum"], outs[0]["checksum"],
                             delta=1e-5)
      self.assertAlmostEqual(single["abs_checksum"], outs[0]["abs_checksum"],
                             delta=1e-5)

  @parameterized.named_parameters(
      ("symbolic_build_reduce", "", "ValueError",
       "Attempt to convert a value (PerReplica"),
      ("multi_worker_scalar_mean", "symbolic_build_reduce", "ValueError",
       "Invalid reduction dimension 0 for input with 0 dimensions"),
  )
  def test_upstream_still_broken(self, other_fixes, error_type, message):
    fix = self._testMethodName.split("_", 4)[-1]
    outs, _ = self._run("--upstream", "--epochs", "1", "--fixes", other_fixes)
    for out in outs:
      if out["ok"]:
        self.fail(_upstream_fixed(fix))
      self.assertEqual(out["error_type"], error_type, out)
      self.assertIn(message, out["error"])


def _mixed_precision_fit(strategy) -> tuple[keras.Model, list]:
  """One step of ``fit`` under ``mixed_float16`` on 2 replicas: replica 1's
  half of the batch is 100 times larger, and its scaled float16 gradients
  overflow (the first loss scale is 2**15); replica 0's do not. Returns the
  model and its weights before the step."""
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    with strategy.scope():
      keras.utils.set_random_seed(1)
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                                keras.layers.Dense(1, dtype="float32")])
      model.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse")
    initial = model.get_weights()
    x = np.random.default_rng(0).uniform(0.5, 1.0, (8, 4)).astype("float32")
    x[4:] *= 100  # Replica 1's half of the global batch.
    model.fit(x, np.zeros((8, 1), "float32"), batch_size=8, epochs=1,
              shuffle=False, verbose=0)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  return model, initial


@pytest.mark.beside
@pytest.mark.timeout(120)
class DistributedInputTest(parameterized.TestCase):
  """Distributed datasets run without tf.data's autotuning thread, whose join
  stalled the end of each `fit` (`keras_compat._untuned`)."""

  def _device_options(self, strategy, dataset, upstream=False):
    """The per-device pipelines' autotune options, and the first batch."""
    with _upstream_keras() if upstream else contextlib.nullcontext():
      iterator = iter(strategy.experimental_distribute_dataset(dataset))
      batch = next(iterator)
    devices = iterator._iterators[0]._iterator._device_iterators  # pylint: disable=protected-access
    return ([d._dataset.options().autotune.enabled for d in devices],  # pylint: disable=protected-access
            [t.numpy().tolist() for t in batch.values])

  @parameterized.named_parameters(
      ("unset", None, False), ("asked_for", True, True), ("off", False, False))
  def test_a_dataset_keeps_an_autotune_choice_of_its_own(self, asked, kept):
    keras_compat.apply()
    dataset = tf.data.Dataset.range(8).batch(4)
    if asked is not None:
      options = tf.data.Options()
      options.autotune.enabled = asked
      dataset = dataset.with_options(options)
    self.assertIs(keras_compat._untuned(dataset).options().autotune.enabled,  # pylint: disable=protected-access
                  kept)
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES)
    # The per-device prefetch (a buffer of fixed size) has nothing to tune.
    self.assertEqual(self._device_options(strategy, dataset),
                     ([False, False], [[0, 1], [2, 3]]))

  def test_upstream_autotunes_every_device_pipeline(self):
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES)
    dataset = tf.data.Dataset.range(8).batch(4)
    self.assertEqual(self._device_options(strategy, dataset, upstream=True),
                     ([None, None], [[0, 1], [2, 3]]))


@pytest.mark.beside
@pytest.mark.timeout(120)
class MirroredMixedPrecisionTest(absltest.TestCase):
  """Keras's LossScaleOptimizer on 2 replicas of one process."""

  def setUp(self):
    super().setUp()
    keras_compat.apply()

  def test_a_step_that_overflows_on_one_replica_is_skipped_by_all(self):
    model, initial = _mixed_precision_fit(
        tfdist.make_strategy("mirrored", devices=DEVICES))
    optimizer = model.optimizer
    self.assertIsInstance(optimizer, keras.optimizers.LossScaleOptimizer)
    self.assertEqual(int(optimizer.iterations.numpy()), 0)  # Skipped.
    self.assertEqual(float(optimizer.dynamic_scale.numpy()), 2.0 ** 14)
    for got, want in zip(model.get_weights(), initial):  # Untouched.
      np.testing.assert_array_equal(got, want)

  def test_upstream_still_broken_loss_scale_agreement(self):
    # tfdist's strategy, made before Keras's own code is put back: two
    # upstream MirroredStrategies that train in one process share collective
    # keys (tests/scripts/two_mirrored.py), and a later test's would fail.
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES)
    with _upstream_keras():
      model, _ = _mixed_precision_fit(strategy)
    # Replica 0's gradients were finite, so Keras applied the sum, which
    # holds replica 1's infinities.
    if all(np.isfinite(w).all() for w in model.get_weights()):
      self.fail(_upstream_fixed("loss_scale_agreement"))
    self.assertEqual(int(model.optimizer.iterations.numpy()), 1)


@pytest.mark.timeout(300)
class MixedPrecisionTest(absltest.TestCase):
  """LossScaleOptimizer on 2 workers, worker 1's first gradients overflowing
  (tests/scripts/mixed_precision_job.py). Upstream, worker 0 waits in the
  all-reduce worker 1 skipped (``mixed_precision_job.py --upstream``);
  `MirroredMixedPrecisionTest` fails the day Keras's code changes."""

  ENV = {"TFDIST_JOB_SECRET": "mixed-precision-test"}

  def test_every_worker_skips_the_same_steps_under_both_transports(self):
    outs = [r.json() for r in cluster_utils.run_cluster(
        "mixed_precision_job.py", cluster_utils.worker_configs(2),
        timeout=150, env=self.ENV)]
    self.assertEqual(json.dumps(outs[0], sort_keys=True),
                     json.dumps(outs[1], sort_keys=True))
    collective, socket = outs[0]["collective"], outs[0]["socket"]
    # Some steps overflowed (on worker 1 only) and were skipped by both;
    # some were applied.
    self.assertLess(collective["scale"], 2.0 ** 15)
    self.assertBetween(collective["applied"], 1, 5)
    self.assertEqual((socket["scale"], socket["applied"]),
                     (collective["scale"], collective["applied"]))
    # The options of the LossScaleOptimizer reach the optimizer it wraps.
    self.assertEqual(collective["ring_calls"], 0)
    self.assertGreaterEqual(socket["ring_calls"], socket["applied"])
    for a, b in zip(socket["weights"], collective["weights"]):
      np.testing.assert_allclose(a, b, rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
