"""The socket transport: tfdist.perf.ring and tfdist.perf.transport.

Rings of threads in this process check the algorithm and its failures
quickly; real 2-process MultiWorkerMirrored clusters
(tests/scripts/socket_transport.py) check it under TensorFlow: exact sums,
training equal to TensorFlow's collectives, and a peer that dies.
"""

import socket
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

import cluster_utils
import tfdist
from tfdist import perf
from tfdist.perf import ring as ring_lib

SIZES = [0, 1, 2, 3, 5, 7, 1001, (1 << 16) + 3]
# Relative error of one rounding to the wire dtype, per hop.
WIRE_RTOL = {"float32": 1e-6, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
BLOCK_BYTES = 4096  # Small blocks: every size above spans several.


class LocalRendezvous:
  """An in-process `Rendezvous` (a dict and a condition)."""

  def __init__(self, on_publish=None):
    self._values = {}
    self._cond = threading.Condition()
    self._on_publish = on_publish

  def publish(self, key, value):
    with self._cond:
      self._values[key] = value
      self._cond.notify_all()
    if self._on_publish:
      self._on_publish(key, value)

  def lookup(self, key, timeout_s):
    with self._cond:
      if not self._cond.wait_for(lambda: key in self._values, timeout_s):
        raise TimeoutError(key)
      return self._values[key]


def _make_rings(n, rendezvous=None, **kwargs):
  rendezvous = rendezvous or LocalRendezvous()
  options = dict(connect_timeout_s=20, timeout_s=20, block_bytes=BLOCK_BYTES)
  options.update(kwargs)
  return [ring_lib.SocketRing(rank=i, hosts=["127.0.0.1"] * n,
                              names=[f"worker:{j}" for j in range(n)],
                              rendezvous=rendezvous, key="test", **options)
          for i in range(n)]


def _on_each(rings, fn, timeout=60):
  """``fn(rank, ring)`` on every ring at once; results or exceptions."""
  results = [None] * len(rings)

  def run(i):
    try:
      results[i] = fn(i, rings[i])
    except Exception as e:  # pylint: disable=broad-exception-caught
      results[i] = e

  threads = [threading.Thread(target=run, args=(i,), daemon=True)
             for i in range(len(rings))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout)
    assert not t.is_alive(), "a ring call did not return"
  return results


def _inputs(rank, size):
  return np.random.default_rng([rank, size]).normal(size=size).astype(
      np.float32)


@pytest.mark.timeout(120)
class RingTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.rings = []

  def tearDown(self):
    for ring in self.rings:
      ring.close()
    super().tearDown()

  def _rings(self, n, **kwargs):
    self.rings = _make_rings(n, **kwargs)
    return self.rings

  @parameterized.product(n=[2, 3], wire=["float32", "float16", "bfloat16"])
  def test_sums_every_size_the_same_on_every_rank(self, n, wire):
    rings = self._rings(n)
    results = _on_each(rings, lambda r, ring: [
        ring.all_reduce(_inputs(r, s), wire=wire) for s in SIZES])
    for i, size in enumerate(SIZES):
      expected = sum(_inputs(r, size).astype(np.float64) for r in range(n))
      got = results[0][i]
      self.assertEqual(got.dtype, np.float32)
      self.assertEqual(got.shape, (size,))
      for other in results[1:]:  # The same bits everywhere.
        np.testing.assert_array_equal(other[i], got)
      scale = np.max(np.abs(expected), initial=1.0)
      np.testing.assert_allclose(got, expected, rtol=0,
                                 atol=(n - 1) * 2 * WIRE_RTOL[wire] * scale)

  def test_two_ranks_float32_is_the_float32_sum(self):
    rings = self._rings(2)
    results = _on_each(rings, lambda r, ring: ring.all_reduce(
        _inputs(r, 12345).reshape(5, 2469)))
    expected = (_inputs(0, 12345) + _inputs(1, 12345)).reshape(5, 2469)
    for got in results:
      np.testing.assert_array_equal(got, expected)

  @parameterized.product(n=[2, 3], wire=["float32", "float16", "bfloat16"])
  def test_sums_in_place(self, n, wire):
    rings = self._rings(n)

    def fn(r, ring):
      separate = ring.all_reduce(_inputs(r, 20001), wire=wire)
      data = _inputs(r, 20001)
      same = ring.all_reduce(data, wire=wire, out=data)
      return separate, data, same

    for separate, data, same in _on_each(rings, fn):
      self.assertIs(same, data)
      np.testing.assert_array_equal(data, separate)

  @parameterized.parameters(2, 3)
  def test_send_receive_passes_each_buffer_to_the_right(self, n):
    """The bench's ceiling: the ring's data movement without arithmetic."""
    rings = self._rings(n)

    def fn(r, ring):
      out = np.zeros(10007, np.float32)
      ring.send_receive(_inputs(r, 10007), out)
      after = ring.all_reduce(_inputs(r, 5))  # Still in step afterwards.
      return out, after

    results = _on_each(rings, fn)
    for r, (out, after) in enumerate(results):
      np.testing.assert_array_equal(out, _inputs((r - 1) % n, 10007))
      np.testing.assert_allclose(
          after, sum(_inputs(k, 5) for k in range(n)), rtol=1e-6)

  def test_bad_out_is_a_config_error(self):
    ring, = self._rings(1)
    with self.assertRaisesRegex(tfdist.ConfigError, "out"):
      ring.all_reduce(np.ones(3, np.float32), out=np.ones(4, np.float32))

  def test_one_rank_returns_a_copy(self):
    ring, = self._rings(1)
    data = np.arange(4, dtype=np.float32)
    out = ring.all_reduce(data)
    np.testing.assert_array_equal(out, data)
    self.assertIsNot(out, data)
    self.assertFalse(ring.connected)

  def test_unknown_wire_lists_the_choices(self):
    ring, = self._rings(1)
    with self.assertRaisesRegex(tfdist.ConfigError,
                                r"\['bfloat16', 'float16', 'float32'\]"):
      ring.all_reduce(np.ones(3, np.float32), wire="int8")

  def test_bad_rank_and_timeouts_are_config_errors(self):
    with self.assertRaisesRegex(tfdist.ConfigError, "rank"):
      ring_lib.SocketRing(rank=2, hosts=["a", "b"],
                          rendezvous=LocalRendezvous(), key="k")
    with self.assertRaisesRegex(tfdist.ConfigError, "timeout_s"):
      ring_lib.SocketRing(rank=0, hosts=["a"], rendezvous=LocalRendezvous(),
                          key="k", timeout_s=0)

  def test_calls_out_of_order_fail_on_both_ranks(self):
    rings = self._rings(2)
    results = _on_each(rings, lambda r, ring: ring.all_reduce(
        np.ones(10 + r, np.float32)))
    for r, error in enumerate(results):
      self.assertIsInstance(error, tfdist.ConfigError)
      self.assertIn("all-reduce order", str(error))
      self.assertIn(f"worker:{1 - r}", str(error))

  def test_closed_peer_is_named_at_once(self):
    rings = self._rings(2, timeout_s=60)

    def fn(r, ring):
      ring.connect()
      if r == 1:
        time.sleep(0.5)
        ring.close()  # Instead of all-reducing: like a process that exits.
        return None
      start = time.monotonic()
      try:
        ring.all_reduce(np.ones(1 << 16, np.float32))
      except tfdist.WorkerLostError as e:
        return e, time.monotonic() - start
      return None

    (error, seconds), _ = _on_each(rings, fn)
    self.assertIn("worker:0 lost worker:1 (127.0.0.1)", str(error))
    self.assertIn("closed the connection", str(error))
    self.assertLess(seconds, 10)  # Not the 60 s timeout: noticed at once.
    with self.assertRaises(tfdist.WorkerLostError):  # Stays failed.
      rings[0].all_reduce(np.ones(3, np.float32))

  def test_silent_peer_times_out(self):
    rings = self._rings(2, timeout_s=1)

    def fn(r, ring):
      ring.connect()
      if r == 1:
        time.sleep(4)  # Connected, but never all-reduces.
        return None
      start = time.monotonic()
      try:
        ring.all_reduce(np.ones(100, np.float32))
      except tfdist.WorkerLostError as e:
        return e, time.monotonic() - start
      return None

    (error, seconds), _ = _on_each(rings, fn)
    self.assertIn("worker:1", str(error))
    self.assertIn("no data for 1 s", str(error))
    self.assertLess(seconds, 4)

  def test_missing_peer_is_a_startup_timeout(self):
    rings = self._rings(2, connect_timeout_s=1)
    start = time.monotonic()
    with self.assertRaisesRegex(tfdist.StartupTimeoutError,
                                r"worker:1 \(127.0.0.1\) to publish its port"):
      rings[0].connect()
    self.assertLess(time.monotonic() - start, 5)
    with self.assertRaises(tfdist.StartupTimeoutError):  # No second try.
      rings[0].all_reduce(np.ones(3, np.float32))

  def test_stray_connection_is_ignored(self):
    strays = []

    def on_publish(key, value):
      if key.endswith("/0"):  # Garbage to rank 0 before its neighbour.
        s = socket.create_connection(("127.0.0.1", int(value)), timeout=5)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        strays.append(s)

    rings = self._rings(2, rendezvous=LocalRendezvous(on_publish))
    results = _on_each(rings, lambda r, ring: ring.all_reduce(
        np.full(5, r + 1.0, np.float32)))
    for s in strays:
      s.close()
    self.assertLen(strays, 1)
    for got in results:
      np.testing.assert_array_equal(got, np.full(5, 3.0))


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
