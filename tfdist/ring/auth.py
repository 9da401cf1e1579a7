"""Who may join a ring, and values nobody altered on the way.

**Members** prove they hold the job's secret (`tfdist._net.job_secret`, or
``SocketRing(secret=...)``) by challenge and response, HMAC-SHA256, on every
connection (`tfdist.ring.connection` runs it):

1. the dialer sends its hello with a fresh nonce, ``D``;
2. the acceptor answers with its own hello and fresh nonce, ``A``, and
   ``mac(secret, "accept", key, D, A)``;
3. the dialer checks that and sends ``mac(secret, "dial", key, D, A)``.

Each side's MAC covers the other side's fresh nonce, so a recorded hello or
answer does not pass twice; the role labels keep one side's MAC from serving
as the other's; ``key`` (the ring's) keeps one ring's from another's. Both
derive the connection's own key, ``mac(secret, "values", key, D, A)``.

**Values** (``authenticate_values=True``): every step of a call ends with an
HMAC-SHA256 tag, under the connection's key and the step's number, of
everything sent in it (header and values); the receiver checks it before
anything computed from the step is sent on or returned.

Without a secret the same handshake runs with an empty key: it checks the
ring, ranks and order as before, but proves nothing, and the ring logs once
that it is unauthenticated.

Example::

  d = wire.hello(token, 1, 2, nonce=auth.nonce(), signed=True)
  tag = auth.mac(secret, auth.ACCEPT, key, d, a)
"""

from __future__ import annotations

import hashlib
import hmac

from tfdist._secret import ACCEPT, DIAL, VALUES, MAC_SIZE, NONCE_SIZE  # pylint: disable=unused-import
from tfdist._secret import mac, nonce  # pylint: disable=unused-import
from tfdist.ring import exchange

__all__ = ["ACCEPT", "DIAL", "VALUES", "MAC_SIZE", "NONCE_SIZE", "nonce",
           "mac", "Sealer"]

class Sealer:
  """Tags each step's bytes to the right and checks the left's tags.

  Args:
    send_key: the key of the connection to the right neighbour.
    recv_key: the key of the connection from the left neighbour.
    left_rank: the left neighbour's rank, named when a tag is wrong.
  """

  def __init__(self, *, send_key: bytes, recv_key: bytes, left_rank: int):
    self._keys = (send_key, recv_key)
    self._left_rank = left_rank
    self._step = 0

  def seal(self, sends: exchange.Sends,
           recvs: exchange.Recvs) -> tuple[exchange.Sends, exchange.Recvs]:
    """``sends`` and ``recvs`` of one step, each followed by its tag."""
    step = self._step.to_bytes(8, "big")
    self._step += 1
    out, into = (hmac.new(k, step, hashlib.sha256) for k in self._keys)
    tag = bytearray(MAC_SIZE)

    def signed(produce):
      def send():
        data = produce()
        out.update(data)
        return data
      return send

    def hashed(buffer, done):
      def on_full():
        into.update(buffer)
        if done is not None:
          done()
      return on_full

    def check():
      if not hmac.compare_digest(into.digest(), bytes(tag)):
        raise exchange.PeerLost(
            self._left_rank, "a message failed its authentication (altered "
            "on the way, or not sent by that worker); nothing computed "
            "from it was sent on or returned")

    return ([signed(f) for f in sends] + [out.digest],
            [(b, hashed(b, done), after) for b, done, after in recvs]
            + [(tag, check, -1)])
