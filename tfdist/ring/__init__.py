"""tfdist's ring all-reduce over TCP sockets (the ``socket`` transport).

One module per seam, each testable alone:

* the schedules, one module and one row of `socket_ring`'s table each,
  pure plans (which elements each rank sends to and receives from whom
  at each step, and whether it adds them): `schedule`, the ring (and the
  plans' `Step`), `doubling`, recursive doubling for small buffers, and
  `halving`, recursive halving and doubling (Rabenseifner's) for larger
  ones at many ranks;
* `pieces`: a list of arrays read as their concatenation, never made (a
  model's gradients, summed as one buffer without packing them);
* `wire`: what crosses the sockets: hellos, call headers, encoded values;
* `auth`: values' tags (who joins: the job's gate, `tfdist._secret`);
* `connection`: the ring's members, listening and the hello exchange;
* `exchange`: one step's blocks moved both ways over non-blocking sockets;
* `courier`: a ring's thread that runs queued work in order (buckets);
* `socket_ring`: `SocketRing`: the connections, the link's measure, and
  the one executor of the plans.
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
