"""Values nobody altered on the way (``authenticate_values=True``).

Who may join a ring is the job's gate's (`tfdist._secret`): every connection
proves the job's secret (`tfdist._net.job_secret`, or
``SocketRing(secret=...)``) and yields its own key. Without a secret the same
handshake runs with an empty key: it checks the ring, ranks and order, but
proves nothing, and the ring logs once that it is unauthenticated.

With ``authenticate_values=True`` every step of a call ends with an
HMAC-SHA256 tag, under the connection's key and the step's number, of
everything sent in it (header and values); the receiver checks it before
anything computed from the step is sent on or returned.

Example::

  sealer = Sealer(send_key=pair.right_key, recv_key=pair.left_key,
                  left_rank=members.left)
  sends, recvs = sealer.seal(sends, recvs)
"""

from __future__ import annotations

import hashlib
import hmac

from tfdist._secret import MAC_SIZE
from tfdist.ring import exchange

__all__ = ["Sealer"]


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
