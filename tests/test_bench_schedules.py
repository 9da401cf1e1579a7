"""The latency relay (`tfdist.bench.relay`)."""

import socket
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist.bench import relay as relay_lib


def _echo(server: socket.socket) -> None:
  """Sends back what one connection sends, until it closes."""
  conn, _ = server.accept()
  with conn:
    while True:
      data = conn.recv(1 << 16)
      if not data:
        return
      conn.sendall(data)


@pytest.mark.timeout(60)
class RelayTest(parameterized.TestCase):

  def _through_relay(self, delay_s: float):
    """A client connected through a relay to an echo server."""
    server = socket.create_server(("127.0.0.1", 0))
    self.addCleanup(server.close)
    echo = threading.Thread(target=_echo, args=(server,), daemon=True)
    echo.start()
    relay = relay_lib.Relay("127.0.0.1", timeout_s=30)
    self.addCleanup(relay.close)
    port = relay.forward(server.getsockname()[1], delay_s)
    self.assertNotEqual(port, server.getsockname()[1])
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    self.addCleanup(client.close)
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    incoming = client.makefile("rb")  # read(n): n bytes, or up to the end.
    self.addCleanup(incoming.close)
    return client, incoming, echo

  @parameterized.named_parameters(("no_delay", 0.0), ("25us", 25e-6),
                                  ("250us", 250e-6))
  def test_each_way_is_held_the_delay_and_data_arrive_intact(self, delay_s):
    client, incoming, echo = self._through_relay(delay_s)
    trips = []
    for i in range(20):
      message = f"token {i:04d}".encode()
      start = time.perf_counter()
      client.sendall(message)
      self.assertEqual(incoming.read(len(message)), message)
      trips.append(time.perf_counter() - start)
    # Out through the relay and back through it: held once each way.
    self.assertGreaterEqual(min(trips), 2 * delay_s)
    client.shutdown(socket.SHUT_WR)  # The close is passed on, both ways.
    self.assertEqual(incoming.read(1), b"")
    echo.join(10)
    self.assertFalse(echo.is_alive())

  def test_many_chunks_in_flight_keep_their_order(self):
    client, incoming, _ = self._through_relay(250e-6)
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(200)]
    got: list[bytes] = []
    reader = threading.Thread(
        target=lambda: got.append(incoming.read(sum(map(len, chunks)))),
        daemon=True)
    reader.start()
    for chunk in chunks:  # Without waiting: many held at once.
      client.sendall(chunk)
    reader.join(30)
    self.assertEqual(got, [b"".join(chunks)])

  def test_a_port_nobody_listens_on_closes_the_relayed_connection(self):
    spare = socket.create_server(("127.0.0.1", 0))
    port = spare.getsockname()[1]
    spare.close()
    with relay_lib.Relay("127.0.0.1", timeout_s=30) as relay:
      relayed = relay.forward(port, 0.0)
      with socket.create_connection(("127.0.0.1", relayed),
                                    timeout=30) as client:
        try:
          self.assertEqual(client.recv(1), b"")
        except ConnectionResetError:
          pass  # Closed either way: no link without its far end.


if __name__ == "__main__":
  absltest.main()
