"""The socket transport, tfdist.perf.transport: the ring under TensorFlow.

`GradientOptions(transport="socket")` checked in this process, then real
2-process MultiWorkerMirrored clusters (tests/scripts/socket_transport.py):
exact sums, training equal to TensorFlow's collectives, and a peer that
dies. The ring itself, seam by seam and as rings of threads, is
tests/test_ring.py.
"""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

import cluster_utils
from test_ring import WIRE_RTOL
import tfdist
from tfdist import perf

DEVICES = ["/cpu:0", "/cpu:1"]


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


@pytest.mark.timeout(120)
class OptionsTest(parameterized.TestCase):

  def test_transport_is_validated(self):
    with self.assertRaisesRegex(tfdist.ConfigError,
                                r"\['collective', 'socket'\]"):
      perf.GradientOptions(transport="tcp")
    with self.assertRaisesRegex(tfdist.ConfigError, "bytes_per_pack"):
      perf.GradientOptions(transport="socket", bytes_per_pack=1024)
    with self.assertRaisesRegex(tfdist.ConfigError, "socket_timeout_seconds"):
      perf.GradientOptions(transport="socket", socket_timeout_seconds=0)
    self.assertEqual(perf.TRANSPORTS, ("collective", "socket"))

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
    plain = _fit(strategy, None)
    socket_ = _fit(strategy, perf.GradientOptions(transport="socket"))
    for a, b in zip(plain, socket_):
      np.testing.assert_array_equal(a, b)


def _cluster(mode, ranks=(0, 1)):
  """Runs the script on 2 workers; the JSON of the workers in ``ranks``."""
  results = cluster_utils.run_cluster(
      "socket_transport.py", cluster_utils.worker_configs(2), args=[mode],
      timeout=300)
  outs = []
  for rank in ranks:
    out = results[rank].json()
    assert "crash" not in out, out["crash"]
    outs.append(out)
  return results, outs


@pytest.mark.timeout(400)
class ClusterTest(absltest.TestCase):
  """Two MultiWorkerMirrored processes on localhost."""

  def test_sums_exact_in_float32_and_close_compressed(self):
    _, (a, b) = _cluster("sums")
    self.assertEqual(a["cases"].keys(), b["cases"].keys())
    self.assertLen(a["cases"], 3 * 15)
    for case, got in a["cases"].items():
      # Both workers hold the same bits.
      self.assertEqual(got["digest"], b["cases"][case]["digest"], case)
      if "/none/" in case:
        self.assertEqual(got["max_error"], 0.0, case)
      else:
        rtol = 2 * WIRE_RTOL["float16" if "/fp16/" in case else "bfloat16"]
        self.assertLessEqual(got["max_error"], rtol * got["max_abs"], case)

  def test_training_matches_tensorflow_collectives(self):
    _, outs = _cluster("train")
    for out in outs:
      for how in ("fit", "runner"):
        np.testing.assert_allclose(out[f"{how}_socket"],
                                   out[f"{how}_collective"], atol=1e-5)
    for key in outs[0]:
      if key != "rank":
        np.testing.assert_array_equal(outs[0][key], outs[1][key])

  def test_dead_peer_fails_fast_with_its_name(self):
    results, (survivor,) = _cluster("die", ranks=(0,))
    self.assertEqual(results[1].returncode, 3)  # os._exit(3) mid-loop.
    self.assertEqual(survivor["rank"], 0)
    self.assertIsNotNone(survivor["error"])
    self.assertGreater(survivor["calls"], 0)
    self.assertIn("WorkerLostError: socket transport: worker:0 lost worker:1",
                  survivor["message"])
    self.assertLess(survivor["after_death_s"], 30)


if __name__ == "__main__":
  absltest.main()
