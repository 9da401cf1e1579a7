"""Who may join the socket ring, and what a stranger can do to it.

Rings of threads over real loopback sockets, as tests/test_ring.py runs
them, with strangers: a wrong secret, a recorded hello replayed, one that
connects first and stalls, port scanners, a relay that alters values after
start-up; and the ring's ports and address.
"""

import ipaddress
import os
import socket
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

import stalls
import tfdist
from tfdist import _process
from tfdist import _secret
from tfdist import perf
from tfdist.ring import connection
from tfdist.ring import exchange
from tfdist.ring import socket_ring
from tfdist.ring import wire as wire_lib
from test_ring import STALL_S
from test_ring import LocalRendezvous
from test_ring import _members
from test_ring import _on_each

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.

SECRET = b"the job's secret"
KEY = "test"


def _rings(n, rendezvous, **kwargs):
  options = dict(connect_timeout_s=STALL_S, timeout_s=STALL_S,
                 block_bytes=4096, secret=SECRET)
  options.update(kwargs)
  return [perf.SocketRing(rank=i, hosts=["127.0.0.1"] * n,
                          names=[f"worker:{j}" for j in range(n)],
                          rendezvous=rendezvous, key=KEY, **options)
          for i in range(n)]


def _sum_of_ranks(rings, size=5000):
  """Each rank all-reduces ``rank + 1``; the results."""
  try:
    return _on_each(rings, lambda r, ring: ring.all_reduce(
        np.full(size, r + 1.0, np.float32)))
  finally:
    for ring in rings:
      ring.close()


def _until_closed(sock, timeout=15):
  """Reads ``sock`` until the other side closes it; all that came."""
  sock.settimeout(timeout)
  data = b""
  while True:
    try:
      chunk = sock.recv(4096)
    except ConnectionResetError:
      return data
    if not chunk:
      return data
    data += chunk


def _stranger_hello(rank=1, size=2, signed=True):
  return wire_lib.hello(wire_lib.ring_token(KEY), rank, size,
                        nonce=_secret.nonce(), signed=signed)


class Strangers:
  """Connections a test opens to ranks as they publish, closed at the end."""

  def __init__(self, on_port):
    self.sockets = []
    self.threads = []
    self._on_port = on_port
    self.rendezvous = LocalRendezvous(self._published)

  def background(self, fn, *args):
    """Runs ``fn`` in a thread: the rank publishing waits for nothing."""
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    self.threads.append(thread)

  def _published(self, key, value):
    self._on_port(self, int(key.rsplit("/", 1)[1]), int(value))

  def connect(self, port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    self.sockets.append(s)
    return s

  def close(self):
    for thread in self.threads:
      thread.join(30)
    for s in self.sockets:
      s.close()


@pytest.mark.timeout(STALL_S * 5)
class StrangerTest(parameterized.TestCase):

  def _run(self, on_port, n=2, rendezvous=None, **kwargs):
    strangers = Strangers(on_port)
    if rendezvous is not None:
      strangers.rendezvous = rendezvous(strangers)
    try:
      results = _sum_of_ranks(_rings(n, strangers.rendezvous, **kwargs))
    finally:
      strangers.close()
    expected = n * (n + 1) / 2
    for got in results:
      self.assertIsInstance(got, np.ndarray, got)
      np.testing.assert_array_equal(got, np.full(5000, expected))
    return strangers

  def test_wrong_secret_is_dropped_and_its_values_never_summed(self):
    answered = []

    def on_port(strangers, rank, port):
      if rank != 0:
        return
      s = strangers.connect(port)  # Claims to be worker:1, before it.
      hello = _stranger_hello()
      s.sendall(hello)

      def go_on():
        answer = s.recv(wire_lib.HELLO_SIZE + _secret.MAC_SIZE)
        s.sendall(_secret.mac(b"a guess", _secret.DIAL, KEY, hello,
                           answer[:wire_lib.HELLO_SIZE])
                  + wire_lib.header(0, 5000, "float32", 0)
                  + np.full(5000, 1e6, np.float32).tobytes()[:4000])
        answered.append(_until_closed(s))

      strangers.background(go_on)

    self._run(on_port)  # Sums 1 + 2 = 3 everywhere: never the 1e6.
    self.assertEqual(answered, [b""])  # Closed without a byte more.

  def test_replayed_hello_is_dropped(self):
    recorded = []

    class Relay:
      """Forwards one connection to ``port``, recording what the dialer sent."""

      def __init__(self, port):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, args=(port,), daemon=True).start()

      def _serve(self, port):
        a, _ = self.listener.accept()
        b = socket.create_connection(("127.0.0.1", port))
        head = b""
        while len(head) < wire_lib.HELLO_SIZE + _secret.MAC_SIZE:
          if len(head) == wire_lib.HELLO_SIZE:
            b_answer = b.recv(wire_lib.HELLO_SIZE + _secret.MAC_SIZE)
            a.sendall(b_answer)
          chunk = a.recv(wire_lib.HELLO_SIZE + _secret.MAC_SIZE - len(head))
          if not chunk:
            return
          head += chunk
          b.sendall(chunk)
        recorded.append(head)
        threading.Thread(target=_pump, args=(b, a), daemon=True).start()
        _pump(a, b)

    class Recording(LocalRendezvous):

      def publish(self, key, value):
        if key.endswith("/0"):
          value = str(Relay(int(value)).port)
        super().publish(key, value)

    np.testing.assert_array_equal(
        _sum_of_ranks(_rings(2, Recording()))[0], np.full(5000, 3.0))
    self.assertLen(recorded, 1)
    replies = []

    def on_port(strangers, rank, port):
      if rank == 0:  # The recorded hello and proof, first, to a new ring.
        s = strangers.connect(port)
        s.sendall(recorded[0])
        strangers.background(lambda: replies.append(_until_closed(s)))

    self._run(on_port)
    self.assertLen(replies[0], wire_lib.HELLO_SIZE + _secret.MAC_SIZE)

  @parameterized.named_parameters(
      ("silent", b""),
      ("half_hello", b"TFDH\x00\x01"),
      ("http", b"GET / HTTP/1.0\r\n\r\n"),
  )
  def test_stranger_connecting_first_and_stalling(self, payload):
    start = time.monotonic()

    def on_port(strangers, rank, port):
      if rank == 0:  # Before worker:1 dials; holds the connection open.
        strangers.connect(port).sendall(payload)

    # Before: worker:0 read the stranger alone for min(bound, 10 s) and
    # failed with StartupTimeoutError; now both connect within the bound.
    self._run(on_port, connect_timeout_s=5)
    self.assertLess(stalls.running_since(start), 5)

  @parameterized.named_parameters(("two", 2), ("three", 3))
  def test_port_scanner_during_start_up(self, n):
    rng = np.random.default_rng(0)

    scanned = []

    class Scanned(LocalRendezvous):
      """A port is published once a scanner has been through it.

      The scan runs beside the rank, which accepts strangers as they come
      (a scanner is another program: it holds nobody up), and ends before
      the left neighbour can find the port, so it falls in start-up.
      """

      def __init__(self, strangers):
        super().__init__()
        self.strangers = strangers

      def publish(self, key, value):
        rank, port = int(key.rsplit("/", 1)[1]), int(value)
        hello = _stranger_hello(rank=(rank - 1) % n, size=n)
        # Connect and close, random bytes, half and whole hellos.
        payloads = [p for _ in range(10) for p in (
            b"", rng.bytes(int(rng.integers(1, 200))), hello[:20], hello)]

        def scan():
          for payload in payloads:
            s = self.strangers.connect(port)
            if payload:
              s.sendall(payload)
            else:
              s.close()
          scanned.append(rank)
          super(Scanned, self).publish(key, value)

        self.strangers.background(scan)

    # The ring's own ports only: no partners' (which the rule may take).
    strangers = self._run(None, n=n, rendezvous=Scanned, schedule="ring")
    self.assertCountEqual(scanned, range(n))
    self.assertLen(strangers.sockets, 40 * n)

  def test_flood_of_connections_beyond_the_limit(self):
    flooded = threading.Event()

    def flood(strangers, port):
      for _ in range(_secret.most_unproven() + 20):
        strangers.connect(port)
      flooded.set()

    def on_port(strangers, rank, port):
      if rank == 0:  # More than the listener holds: accepted as they come.
        strangers.background(flood, strangers, port)
      else:  # worker:1 dials once the flood is in.
        flooded.wait(30)

    self._run(on_port)

  def test_mismatched_secrets_name_the_variable(self):
    rendezvous = LocalRendezvous()
    rings = [perf.SocketRing(rank=i, hosts=["127.0.0.1"] * 2,
                             rendezvous=rendezvous, key=KEY,
                             connect_timeout_s=2, secret=secret)
             for i, secret in enumerate([SECRET, b"another secret"])]
    results = _sum_of_ranks(rings)
    for error in results:
      self.assertIsInstance(error, tfdist.StartupTimeoutError)
      self.assertIn("without the job's secret", str(error))


def _pump(src, dst, tamper_at=None):
  """Copies ``src`` to ``dst`` until either closes; flips byte ``tamper_at``."""
  seen = 0
  try:
    while True:
      chunk = bytearray(src.recv(65536))
      if not chunk:
        break
      if tamper_at is not None and seen <= tamper_at < seen + len(chunk):
        chunk[tamper_at - seen] ^= 0x40
      seen += len(chunk)
      dst.sendall(chunk)
  except OSError:
    pass
  finally:
    for s in (src, dst):
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass


@pytest.mark.timeout(STALL_S * 5)
class TamperTest(parameterized.TestCase):
  """A relay between worker:1 and worker:0 alters one byte after start-up."""

  def _tampered(self, tamper_at, **kwargs):
    class Tampering(LocalRendezvous):

      def publish(self, key, value):
        if key.endswith("/0"):
          listener = socket.create_server(("127.0.0.1", 0))

          def serve(port=int(value)):
            a, _ = listener.accept()
            b = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=_pump, args=(b, a), daemon=True).start()
            _pump(a, b, tamper_at)

          threading.Thread(target=serve, daemon=True).start()
          value = str(listener.getsockname()[1])
        super().publish(key, value)

    return _sum_of_ranks(_rings(2, Tampering(), **kwargs), size=50_000)

  @parameterized.named_parameters(
      ("header", 0, "all-reduce order", exchange.THREADED_BYTES),
      ("values", 1000, "failed its authentication", exchange.THREADED_BYTES),
      ("values_threaded", 1000, "failed its authentication", 0))
  def test_altered_message_fails_the_call_and_is_never_returned(
      self, offset, why, threaded):
    start = wire_lib.HELLO_SIZE + _secret.MAC_SIZE  # After the dialer's hello.
    results = self._tampered(start + offset, authenticate_values=True,
                             threaded_bytes=threaded, schedule="ring")
    for got in results:  # No sum returned anywhere.
      self.assertIsInstance(got, tfdist.TfdistError, got)
    self.assertIn(why, str(results[0]))
    self.assertIn("worker:1", str(results[0]))

  @parameterized.named_parameters(
      ("header", 0, "all-reduce order"),
      ("values", 1000, "failed its authentication"))
  def test_altered_message_under_recursive_doubling(self, offset, why):
    # One exchange each way: worker:0, which received the altered bytes,
    # fails; worker:1 received worker:0's bytes untouched, so it may return
    # the true sum before it learns, never one computed from altered bytes.
    start = wire_lib.HELLO_SIZE + _secret.MAC_SIZE
    first, second = self._tampered(start + offset, authenticate_values=True,
                                   schedule="doubling")
    self.assertIsInstance(first, tfdist.TfdistError, first)
    self.assertIn(why, str(first))
    self.assertIn("worker:1", str(first))
    if not isinstance(second, tfdist.TfdistError):
      np.testing.assert_array_equal(second, np.full(50_000, 3.0))

  @parameterized.named_parameters(("polled", exchange.THREADED_BYTES),
                                  ("threaded", 0))
  def test_untouched_relay_sums(self, threaded):
    results = self._tampered(None, authenticate_values=True,
                             threaded_bytes=threaded)
    for got in results:
      np.testing.assert_array_equal(got, np.full(50_000, 3.0))

  @parameterized.named_parameters(
      (name, name) for name in socket_ring.SCHEDULES)
  def test_every_schedule_sums_authenticated_values(self, name):
    # Four ranks: doubling and halving run on partners' rings of two,
    # each with its own keys and tags.
    results = _sum_of_ranks(_rings(4, LocalRendezvous(), schedule=name,
                                   authenticate_values=True))
    for got in results:
      np.testing.assert_array_equal(got, np.full(5000, 10.0))

  def test_values_need_a_secret(self):
    with self.assertRaisesRegex(tfdist.ConfigError, "authenticate_values"):
      perf.SocketRing(rank=0, hosts=["127.0.0.1"] * 2,
                      rendezvous=LocalRendezvous(), key=KEY, secret=b"",
                      authenticate_values=True)


BAD_PORTS = [
    ("word", "abc"),
    ("reversed", "20010-20000"),
    ("zero", "0"),
    ("above_65535", "70000"),
    ("three_parts", "1-2-3"),
    ("open_ended", "20000-"),
    ("negative", "-5"),
    ("spaces_inside", "20 000"),
]


@pytest.mark.timeout(STALL_S * 3)
class PortsTest(parameterized.TestCase):

  def test_range_is_honoured(self):
    first = socket.create_server(("127.0.0.1", 0))
    base = first.getsockname()[1]  # Taken: the ring must skip it.
    try:
      rendezvous = LocalRendezvous()
      rings = _rings(2, rendezvous, ports=f"{base}-{base + 40}")
      results = _sum_of_ranks(rings)
    finally:
      first.close()
    np.testing.assert_array_equal(results[0], np.full(5000, 3.0))
    for rank in range(2):
      self.assertBetween(int(rendezvous.lookup(f"{KEY}/{rank}", 1)),
                         base + 1, base + 40)

  def test_environment_variable_is_read(self):
    self.assertEqual(connection.ring_ports(
        None, source="x", environ={"TFDIST_RING_PORTS": "20000-20100"}),
                     range(20000, 20101))
    self.assertIsNone(connection.ring_ports(None, source="x", environ={}))

  @parameterized.named_parameters(*BAD_PORTS)
  def test_bad_range_is_a_config_error(self, text):
    with self.assertRaisesRegex(tfdist.ConfigError,
                                r"ports: received .*FIRST-LAST"):
      perf.SocketRing(rank=0, hosts=["127.0.0.1"] * 2,
                      rendezvous=LocalRendezvous(), key=KEY, ports=text)
    with self.assertRaisesRegex(tfdist.ConfigError, "TFDIST_RING_PORTS"):
      connection.ring_ports(None, source="x",
                            environ={"TFDIST_RING_PORTS": str(text)})
    with self.assertRaisesRegex(tfdist.ConfigError, "socket_ports"):
      perf.GradientOptions(transport="socket", socket_ports=text)

  @hypothesis.settings(max_examples=200, deadline=None)
  @hypothesis.given(st.text(alphabet="0123456789- x", max_size=14))
  def test_any_text_is_a_range_or_a_config_error(self, text):
    try:
      ports = connection.ring_ports(text, source="x")
    except tfdist.ConfigError as e:
      self.assertIn("ports: received", str(e))
      return
    self.assertTrue(1 <= ports.start < ports.stop <= 65536, (text, ports))

  def test_exhausted_range_is_a_config_error(self):
    taken = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    try:
      port = taken[0].getsockname()[1]
      ring = perf.SocketRing(rank=0, hosts=["127.0.0.1"] * 2,
                             rendezvous=LocalRendezvous(), key=KEY,
                             ports=str(port), connect_timeout_s=2)
      with self.assertRaisesRegex(
          tfdist.ConfigError, rf"ports: received '{port}-{port}'.*a range "
          r"with a free port on 127.0.0.1.*widen"):
        ring.connect()
    finally:
      for s in taken:
        s.close()


@pytest.mark.timeout(STALL_S * 3)
class AddressTest(parameterized.TestCase):

  def test_listens_on_its_own_address(self):
    listener = connection.listen(_members(0, 2, hosts=["127.0.0.2"] * 2))
    with listener:
      self.assertEqual(listener.getsockname()[0], "127.0.0.2")

  def _listens_everywhere(self, hosts, why):
    """``listen`` falls back to every interface, says ``why``, takes IPv4."""
    with self.assertLogs("absl", "WARNING") as logs:
      listener = connection.listen(_members(0, 2, hosts=hosts))
    with listener:
      self.assertIn(listener.getsockname()[0], ("::", "0.0.0.0"))
      with socket.create_connection(
          ("127.0.0.1", listener.getsockname()[1]), timeout=5):
        accepted, _ = listener.accept()  # An IPv6 listener takes IPv4 too.
        accepted.close()
    said = "\n".join(logs.output)
    self.assertIn("listens on every interface", said)
    self.assertIn(why, said)

  def test_foreign_address_listens_everywhere_and_says_so(self):
    self._listens_everywhere(["192.0.2.1", "192.0.2.2"],  # TEST-NET.
                             "192.0.2.1 is not one of this host's")

  def test_name_resolving_to_loopback_listens_everywhere(self):
    # Debian maps a host's own name to a loopback address (SLURM node names
    # here); peers could not reach a listener there.
    name = socket.gethostname()
    address = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)[0][4][0]
    if not ipaddress.ip_address(address).is_loopback:
      self.skipTest(f"{name} resolves to {address} here, not to loopback")
    self._listens_everywhere([name, name],
                             f"{name} resolves to {address} here")

  def test_no_secret_warns_once_and_still_works(self):
    _process._counters.pop(("once", "unauthenticated ring"), None)
    with self.assertLogs("absl", "WARNING") as logs:
      results = _sum_of_ranks(_rings(2, LocalRendezvous(), secret=None))
    np.testing.assert_array_equal(results[1], np.full(5000, 3.0))
    warnings = [m for m in logs.output if "unauthenticated" in m]
    self.assertLen(warnings, 1)
    self.assertIn("TFDIST_JOB_SECRET", warnings[0])

  def test_secret_from_the_environment(self):
    old = os.environ.get("TFDIST_JOB_SECRET")
    os.environ["TFDIST_JOB_SECRET"] = "from the environment"
    try:
      env_ring = _rings(2, LocalRendezvous(), secret=None)
    finally:
      if old is None:
        del os.environ["TFDIST_JOB_SECRET"]
      else:
        os.environ["TFDIST_JOB_SECRET"] = old
    self.assertEqual(env_ring[0]._secret, b"from the environment")

  def test_secret_is_not_in_the_options_repr(self):
    options = perf.GradientOptions(transport="socket", socket_secret="hush")
    self.assertNotIn("hush", repr(options))


if __name__ == "__main__":
  absltest.main()
