"""Correctness of tfdist.perf: compressed and accumulated training vs plain.

Runs under a 2-replica MirroredStrategy over the 2 logical CPUs conftest
makes; the same all-reduce hook runs under MultiWorkerMirrored in the bench
(tests/test_bench.py).
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import perf

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.

DEVICES = ["/cpu:0", "/cpu:1"]


def _data(n=256, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 20)).astype("float32")
  y = (x @ rng.normal(size=(20, 1))).astype("float32")
  return x, y


def _model(strategy, *, options=None, lr=0.05):
  keras.utils.set_random_seed(1)
  with strategy.scope():
    model = keras.Sequential([keras.Input((20,)),
                              keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(lr)
    if options is not None:
      optimizer = perf.with_gradient_options(optimizer, options)
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
  return model


def _weights(model):
  return [np.asarray(w) for w in model.get_weights()]


class OptionsTest(absltest.TestCase):
  """Options and codecs, without training."""

  def test_options_validate(self):
    with self.assertRaisesRegex(tfdist.ConfigError,
                                r"\['bf16', 'fp16', 'none'\]"):
      perf.GradientOptions(compression="int8")
    with self.assertRaisesRegex(tfdist.ConfigError, "bytes_per_pack"):
      perf.GradientOptions(bytes_per_pack=-1)
    self.assertEqual(perf.COMPRESSIONS, ("bf16", "fp16", "none"))

  def test_codec_casts_only_float32(self):
    codec = perf.get_compression("fp16")
    self.assertEqual(codec.encode(tf.ones([3])).dtype, tf.float16)
    self.assertEqual(codec.encode(tf.ones([3], tf.int32)).dtype, tf.int32)
    self.assertEqual(
        codec.decode(tf.ones([3], tf.float16), tf.float32).dtype, tf.float32)

  def test_accumulation_steps_validated(self):
    with self.assertRaisesRegex(tfdist.ConfigError, "accumulation_steps"):
      perf.accumulating_step(None, None, None, global_batch_size=8,
                             accumulation_steps=0)


def _hook_sums(strategy, options, grad):
  """Each replica's result of the optimizer's all-reduce hook, under
  ``options``, for one variable whose gradient on replica ``rid`` is
  ``grad(rid)``."""
  with strategy.scope():
    optimizer = perf.with_gradient_options(keras.optimizers.SGD(0.1), options)
    var = tf.Variable(tf.zeros_like(grad(tf.constant(0))))

  @tf.function
  def reduce():
    def fn():
      rid = tf.distribute.get_replica_context().replica_id_in_sync_group
      # pylint: disable-next=protected-access
      (out, _), = optimizer._all_reduce_sum_gradients([(grad(rid), var)])
      return out
    return strategy.run(fn)

  return strategy.experimental_local_results(reduce())


class MirroredTest(parameterized.TestCase):
  """Training under one 2-replica MirroredStrategy, shared by the class."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.strategy = tfdist.make_strategy("mirrored", devices=DEVICES)

  def test_wrapping_twice_is_an_error(self):
    with self.strategy.scope():
      optimizer = perf.with_gradient_options(keras.optimizers.SGD(0.1),
                                             perf.GradientOptions())
    self.assertEqual(perf.gradient_options_of(optimizer),
                     perf.GradientOptions())
    with self.assertRaisesRegex(tfdist.ConfigError, "not given options before"):
      perf.with_gradient_options(optimizer, perf.GradientOptions())

  @parameterized.named_parameters(
      ("none", "none"),
      ("fp16", "fp16"),
      ("bf16", "bf16"),
  )
  def test_all_reduce_hook_sums_in_float32(self, compression):
    values = _hook_sums(
        self.strategy,
        perf.GradientOptions(compression=compression, bytes_per_pack=64),
        lambda rid: tf.fill([5], 0.25 + tf.cast(rid, tf.float32)))
    for v in values:
      self.assertEqual(v.dtype, tf.float32)
      np.testing.assert_allclose(v.numpy(), np.full([5], 1.5))

  def test_options_apply_under_a_strategy_tfdist_did_not_build(self):
    # Every plain MirroredStrategy numbers its collectives from the same keys,
    # and this one's bfloat16 all-reduce would abort a later float32 one at
    # the same key in this process (the suite's other files); its own key
    # range, as TensorFlow's tests give theirs ("Only set this in tests").
    with mock.patch.object(tf.distribute.MirroredStrategy,
                           "_collective_key_base", 1_000_000_000):
      strategy = tf.distribute.MirroredStrategy(DEVICES)
    for v in _hook_sums(strategy, perf.GradientOptions(compression="bf16"),
                        lambda rid: tf.fill([3], 1.0 / 3.0)):
      # 1/3 crosses as bfloat16 (0.333984375) on both replicas: the sum is
      # bfloat16's, not float32's 0.6666667.
      np.testing.assert_array_equal(v.numpy(), np.full([3], 0.66796875))

  @parameterized.named_parameters(
      ("fp16", "fp16", 2e-3),
      ("bf16", "bf16", 2e-2),
  )
  def test_compressed_fit_matches_plain(self, compression, rtol):
    x, y = _data()
    plain = _model(self.strategy)
    packed = _model(self.strategy, options=perf.GradientOptions(
        compression=compression, bytes_per_pack=256))
    for model in (plain, packed):
      model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    a, b = _weights(plain), _weights(packed)
    for wa, wb in zip(a, b):
      np.testing.assert_allclose(wb, wa, rtol=rtol, atol=rtol)
    loss_plain = plain.evaluate(x, y, verbose=0)
    loss_packed = packed.evaluate(x, y, verbose=0)
    self.assertLessEqual(abs(loss_packed - loss_plain), 0.02 * loss_plain)

  def test_accumulating_step_matches_one_large_batch(self):
    x, y = _data()
    global_batch = 32
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def dataset_fn(ctx):
      per_replica = ctx.get_per_replica_batch_size(global_batch)
      return tf.data.Dataset.from_tensor_slices((x, y)).shard(
          ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(
              per_replica, drop_remainder=True)

    finals = []
    for k in (1, 4):
      model = _model(self.strategy,
                     options=perf.GradientOptions(compression="none"))
      step = perf.accumulating_step(model, model.optimizer, loss_fn,
                                    global_batch_size=global_batch,
                                    accumulation_steps=k)
      runner = tfdist.Runner(strategy=self.strategy, train_step=step,
                             train_data=dataset_fn,
                             options=tfdist.RunnerOptions(steps_per_loop=5))
      logs = runner.train(10)
      self.assertTrue(np.isfinite(logs["loss"]))
      finals.append(_weights(model))
    for a, b in zip(*finals):
      np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)

  def test_with_accumulation_fit_matches_one_large_batch(self):
    x, y = _data()
    plain = _model(self.strategy)
    accumulated = perf.with_accumulation(_model(self.strategy), 4)
    for model in (plain, accumulated):
      model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(_weights(plain), _weights(accumulated)):
      np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
