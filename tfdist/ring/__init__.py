"""tfdist's ring all-reduce over TCP sockets (the ``socket`` transport).

One module per seam, each testable alone:

* `schedule`: which elements each rank sends, receives and adds at each
  step of the reduce-scatter and the all-gather (pure functions);
* `doubling`: recursive doubling's partners, step by step, for small
  buffers (pure functions);
* `pieces`: a list of arrays read as their concatenation, never made (a
  model's gradients, summed as one buffer without packing them);
* `wire`: what crosses the sockets: hellos, call headers, encoded values;
* `auth`: values' tags (who joins: the job's gate, `tfdist._secret`);
* `connection`: the ring's members, listening and the hello exchange;
* `exchange`: one step's blocks moved both ways over non-blocking sockets;
* `socket_ring`: `SocketRing`, composing them.
"""

from tfdist.ring.connection import Rendezvous
from tfdist.ring.socket_ring import DEFAULT_BLOCK_BYTES
from tfdist.ring.socket_ring import SocketRing
from tfdist.ring.wire import WIRE_DTYPES

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "Rendezvous",
    "SocketRing",
    "WIRE_DTYPES",
]
