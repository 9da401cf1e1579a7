"""The socket ring, tfdist.ring: each seam alone, then `SocketRing`.

Every schedule's plan is checked without sockets, by simulating whole
all-reduces in memory from it alone; the wire format by its bytes; the
connection and the exchange over loopback sockets; `tfdist.perf.SocketRing`
by rings of threads in this process, quickly, for the algorithm and its
failures (tests/test_transport.py runs it under TensorFlow on real clusters).
"""

import collections
import itertools
import os
import socket
import struct
import sys
import threading
import time
import traceback
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

import stalls
import tfdist
from tfdist import perf
from tfdist.ring import connection
from tfdist.ring import exchange
from tfdist.ring import halving
from tfdist.ring import pieces
from tfdist.ring import schedule
from tfdist.ring import socket_ring
from tfdist.ring import wire as wire_lib

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.

SIZES = [0, 1, 2, 3, 5, 7, 1001, (1 << 16) + 3]
# Relative error of one rounding to the wire dtype, per hop.
WIRE_RTOL = {"float32": 1e-6, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
BLOCK_BYTES = 4096  # Small blocks: every size above spans several.
# The bounds of calls that should succeed: far above their time (under a
# second), so that a stalled machine (two CI runs saw a ring thread make no
# progress for over 40 s) does not fail them; tests of timeouts set their own.
STALL_S = 60


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


def _on_each(items, fn, timeout=STALL_S * 3):
  """``fn(rank, item)`` on every item at once; results or exceptions."""
  results = [None] * len(items)

  def run(i):
    try:
      results[i] = fn(i, items[i])
    except Exception as e:  # pylint: disable=broad-exception-caught
      results[i] = e

  threads = [threading.Thread(target=run, args=(i,), daemon=True)
             for i in range(len(items))]
  for t in threads:
    t.start()
  start = time.monotonic()  # Running time (`stalls`), shared by all.
  for t in threads:
    while t.is_alive() and not stalls.expired(start, timeout):
      t.join(0.5)
  alive = [i for i, t in enumerate(threads) if t.is_alive()]
  assert not alive, (f"calls {alive} did not return in {timeout} s; every "
                     f"thread's stack:\n{_stacks()}")
  return results


def _stacks() -> str:
  """Every thread's stack, to say where a call that did not return waits."""
  names = {t.ident: t.name for t in threading.enumerate()}
  return "\n".join(
      f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(f))
      for ident, f in sys._current_frames().items())  # pylint: disable=protected-access


def _inputs(rank, size):
  return np.random.default_rng([rank, size]).normal(size=size).astype(
      np.float32)


# The plans.


def _simulate(name, inputs, in_place):
  """A whole all-reduce of ``inputs`` (one per rank) by the plan of schedule
  ``name`` alone, without sockets.

  Each rank takes its steps in order: a step sends a copy of its values of
  ``send``, then waits for its message from ``source`` and adds or stores
  it. A span is read where `SocketRing` reads it
  (`schedule.sources`): not in place, the outputs start as garbage, so a
  plan that reads a span from the wrong buffer fails. Asserts the plans'
  rules on the way (see `tfdist.ring.schedule`).

  Returns:
    Each rank's output.
  """
  size, length = len(inputs), inputs[0].size
  plans = [socket_ring.SCHEDULES[name].plan(r, size, length)
           for r in range(size)]
  along = {schedule.along(p, r, size) for r, p in enumerate(plans)}
  assert len(along) == 1, (name, size, "ranks disagree: ring or pairs")
  if along == {True}:  # In step: one header, then every step together.
    assert len({len(p) for p in plans}) == 1, plans
  xs = [x.copy() for x in inputs]
  outs = xs if in_place or size == 1 else [  # One rank: `SocketRing` copies.
      np.full(length, -7, x.dtype) for x in xs]
  channels = collections.defaultdict(collections.deque)  # (from, to)
  calls = collections.Counter()  # (rank, partner): steps together
  done, sent = [0] * size, [False] * size
  moved = True
  while moved:
    moved = False
    for r in range(size):
      if done[r] == len(plans[r]):
        continue
      step = plans[r][done[r]]
      send_x, add_x = schedule.sources(plans[r])[done[r]]
      (slo, shi), (rlo, rhi) = step.send, step.recv
      assert step.add or shi <= rlo or rhi <= slo, step  # Only adds overlap.
      if not sent[r] and step.to is not None:
        channels[r, step.to].append((xs if send_x else outs)[r][slo:shi]
                                    .copy())
      sent[r] = True
      if step.source is not None:
        if not channels[step.source, r]:
          continue
        values = channels[step.source, r].popleft()
        assert values.size == rhi - rlo, (name, r, step, values.size)
        outs[r][rlo:rhi] = ((xs if add_x else outs)[r][rlo:rhi] + values
                            if step.add else values)
      if along == {False}:  # A call on the pair's connections.
        assert None in (step.to, step.source) or step.to == step.source
        calls[r, step.source if step.to is None else step.to] += 1
      done[r], sent[r], moved = done[r] + 1, False, True
  assert done == [len(p) for p in plans], (name, done, plans)
  assert not any(channels.values()), "a message nobody received"
  for (r, q), n in calls.items():
    assert calls[q, r] == n, (name, r, q, "calls differ")
  return outs


class PlanTest(parameterized.TestCase):
  """Every schedule's plan (`tfdist.ring.schedule`), run on paper."""

  @parameterized.product(name=list(socket_ring.SCHEDULES),
                         size=list(range(1, 18)), in_place=[False, True])
  def test_every_plan_sums_exactly_on_every_rank(self, name, size, in_place):
    for length in sorted({0, 1, 2, size - 1, size, 7, 64, 1000 + size}):
      rng = np.random.default_rng([size, length])
      inputs = [rng.integers(-1000, 1000, length) for _ in range(size)]
      for out in _simulate(name, inputs, in_place):
        np.testing.assert_array_equal(out, sum(inputs), f"{length}")

  @parameterized.product(name=list(socket_ring.SCHEDULES),
                         size=[2, 3, 4, 5, 8, 13])
  def test_float32_sums_have_the_same_bits_on_every_rank(self, name, size):
    inputs = [_inputs(r, 1003) for r in range(size)]
    outs = _simulate(name, inputs, in_place=False)
    for out in outs[1:]:
      np.testing.assert_array_equal(out, outs[0])
    np.testing.assert_allclose(outs[0], sum(x.astype(np.float64)
                                            for x in inputs), atol=1e-5 * size)

  @parameterized.product(name=list(socket_ring.SCHEDULES),
                         size=list(range(1, 18)))
  def test_the_model_charges_the_longest_ranks_steps(self, name, size):
    # A step costs one latency and the larger of what it sends and
    # receives; the model is the rank with the most (divisible lengths).
    length = 720720 * 17
    module = socket_ring.SCHEDULES[name]
    charged = max(sum(1 + max(s.send[1] - s.send[0], s.recv[1] - s.recv[0])
                      for s in module.plan(r, size, length))
                  for r in range(size))
    self.assertAlmostEqual(
        module.seconds(size, 4 * length, latency_s=1, bytes_per_s=4),
        charged, delta=1e-9 * charged)

  @parameterized.product(size=[1, 2, 3, 4, 5], length=[0, 1, 4, 7, 1000])
  def test_segments_cover_the_buffer_once(self, size, length):
    segs = schedule.segments(length, size)
    self.assertLen(segs, size)
    self.assertEqual((segs[0][0], segs[-1][1]), (0, length))
    for (_, hi), (lo, _) in zip(segs, segs[1:]):
      self.assertEqual(hi, lo)  # Contiguous: no gap, no overlap.
    lengths = [hi - lo for lo, hi in segs]
    self.assertLessEqual(max(lengths) - min(lengths), 1)

  @parameterized.named_parameters(
      ("empty", (5, 5), 4, []),
      ("one_block", (2, 5), 4, [(2, 5)]),
      ("exact", (0, 8), 4, [(0, 4), (4, 8)]),
      ("remainder", (3, 12), 4, [(3, 7), (7, 11), (11, 12)]),
      ("single_elements", (0, 3), 1, [(0, 1), (1, 2), (2, 3)]),
  )
  def test_blocks_cut_a_span_in_order(self, span, block, expected):
    self.assertEqual(schedule.blocks(span, block), expected)

  @parameterized.parameters(2, 3, 4, 5, 8, 16)
  def test_ranks_pass_right_along_the_ring_by_partner_else(self, size):
    for name in socket_ring.SCHEDULES:
      along = schedule.along(socket_ring.SCHEDULES[name].plan(0, size, 10),
                             0, size)
      self.assertEqual(along, name == "ring" or size == 2, name)


class _TwoOnly:
  """A schedule of two ranks only: each sends its whole buffer and adds."""
  NAME, WIRES, CAP_BYTES = "two_only", ("float32",), None

  @staticmethod
  def plan(rank, size, length):
    if size not in (1, 2):
      raise ValueError(f"two ranks, not {size}")
    return ((schedule.Step(1 - rank, (0, length), 1 - rank, (0, length),
                           True),) if size == 2 else ())

  @staticmethod
  def seconds(size, nbytes, *, latency_s, bytes_per_s):
    del nbytes, bytes_per_s
    return size * latency_s


def _ring_of(n, **kwargs):
  """Rank 0 of a ring of ``n`` that never connects."""
  return perf.SocketRing(rank=0, hosts=["127.0.0.1"] * n,
                         rendezvous=LocalRendezvous(), key="k", **kwargs)


class RuleTest(parameterized.TestCase):
  """`socket_ring.choose`, `SocketRing.schedule_for` and ``schedule=``."""

  def test_the_table_ends_with_the_ring(self):
    self.assertEqual(list(socket_ring.SCHEDULES)[-1], "ring")
    for name, module in socket_ring.SCHEDULES.items():
      self.assertEqual(module.NAME, name)
      self.assertIn("float32", module.WIRES)

  @parameterized.parameters(range(2, 65))
  def test_the_pick_is_the_least_model_time_within_the_caps(self, n):
    model = dict(latency_s=socket_ring.DEFAULT_LATENCY_S,
                 bytes_per_s=socket_ring.DEFAULT_BYTES_PER_S)
    for nbytes in (4, 1024, 4096, 16384, 32 << 10, 64 << 10, 256 << 10,
                   (256 << 10) + 4, 1 << 20, (1 << 20) + 4, 64 << 20):
      got = socket_ring.choose(n, nbytes)
      where = f"{n} ranks, {nbytes} bytes"
      eligible = {name: m.seconds(n, nbytes, **model)
                  for name, m in socket_ring.SCHEDULES.items()
                  if m.CAP_BYTES is None or nbytes <= m.CAP_BYTES}
      self.assertIn(got, eligible, where)
      self.assertEqual(eligible[got], min(eligible.values()), where)

  @parameterized.parameters(4, 8, 16)
  def test_as_measured_on_the_bed(self, n):
    # docs/benchmarks.md "Many hosts": doubling at 16 KiB (1.6-1.9x faster
    # than halving), halving at 256 KiB, the ring from 4 MiB.
    self.assertEqual([socket_ring.choose(n, kb << 10)
                      for kb in (4, 16, 256, 1024, 4096, 65536)],
                     ["doubling", "doubling", "halving", "halving", "ring",
                      "ring"])

  @parameterized.parameters(2, 3, 5, 6, 7)
  def test_halving_never_where_the_ring_or_doubling_is_as_fast(self, n):
    # 2 ranks: halving is the ring. 3, 5-7: the fold's two whole-buffer
    # messages cost more than the latencies saved over doubling's.
    for nbytes in (4 << np.arange(25)).tolist():
      self.assertNotEqual(socket_ring.choose(n, nbytes), "halving", nbytes)

  @parameterized.named_parameters(
      ("one_rank", 1, 4096, "float32", "ring"),
      ("empty", 8, 0, "float32", "ring"),
      ("small", 8, 4096, "float32", "doubling"),
      ("two_ranks_at_the_cap", 2, 256 << 10, "float32", "doubling"),
      ("two_ranks_above_the_cap", 2, (256 << 10) + 4, "float32", "ring"),
      ("middle", 8, 256 << 10, "float32", "halving"),
      ("above_halvings_cap", 8, (1 << 20) + 4, "float32", "ring"),
      ("large", 8, 64 << 20, "float32", "ring"),
      ("middle_three", 3, 256 << 10, "float32", "ring"),
      ("middle_bfloat16", 8, 256 << 10, "bfloat16", "ring"),
      ("small_bfloat16", 8, 4096, "bfloat16", "ring"),
      ("small_float16", 4, 4096, "float16", "ring"),
  )
  def test_choose(self, size, nbytes, wire, expected):
    self.assertEqual(socket_ring.choose(size, nbytes, wire), expected)

  def test_a_faster_link_moves_the_crossover_up(self):
    slow = socket_ring.choose(4, 32 << 10, latency_s=30e-6, bytes_per_s=1e8)
    fast = socket_ring.choose(4, 32 << 10, latency_s=30e-6, bytes_per_s=1e9)
    self.assertEqual((slow, fast), ("halving", "doubling"))

  @parameterized.named_parameters(
      ("rule_small", None, 4096, "float32", "doubling"),
      ("rule_middle", None, 256 << 10, "float32", "halving"),
      ("rule_large", None, 64 << 20, "float32", "ring"),
      ("halving_small", "halving", 4, "float32", "halving"),
      ("rule_bfloat16", None, 4096, "bfloat16", "ring"),
      ("ring", "ring", 4096, "float32", "ring"),
      ("ring_bfloat16", "ring", 4096, "bfloat16", "ring"),
      ("doubling_large", "doubling", 64 << 20, "float32", "doubling"),
      ("doubling_empty", "doubling", 0, "float32", "ring"),
  )
  def test_schedule_for(self, forced, nbytes, wire, expected):
    ring = _ring_of(4, schedule=forced)
    self.assertEqual(ring.schedule_for(nbytes, wire), expected)

  @parameterized.named_parameters(
      ("doubling_float16", "doubling", 4, "float16",
       "carries wire='float16': ['ring']"),
      ("halving_bfloat16", "halving", 8, "bfloat16",
       "carries wire='bfloat16': ['ring']"),
      ("two_only_at_three", "two_only", 3, "float32",
       "carries 3 hosts: ['doubling', 'halving', 'ring']"),
      ("two_only_float16", "two_only", 2, "float16",
       "carries wire='float16': ['ring']"),
  )
  def test_a_forced_schedule_that_cannot_carry_is_refused(
      self, name, n, wire, can):
    # two_only: a schedule of this test's, one module and one row.
    with mock.patch.dict(socket_ring.SCHEDULES, two_only=_TwoOnly):
      with self.assertRaises(tfdist.ConfigError) as caught:
        _ring_of(n, schedule=name).schedule_for(4096, wire)
    self.assertEqual((caught.exception.field, caught.exception.value),
                     ("schedule", name))
    self.assertIn(can, str(caught.exception))

  @parameterized.named_parameters(("unknown", "tree"), ("empty", ""),
                                  ("case", "Ring"), ("list", ["ring"]))
  def test_unknown_schedule_is_a_config_error(self, name):
    with self.assertRaises(tfdist.ConfigError) as caught:
      _ring_of(2, schedule=name)
    self.assertEqual(caught.exception.field, "schedule")
    self.assertEqual(caught.exception.value, name)
    self.assertIn(str(sorted(socket_ring.SCHEDULES)), str(caught.exception))


class PiecesTest(parameterized.TestCase):
  """`tfdist.ring.pieces`: spans of arrays read as their concatenation."""

  @parameterized.parameters(([5],), ([3, 0, 4, 1],), ([0, 0, 2, 0],),
                            ([1] * 7,), ([9, 16, 1000],))
  def test_views_cover_each_span_once_in_order(self, sizes):
    arrays = [np.arange(k, dtype=np.float32) + 100 * i
              for i, k in enumerate(sizes)]
    x = pieces.Pieces(arrays)
    whole = np.concatenate(arrays)
    self.assertEqual(x.size, whole.size)
    for lo in range(whole.size + 1):
      for hi in range(lo, min(whole.size, lo + 20) + 1):
        found = x.views(lo, hi)
        joined = (np.concatenate([v for _, v in found]) if found
                  else np.empty(0, np.float32))
        np.testing.assert_array_equal(joined, whole[lo:hi])
        self.assertEqual([at for at, _ in found],
                         list(np.cumsum([0] + [v.size for _, v in found])
                              [:-1]))
        if len(arrays) > 1:  # Views of the arrays themselves, no copies.
          for _, v in found:
            self.assertTrue(v.size and any(
                np.shares_memory(v, a) for a in arrays))


class WireTest(parameterized.TestCase):

  def test_layout_is_fixed(self):
    """Peers agree on bytes, not on Python objects: pin them."""
    token = wire_lib.ring_token("job/ring-0")
    self.assertEqual(token, wire_lib.ring_token("job/ring-0"))
    self.assertNotEqual(token, wire_lib.ring_token("job/ring-1"))
    nonce = bytes(range(16))
    hello = wire_lib.hello(token, 2, 3, nonce=nonce, signed=True)
    self.assertEqual(hello, struct.pack("!4sIIIB16s", b"TFDH", token, 2, 3,
                                        1, nonce))
    self.assertLen(hello, wire_lib.HELLO_SIZE)
    self.assertEqual(wire_lib.parse_hello(hello),
                     (token, 2, 3, True, nonce))
    self.assertIsNone(wire_lib.parse_hello(b"GET / HTTP/1.0\r\n\r\n"))
    self.assertEqual(wire_lib.header(5, 1000, "bfloat16", 7),
                     struct.pack("!4sQQII", b"TFDC", 5, 1000, 2, 7))
    self.assertLen(wire_lib.header(5, 1000, "bfloat16", 7),
                   wire_lib.HEADER_SIZE)
    self.assertEqual(wire_lib.header(0, 1, "float32", -1),
                     wire_lib.header(0, 1, "float32", 0xFFFFFFFF))

  def test_equal_headers_pass(self):
    sent = wire_lib.header(3, 10, "float16", 9)
    wire_lib.check_header(bytearray(sent), sent, source="left")

  @parameterized.named_parameters(
      ("call", wire_lib.header(4, 10, "float32", 0), "call #4, 10 values"),
      ("length", wire_lib.header(3, 11, "float32", 0), "call #3, 11 values"),
      ("wire", wire_lib.header(3, 10, "bfloat16", 0), "wire bfloat16"),
      ("tag", wire_lib.header(3, 10, "float32", 8), "tag 8"),
      ("unknown_wire", struct.pack("!4sQQII", b"TFDC", 3, 10, 9, 0),
       "wire 9, tag 0"),
  )
  def test_different_headers_name_both_calls(self, received, theirs):
    sent = wire_lib.header(3, 10, "float32", 0)
    with self.assertRaises(tfdist.ConfigError) as caught:
      wire_lib.check_header(bytearray(received), sent, source="worker:0 (h)")
    message = str(caught.exception)
    self.assertIn("all-reduce order", message)
    self.assertIn(theirs, message)
    self.assertIn("call #3, 10 values, wire float32, tag 0", message)
    self.assertIn("worker:0 (h)", message)

  @parameterized.parameters("float32", "float16", "bfloat16")
  def test_encode_rounds_once_and_decode_widens(self, name):
    values = _inputs(0, 1001)
    buffer = np.empty(1001, wire_lib.WIRE_DTYPES[name])
    view = wire_lib.encode(values, buffer)
    self.assertEqual(view.nbytes, 1001 * wire_lib.WIRE_DTYPES[name].itemsize)
    widened = np.empty(1001, np.float32)
    self.assertIs(wire_lib.decode(buffer, widened), widened)
    np.testing.assert_array_equal(
        widened, values.astype(wire_lib.WIRE_DTYPES[name]).astype(np.float32))
    np.testing.assert_allclose(widened, values, rtol=WIRE_RTOL[name])


# The connection.


def _members(rank, n, hosts=None):
  return connection.Members(rank=rank, hosts=tuple(hosts or ["127.0.0.1"] * n),
                            names=tuple(f"worker:{j}" for j in range(n)),
                            source="test")


def _join(members, rendezvous, timeout_s=STALL_S, secret=None):
  deadline = time.monotonic() + timeout_s
  listener = connection.listen(members)
  pair = connection.handshake(listener, members, rendezvous=rendezvous,
                              key="test", deadline=deadline,
                              timeout_s=timeout_s, secret=secret)
  return pair.left, pair.right


@pytest.mark.timeout(STALL_S * 5)
class ConnectionTest(parameterized.TestCase):

  def test_members_know_their_neighbours(self):
    members = _members(0, 3)
    self.assertEqual((members.size, members.left, members.right), (3, 2, 1))
    self.assertEqual(members.me, "worker:0")
    self.assertEqual(members.describe(2), "worker:2 (127.0.0.1)")
    alone = _members(0, 1)
    self.assertEqual((alone.left, alone.right), (0, 0))

  @parameterized.named_parameters(("above", 2), ("negative", -1))
  def test_rank_out_of_range_is_a_config_error(self, rank):
    with self.assertRaisesRegex(tfdist.ConfigError, "rank.*0 to 1"):
      _members(rank, 2)

  @parameterized.parameters(2, 3)
  def test_handshake_connects_each_rank_to_its_right_neighbour(self, n):
    rendezvous = LocalRendezvous()
    links = _on_each([_members(r, n) for r in range(n)],
                     lambda r, m: _join(m, rendezvous))
    try:
      for r, (_, right) in enumerate(links):
        right.sendall(bytes([r]))
      for r, (left, _) in enumerate(links):
        left.settimeout(5)
        self.assertEqual(left.recv(1), bytes([(r - 1) % n]))
    finally:
      for pair in links:
        for s in pair:
          s.close()

  def test_missing_neighbour_is_a_startup_timeout(self):
    members = _members(0, 2)
    listener = connection.listen(members)
    start = time.monotonic()
    with self.assertRaisesRegex(tfdist.StartupTimeoutError,
                                r"worker:0 waited 1 s for worker:1 "
                                r"\(127.0.0.1\) to publish its port"):
      connection.handshake(listener, members, rendezvous=LocalRendezvous(),
                           key="test", deadline=time.monotonic() + 1,
                           timeout_s=1)
    self.assertLess(stalls.running_since(start), 5)
    self.assertEqual(listener.fileno(), -1)  # Closed.

  def test_unresolvable_neighbour_is_a_config_error(self):
    rendezvous = LocalRendezvous()
    rendezvous.publish("test/1", "1")
    members = _members(0, 2, hosts=["127.0.0.1", "no-such-host.invalid"])
    with self.assertRaisesRegex(tfdist.ConfigError,
                                "address of worker:1.*no-such-host.invalid"):
      _join(members, rendezvous, timeout_s=5)


# The exchange.


def _tcp_pair():
  """Two connected loopback TCP sockets."""
  with socket.create_server(("127.0.0.1", 0)) as listener:
    a = socket.create_connection(listener.getsockname(), timeout=5)
    b, _ = listener.accept()
  return a, b


@pytest.mark.timeout(STALL_S * 3)
class ExchangeTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.sockets = []

  def tearDown(self):
    for s in self.sockets:
      s.close()
    super().tearDown()

  def _pair(self):
    pair = _tcp_pair()
    self.sockets.extend(pair)
    return pair

  @parameterized.named_parameters(("polled", exchange.THREADED_BYTES),
                                  ("threaded", 0))
  def test_a_ring_of_one_receives_what_it_sends_in_order(self, threaded):
    a, b = self._pair()
    link = exchange.Link(left=b, right=a, left_rank=0, right_rank=0,
                         timeout_s=5, threaded_bytes=threaded)
    payloads = [np.arange(k, dtype=np.float32) for k in (1, 3, 100_000)]
    events = []

    def send(i):
      events.append(f"send {i}")
      return wire_lib.as_bytes(payloads[i])

    buffers = [np.zeros_like(p) for p in payloads]
    link.exchange(
        [lambda i=i: send(i) for i in range(3)],
        [(wire_lib.as_bytes(buffers[0]), lambda: events.append("got 0"), 2),
         (wire_lib.as_bytes(buffers[1]), None, -1),
         (wire_lib.as_bytes(buffers[2]), lambda: events.append("got 2"), -1)])
    for got, sent in zip(buffers, payloads):
      np.testing.assert_array_equal(got, sent)
    # Buffer 0's callback waited for send 2, though its bytes came first.
    self.assertLess(events.index("send 2"), events.index("got 0"))
    self.assertIn("got 2", events)

  @parameterized.named_parameters(("polled", exchange.THREADED_BYTES),
                                  ("threaded", 0))
  def test_closed_left_neighbour_is_lost_at_once(self, threaded):
    right, _ = self._pair()
    peer, left = self._pair()
    link = exchange.Link(left=left, right=right, left_rank=1, right_rank=2,
                         timeout_s=60, threaded_bytes=threaded)
    peer.close()
    start = time.monotonic()
    with self.assertRaises(exchange.PeerLost) as caught:
      link.exchange([], [(bytearray(4), None, -1)])
    self.assertEqual(caught.exception.rank, 1)
    self.assertIn("closed the connection", caught.exception.what)
    self.assertLess(stalls.running_since(start), 5)

  @parameterized.named_parameters(("polled", exchange.THREADED_BYTES),
                                  ("threaded", 0))
  def test_silent_left_neighbour_times_out(self, threaded):
    right, _ = self._pair()
    _, left = self._pair()
    link = exchange.Link(left=left, right=right, left_rank=1, right_rank=2,
                         timeout_s=1, threaded_bytes=threaded)
    start = time.monotonic()
    with self.assertRaisesRegex(exchange.PeerLost, r"no data for 1 s"):
      link.exchange([], [(bytearray(4), None, -1)])
    self.assertLess(stalls.running_since(start), 4)


# The whole ring.


def _make_rings(n, rendezvous=None, **kwargs):
  rendezvous = rendezvous or LocalRendezvous()
  options = dict(connect_timeout_s=STALL_S, timeout_s=STALL_S,
                 block_bytes=BLOCK_BYTES)
  options.update(kwargs)
  # A key of its own: these rings are unauthenticated, and a member of an
  # earlier test's ring still reconnecting to a port the OS has handed out
  # again must not pass for a member of this one (the hello carries the key).
  key = f"test-{next(_RING_KEYS)}"
  return [perf.SocketRing(rank=i, hosts=["127.0.0.1"] * n,
                          names=[f"worker:{j}" for j in range(n)],
                          rendezvous=rendezvous, key=key, **options)
          for i in range(n)]


def _timed_loss(ring, data):
  """All-reduces ``data``: the `WorkerLostError` and its running time, or
  ``None`` when the call returned."""
  start = time.monotonic()
  try:
    ring.all_reduce(data)
  except tfdist.WorkerLostError as e:
    return e, stalls.running_since(start)
  return None


_RING_KEYS = itertools.count()


class _RingsTestCase(parameterized.TestCase):
  """Rings made by a test, closed after it."""

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


class ThreadsTest(_RingsTestCase):
  """A ring moves a large step with two threads only where its process has
  two cores of its own (`exchange.threaded_bytes`)."""

  def setUp(self):
    super().setUp()
    self.enter_context(mock.patch.dict("os.environ"))
    cpus = os.sched_getaffinity(0)
    self.addCleanup(os.sched_setaffinity, 0, cpus)  # This thread's only.

  @parameterized.named_parameters(
      ("launcher_share_1", "1", None, 1 << 62),
      ("launcher_share_2", "2", None, exchange.THREADED_BYTES),
      ("unset_one_core", None, {0}, 1 << 62),
      ("unset_two_cores", None, {0, 1}, exchange.THREADED_BYTES),
      ("not_a_count_one_core", "all", {0}, 1 << 62),
      ("zero_is_tensorflows_every_core", "0", {0, 1},
       exchange.THREADED_BYTES))
  def test_threaded_bytes_follows_the_cores_share(self, share, cpus,
                                                 expected):
    os.environ.pop("TF_NUM_INTRAOP_THREADS", None)
    if share is not None:
      os.environ["TF_NUM_INTRAOP_THREADS"] = share
    if cpus is not None:
      if cpus - os.sched_getaffinity(0):
        self.skipTest(f"this machine lets this process use cores "
                      f"{sorted(os.sched_getaffinity(0))}, not {sorted(cpus)}")
      os.sched_setaffinity(0, cpus)
    self.assertEqual(exchange.threaded_bytes(), expected)

  @parameterized.named_parameters(("one_core_share", "1", False),
                                  ("two_core_share", "2", True))
  def test_a_ring_made_without_threaded_bytes_follows_it(self, share,
                                                        threaded):
    os.environ["TF_NUM_INTRAOP_THREADS"] = share
    senders = lambda: {t.ident for t in threading.enumerate()
                       if t.name == "tfdist-ring-send"}
    before = senders()
    rings = self._rings(2)
    data = np.ones(2 * exchange.THREADED_BYTES // 4, np.float32)
    results = _on_each(rings, lambda r, ring: ring.all_reduce(data))
    np.testing.assert_array_equal(results[0], data * 2)
    self.assertEqual(bool(senders() - before), threaded)


@pytest.mark.timeout(STALL_S * 5)
class SocketRingTest(_RingsTestCase):

  @parameterized.product(n=[2, 3], wire=["float32", "float16", "bfloat16"],
                         threaded=[exchange.THREADED_BYTES, 0])
  def test_sums_every_size_the_same_on_every_rank(self, n, wire, threaded):
    rings = self._rings(n, threaded_bytes=threaded)
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

  @parameterized.product(n=[2, 3], wire=["float32", "float16", "bfloat16"],
                         threaded=[exchange.THREADED_BYTES, 0])
  def test_sums_in_place(self, n, wire, threaded):
    rings = self._rings(n, threaded_bytes=threaded)

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

  @parameterized.product(n=[2, 3], wire=["float32", "bfloat16"],
                         threaded=[exchange.THREADED_BYTES, 0])
  def test_a_list_sums_as_its_concatenation(self, n, wire, threaded):
    """Blocks of 1024 values span several arrays, and arrays several
    blocks; the sum has the bits of the concatenation's."""
    sizes = [3, 0, 1500, 1, 7000, 16, 20001, 2]
    rings = self._rings(n, threaded_bytes=threaded, schedule="ring")

    def fn(r, ring):
      data = [_inputs(r * 100 + i, k) for i, k in enumerate(sizes)]
      whole = ring.all_reduce(np.concatenate(data), wire=wire)
      listed = ring.all_reduce(data, wire=wire)
      in_place = [d.copy() for d in data]
      same = ring.all_reduce(in_place, wire=wire, out=in_place)
      return whole, listed, in_place, same

    for whole, listed, in_place, same in _on_each(rings, fn):
      self.assertEqual([a.size for a in listed], sizes)
      np.testing.assert_array_equal(np.concatenate(listed), whole)
      np.testing.assert_array_equal(np.concatenate(in_place), whole)
      self.assertTrue(all(a is b for a, b in zip(same, in_place)))

  @parameterized.parameters(1, 2, 3)
  def test_a_small_list_takes_doubling(self, n):
    rings = self._rings(n, schedule="doubling")
    results = _on_each(rings, lambda r, ring: ring.all_reduce(
        [_inputs(r, 5), _inputs(r + 10, 0), _inputs(r + 20, 9)]))
    expected = [sum(_inputs(r + k, s) for r in range(n))
                for k, s in ((0, 5), (10, 0), (20, 9))]
    for got in results:
      for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6)
    # Two ranks double over the ring's own connection; three over pairs of
    # their own, leaving the ring's unconnected (the ring would connect it).
    self.assertEqual(rings[0].connected, n == 2)

  def test_bad_out_list_is_a_config_error(self):
    ring, = self._rings(1)
    data = [np.ones(3, np.float32), np.ones(2, np.float32)]
    with self.assertRaisesRegex(tfdist.ConfigError, "a list of 2 arrays"):
      ring.all_reduce(data, out=[np.ones(5, np.float32)])
    with self.assertRaisesRegex(tfdist.ConfigError, "2 values"):
      ring.all_reduce(data, out=[np.ones(3, np.float32),
                                 np.ones(3, np.float32)])

  def test_large_steps_share_one_sending_thread_that_close_ends(self):
    before = set(threading.enumerate())
    rings = self._rings(2, threaded_bytes=0)  # Every step threaded.
    results = _on_each(rings, lambda r, ring: [
        ring.all_reduce(_inputs(r, 1001)) for _ in range(5)])
    np.testing.assert_array_equal(results[0], results[1])
    senders = [t for t in threading.enumerate()
               if t.name == "tfdist-ring-send" and t not in before]
    self.assertLen(senders, 2)  # One per ring, for all 10 steps of each.
    for ring in rings:
      ring.close()
    for t in senders:
      t.join(timeout=STALL_S)
      self.assertFalse(t.is_alive())

  def test_bad_out_is_a_config_error(self):
    ring, = self._rings(1)
    with self.assertRaisesRegex(tfdist.ConfigError, "out"):
      ring.all_reduce(np.ones(3, np.float32), out=np.ones(4, np.float32))

  def test_the_rule_measures_the_link_and_every_rank_picks_alike(self):
    sizes = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20]
    results = _on_each(self._rings(4), lambda r, ring: (
        ring.all_reduce(_inputs(r, 10)), ring.link,
        [ring.schedule_for(s) for s in sizes], ring.calls))
    assumed = dict(latency_s=socket_ring.DEFAULT_LATENCY_S,
                   bytes_per_s=socket_ring.DEFAULT_BYTES_PER_S)
    self.assertNotEqual(results[0][1], assumed)
    for _, link, picks, calls in results:
      self.assertEqual(link, results[0][1])  # The same bits on every rank.
      self.assertEqual(calls, 1)  # Measuring's all-reduces are not counted.
      self.assertEqual(picks, [socket_ring.choose(4, s, **link)
                               for s in sizes])

  def test_a_measurement_over_its_time_falls_back_to_the_assumed_link(self):
    with mock.patch.object(socket_ring, "_MEASURE_S", 0), self.assertLogs(
        "absl", "WARNING") as logs:
      results = _on_each(self._rings(3), lambda r, ring: (
          ring.all_reduce(_inputs(r, 10)), ring.link))
    for _, link in results:
      self.assertEqual(link, dict(latency_s=socket_ring.DEFAULT_LATENCY_S,
                                  bytes_per_s=socket_ring.DEFAULT_BYTES_PER_S))
    failed = [m for m in logs.output if "measuring the link" in m]
    self.assertLen(failed, 3)  # One line a rank, naming the hops.
    self.assertIn("worker:2 -> worker:0, worker:0 -> worker:1", failed[0])

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
      perf.SocketRing(rank=2, hosts=["a", "b"],
                      rendezvous=LocalRendezvous(), key="k")
    with self.assertRaisesRegex(tfdist.ConfigError, "timeout_s"):
      perf.SocketRing(rank=0, hosts=["a"], rendezvous=LocalRendezvous(),
                      key="k", timeout_s=0)

  def test_calls_out_of_order_fail_on_both_ranks(self):
    rings = self._rings(2)
    results = _on_each(rings, lambda r, ring: ring.all_reduce(
        np.ones(10 + r, np.float32)))
    for r, error in enumerate(results):
      self.assertIsInstance(error, tfdist.ConfigError)
      self.assertIn("all-reduce order", str(error))
      self.assertIn(f"worker:{1 - r}", str(error))

  @parameterized.named_parameters(("polled", exchange.THREADED_BYTES),
                                  ("threaded", 0))
  def test_closed_peer_is_named_at_once(self, threaded):
    rings = self._rings(2, timeout_s=60, threaded_bytes=threaded)

    def fn(r, ring):
      ring.connect()
      if r == 1:
        time.sleep(0.5)
        ring.close()  # Instead of all-reducing: like a process that exits.
        return None
      return _timed_loss(ring, np.ones(1 << 16, np.float32))

    (error, seconds), _ = _on_each(rings, fn)
    self.assertIn("worker:0 lost worker:1 (127.0.0.1)", str(error))
    self.assertIn("closed the connection", str(error))
    self.assertLess(seconds, 10)  # Not the 60 s timeout: noticed at once.
    with self.assertRaises(tfdist.WorkerLostError):  # Stays failed.
      rings[0].all_reduce(np.ones(3, np.float32))

  @parameterized.named_parameters(("polled", exchange.THREADED_BYTES),
                                  ("threaded", 0))
  def test_silent_peer_times_out(self, threaded):
    rings = self._rings(2, timeout_s=1, threaded_bytes=threaded)

    def fn(r, ring):
      ring.connect()
      if r == 1:
        time.sleep(4)  # Connected, but never all-reduces.
        return None
      return _timed_loss(ring, np.ones(100, np.float32))

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
    self.assertLess(stalls.running_since(start), 5)
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



@pytest.mark.timeout(STALL_S * 5)
class DoublingRingTest(_RingsTestCase):
  """`SocketRing` choosing recursive doubling for small float32 buffers."""

  @parameterized.parameters(2, 3, 4, 5, 6)
  def test_doubling_sums_as_the_ring_does(self, n):
    rings = self._rings(n, schedule="doubling")
    plain = _make_rings(n, schedule="ring")
    self.rings += plain
    sizes = [1, 7, 1001, 20001]

    def fn(r, pair):
      doubled, ringed = pair
      out = [doubled.all_reduce(_inputs(r, s)) for s in sizes]
      data = _inputs(r, 1001)
      same = doubled.all_reduce(data, out=data)  # In place.
      return out, [ringed.all_reduce(_inputs(r, s)) for s in sizes], (
          same is data, data, doubled.calls, ringed.connected)

    results = _on_each(list(zip(rings, plain)), fn)
    for r, (doubled, ringed, (in_place, data, calls, connected)) in (
        enumerate(results)):
      for i, size in enumerate(sizes):
        np.testing.assert_array_equal(doubled[i], results[0][0][i])
        np.testing.assert_allclose(doubled[i], ringed[i], rtol=0,
                                   atol=1e-5 * n)
        self.assertEqual(doubled[i].shape, (size,))
      self.assertTrue(in_place)
      np.testing.assert_array_equal(data, doubled[sizes.index(1001)])
      self.assertEqual(calls, len(sizes) + 1)
      self.assertTrue(connected)
    if n > 2:  # Partners of their own; the ring's connections unused.
      self.assertFalse(rings[0].connected)

  def test_lost_partner_fails_every_rank_and_stays_failed(self):
    rings = self._rings(4, schedule="doubling", timeout_s=60)

    def fn(r, ring):
      ring.all_reduce(np.ones(10, np.float32))  # Every partner connected.
      if r == 3:
        ring.close()  # Like a process that exits.
        return None
      return _timed_loss(ring, np.ones(10, np.float32))

    results = _on_each(rings, fn)
    for r in (1, 2):  # Rank 3's partners name it.
      error, seconds = results[r]
      self.assertIn(f"worker:{r} lost worker:3", str(error))
      self.assertLess(seconds, 30)  # Not the 60 s timeout.
    self.assertIsInstance(results[0][0], tfdist.WorkerLostError)
    for r in (0, 1, 2):
      self.assertIs(rings[r].failure, results[r][0])
      with self.assertRaises(tfdist.WorkerLostError):  # Stays failed.
        rings[r].all_reduce(np.ones(3, np.float32))



@pytest.mark.timeout(STALL_S * 5)
class HalvingRingTest(_RingsTestCase):
  """`SocketRing` with recursive halving and doubling (`halving`)."""

  @parameterized.product(n=[2, 3, 4, 5, 8],
                         threaded=[exchange.THREADED_BYTES, 0])
  def test_halving_sums_the_same_bits_on_every_rank(self, n, threaded):
    rings = self._rings(n, schedule="halving", threaded_bytes=threaded)
    sizes = [1, 2, n - 1, 7, 1001, 20001, (1 << 16) + 3]  # Some below n.
    listed = [3, 0, 1500, 1, 7000]  # Blocks of 1024 values span arrays.

    def fn(r, ring):
      out = [ring.all_reduce(_inputs(r, s)) for s in sizes]
      data = _inputs(r, 20001)
      same = ring.all_reduce(data, out=data)  # In place.
      parts = [_inputs(r * 100 + i, k) for i, k in enumerate(listed)]
      whole = ring.all_reduce(np.concatenate(parts))
      return out, (same is data, data), ring.all_reduce(parts), whole

    results = _on_each(rings, fn)
    for out, (in_place, data), parts, whole in results:
      for i, size in enumerate(sizes):
        np.testing.assert_array_equal(out[i], results[0][0][i])
        expected = sum(_inputs(r, size).astype(np.float64)
                       for r in range(n))
        np.testing.assert_allclose(out[i], expected, rtol=0,
                                   atol=1e-6 * n * np.max(np.abs(expected)))
      self.assertTrue(in_place)
      np.testing.assert_array_equal(data, out[sizes.index(20001)])
      self.assertEqual([a.size for a in parts], listed)
      np.testing.assert_array_equal(np.concatenate(parts), whole)
      np.testing.assert_array_equal(whole, results[0][3])
    # Two ranks halve over the ring's own connection; more over pairs.
    self.assertEqual(rings[0].connected, n == 2)

  def test_the_rule_takes_halving_for_middle_sizes_at_8_ranks(self):
    rings = self._rings(8)
    data_bytes = 256 << 10
    self.assertEqual(rings[0].schedule_for(data_bytes), "halving")
    results = _on_each(rings, lambda r, ring: ring.all_reduce(
        _inputs(r, data_bytes // 4)))
    for got in results:
      np.testing.assert_array_equal(got, results[0])
    np.testing.assert_allclose(
        results[0], sum(_inputs(r, data_bytes // 4).astype(np.float64)
                        for r in range(8)), rtol=0, atol=1e-5)
    self.assertTrue(rings[0].connected)  # The rule measured its link.

  def test_a_new_schedule_is_one_module_and_one_row(self):
    with mock.patch.dict(socket_ring.SCHEDULES, two_only=_TwoOnly):
      rings = self._rings(2, schedule="two_only")
      results = _on_each(rings, lambda r, ring: ring.all_reduce(
          [_inputs(r, 3000), _inputs(r + 10, 2000)]))
    for got in results:
      for a, b in zip(got, results[0]):
        np.testing.assert_array_equal(a, b)
      np.testing.assert_allclose(got[0], _inputs(0, 3000) + _inputs(1, 3000))

  def test_a_forced_schedule_refuses_a_wire_it_cannot_carry(self):
    rings = self._rings(4, schedule="halving")

    def fn(r, ring):
      with self.assertRaisesRegex(tfdist.ConfigError, r"float16.*\['ring'\]"):
        ring.all_reduce(_inputs(r, 100), wire="float16")
      return ring.all_reduce(_inputs(r, 100))  # The ring is not torn.

    for got in _on_each(rings, fn):
      np.testing.assert_allclose(got, sum(_inputs(r, 100) for r in range(4)),
                                 atol=1e-5)

  @parameterized.named_parameters(("four", 4, 3), ("five", 5, 4),
                                  ("eight", 8, 5))
  def test_lost_partner_fails_every_rank(self, n, lost):
    rings = self._rings(n, schedule="halving", timeout_s=60)

    def fn(r, ring):
      ring.all_reduce(np.ones(1000, np.float32))  # Every partner connected.
      if r == lost:
        ring.close()  # Like a process that exits.
        return None
      return _timed_loss(ring, np.ones(1000, np.float32))

    results = _on_each(rings, fn)
    for r, result in enumerate(results):
      if r == lost:
        continue
      error, seconds = result
      self.assertIsInstance(error, tfdist.WorkerLostError)
      self.assertLess(seconds, 30)  # Not the 60 s timeout.
      self.assertIs(rings[r].failure, error)
    partner = halving.plan(lost, n, 1000)[0].to
    self.assertIn(f"worker:{partner} lost worker:{lost}",
                  str(results[partner][0]))


if __name__ == "__main__":
  absltest.main()
