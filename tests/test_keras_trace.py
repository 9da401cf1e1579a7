"""Keras objects made under a tfdist strategy look as under TensorFlow's own.

Each object is made, and where it can be used as a user would (compiled and
fitted), once in the scope of ``tfdist.make_strategy("mirrored")`` and once
in the scope of ``tf.distribute.MirroredStrategy`` of the same 2 logical CPUs with Keras's
own code (`tfdist._compat.keras.restore`). What Keras and its users read of
it must be the same: ``dir()``, ``vars()``, ``get_config()``, Keras's
serialization and its round trip, a model's JSON and its ``.keras`` file.
tfdist keeps what it knows about them in weak maps beside them.
"""

import functools
import itertools
import gc
import json
import os
import shutil
import tempfile
from typing import Any, Iterator
from unittest import mock
import weakref

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import perf
from tfdist._compat import keras as keras_compat

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.

DEVICES = ["/cpu:0", "/cpu:1"]
_X = np.ones((16, 4), np.float32)
_Y = np.zeros((16, 3), np.float32)


def _functional() -> keras.Model:
  inputs = keras.Input((4,))
  return keras.Model(inputs, keras.layers.Dense(3)(
      keras.layers.Dense(5, activation="relu")(inputs)))


def _sequential() -> keras.Model:
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                           keras.layers.Dense(3)])


def _fitted(strategy, *, model=_sequential, optimizer=keras.optimizers.SGD,
            given=lambda o: o, callbacks=()) -> keras.Model:
  """A model compiled with ``given(optimizer)``, fitted for one epoch."""
  with strategy.scope():
    made = model()
    made.compile(optimizer=given(optimizer(0.01)), loss="mse")
  made.fit(_X, _Y, batch_size=8, epochs=1, verbose=0, callbacks=list(callbacks))
  return made


def _layer(strategy) -> keras.layers.Layer:
  with strategy.scope():
    layer = keras.layers.Dense(3, activation="relu")
    layer(_X)
  return layer


def _outside(strategy) -> keras.optimizers.Optimizer:
  del strategy  # Made before, and outside, its scope.
  return keras.optimizers.SGD(0.01)


def _optimizer_of(**kwargs):
  return lambda strategy: _fitted(strategy, **kwargs).optimizer


def _with_options(optimizer):
  return perf.with_gradient_options(
      optimizer, perf.GradientOptions(compression="fp16"))


def _loss_scaled(learning_rate):
  return keras.optimizers.LossScaleOptimizer(
      keras.optimizers.SGD(learning_rate))


def _observed(obj, root: str) -> dict:
  """What Keras and its users read of ``obj``."""
  os.mkdir(root)
  seen = {"dir": dir(obj), "vars": sorted(vars(obj))}
  if isinstance(obj, keras.optimizers.LossScaleOptimizer):
    seen["inner dir"] = dir(obj.inner_optimizer)
  seen["config"] = obj.get_config()
  seen["serialized"] = keras.saving.serialize_keras_object(obj)
  seen["round trip"] = keras.saving.serialize_keras_object(  # It consumes
      keras.saving.deserialize_keras_object(  # what it is given.
          keras.saving.serialize_keras_object(obj)))
  if isinstance(obj, keras.Model):
    seen["json round trip"] = keras.models.model_from_json(
        obj.to_json()).to_json()
    path = os.path.join(root, "model.keras")
    obj.save(path)
    loaded = keras.saving.load_model(path)
    seen["loaded config"] = loaded.get_config()
    seen["loaded optimizer"] = loaded.optimizer.get_config()
  return seen


#: Key ranges of the plain MirroredStrategies made here (test_perf's is 1e9).
_UPSTREAM_KEYS = itertools.count(1_500_000_000, 100_000)


def _made_under_both(ours, theirs=None) -> Iterator[tuple[str, Any]]:
  """``ours(strategy)`` under tfdist's strategy, then ``theirs`` (``ours``
  by default) under TensorFlow's.

  Each is yielded while its Keras is in place: with tfdist's corrections and
  hooks, then with Keras's own code.
  """
  keras.utils.clear_session()  # The same automatic names each time.
  yield "tfdist", ours(tfdist.make_strategy("mirrored", devices=DEVICES))
  keras_compat.restore()
  try:
    keras.utils.clear_session()
    # Every plain MirroredStrategy numbers its collectives from the same
    # keys, and one's all-reduce aborts another's of other shapes at the same
    # key in this process (test_transport's, beside): a range of its own, as
    # TensorFlow's tests give theirs ("Only set this in tests").
    with mock.patch.object(tf.distribute.MirroredStrategy,
                           "_collective_key_base", next(_UPSTREAM_KEYS)):
      upstream = tf.distribute.MirroredStrategy(DEVICES)
    yield "upstream", (theirs or ours)(upstream)
  finally:
    keras_compat.apply()


def _tempdir(test: absltest.TestCase) -> str:
  path = tempfile.mkdtemp(prefix="keras-trace-")
  test.addCleanup(shutil.rmtree, path, True)
  return path


@pytest.mark.timeout(300)
class KerasObjectTest(parameterized.TestCase):

  # Each made under tfdist's strategy, and where tfdist offers more than
  # Keras (gradient options), without it under TensorFlow's.
  @parameterized.named_parameters(
      ("dense_layer", _layer),
      ("functional_model", functools.partial(_fitted, model=_functional)),
      ("sequential_model", _fitted),
      ("sgd", _optimizer_of()),
      ("adam", _optimizer_of(optimizer=keras.optimizers.Adam)),
      ("sgd_made_outside_the_scope", _outside),
      ("adam_with_gradient_options",
       _optimizer_of(optimizer=keras.optimizers.Adam, given=_with_options),
       _optimizer_of(optimizer=keras.optimizers.Adam)),
      ("loss_scale_with_gradient_options",
       _optimizer_of(optimizer=_loss_scaled, given=_with_options),
       _optimizer_of(optimizer=_loss_scaled)),
  )
  def test_reads_as_under_tensorflows_strategy(self, ours, theirs=None):
    root = _tempdir(self)
    seen = {label: _observed(made, os.path.join(root, label))
            for label, made in _made_under_both(ours, theirs)}
    ours, theirs = seen["tfdist"], seen["upstream"]
    self.assertEqual(ours.keys(), theirs.keys())
    for key in ours:
      self.assertEqual(ours[key], theirs[key], key)
    self.assertEqual(ours["round trip"], ours["serialized"])
    self.assertNotIn("tfdist", json.dumps(ours, default=repr))


@pytest.mark.timeout(300)
class CallbackTest(parameterized.TestCase):
  """A callback that `one_writer` holds inside `fit`, and gives back."""

  @parameterized.named_parameters(
      ("csv_logger", lambda root: keras.callbacks.CSVLogger(
          os.path.join(root, "log.csv"))),
      ("model_checkpoint", lambda root: keras.callbacks.ModelCheckpoint(
          os.path.join(root, "e{epoch}.weights.h5"), save_weights_only=True)),
      ("backup_and_restore", lambda root: keras.callbacks.BackupAndRestore(
          os.path.join(root, "backup"), delete_checkpoint=False)),
  )
  def test_reads_as_under_tensorflows_strategy(self, make):
    root = _tempdir(self)

    def fitted(strategy):
      callback, during = make(tempfile.mkdtemp(dir=root)), []
      probe = keras.callbacks.LambdaCallback(  # Records dir() inside fit.
          on_epoch_end=lambda *_: during.append(dir(callback)))
      _fitted(strategy, callbacks=[callback, probe])
      return callback, during

    (ours, ours_during), (theirs, theirs_during) = (
        made for _, made in _made_under_both(fitted))
    self.assertEqual(ours_during, theirs_during)
    self.assertLen(ours_during, 1)
    self.assertEqual(dir(ours), dir(theirs))
    self.assertEqual(sorted(vars(ours)), sorted(vars(theirs)))
    self.assertEqual([n for n in dir(ours) if "tfdist" in n], [])


class KeptBesideTest(absltest.TestCase):
  """What tfdist keeps beside an optimizer: read, then gone with it."""

  def test_gradient_options_are_read_and_go_with_the_optimizer(self):
    options = perf.GradientOptions(compression="fp16")
    with tfdist.make_strategy("mirrored", devices=DEVICES).scope():
      optimizer = perf.with_gradient_options(_loss_scaled(0.01), options)
    inner = optimizer.inner_optimizer  # Given them too: it sums.
    self.assertEqual([perf.gradient_options_of(o) for o in (optimizer, inner)],
                     [options, options])
    gone = [weakref.ref(optimizer), weakref.ref(inner)]
    del optimizer, inner
    gc.collect()
    self.assertEqual([ref() for ref in gone], [None, None])
    # New optimizers, which may take the ids freed, have no options.
    fresh = [keras.optimizers.SGD(0.01) for _ in range(20)]
    self.assertEqual([perf.gradient_options_of(o) for o in fresh], [None] * 20)


if __name__ == "__main__":
  absltest.main()
