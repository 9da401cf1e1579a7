"""Gradient transports: what carries a strategy's gradient all-reduce.

| name         | what carries the gradients                                   |
|--------------|--------------------------------------------------------------|
| ``collective`` | TensorFlow's collectives, as MultiWorkerMirroredStrategy does |
| ``socket``     | tfdist's ring all-reduce over plain TCP (`tfdist.ring`)  |
| ``auto``       | the rule below (the default)                                 |

**Which one, by default.** `tfdist.make_strategy` records a `Choice` for
each MultiWorkerMirroredStrategy it builds (its ``transport`` option, else
the ``TFDIST_TRANSPORT`` environment variable, else ``auto``), and every
Keras optimizer under that strategy (``model.fit``, `tfdist.fit`,
`tfdist.Runner`, custom loops) sums its gradients by it (`keras_all_reduce`,
the one hook `tfdist.strategy.keras_hooks` installs), unless its
`tfdist.perf.GradientOptions` ask for another.
``auto`` picks the socket ring when all of these hold, else TensorFlow's
collectives (`auto_rule`):

1. several workers, one replica each (the ring joins processes);
2. the replicas are CPUs (on GPUs TensorFlow's collectives, NCCL, keep the
   gradients on the device; the ring copies them to the host);
3. the job has a secret (``TFDIST_JOB_SECRET``, which ``tfdist launch`` and
   ``tfdist slurm`` set): without one any process that reaches the ring's
   port could join it, so it is never opened by default.

Sparse gradients (an ``Embedding``'s ``IndexedSlices``) keep TensorFlow's
collectives by default, which gather the rows a step touched; the ring
would carry the whole table, made dense, every step.

Every worker applies the rule to the same strategy and environment, so all
choose alike; why the ring is the default on CPUs: docs/benchmarks.md.

The ``socket`` transport, step by step:

* **Where it works**: MultiWorkerMirroredStrategy with one replica per worker
  (each worker a process, as ``tfdist launch`` and SLURM start them), and any
  strategy with a single replica (nothing to reduce: gradients pass through).
  Several local replicas per worker, ParameterServerStrategy,
  CentralStorageStrategy and TPUStrategy raise `tfdist.ConfigError`
  (`check_strategy`).
* **Wire dtype**: ``compression`` picks it: ``none`` sends float32, ``fp16``
  float16, ``bf16`` bfloat16. Sums accumulate in float32 either way.
* **Who may join**: workers prove the job's secret (``TFDIST_JOB_SECRET``,
  which ``tfdist launch`` and ``tfdist slurm`` set, or ``socket_secret``)
  to each other when they connect (`tfdist.ring.auth`); anything else
  that connects is dropped and the ring keeps waiting for its peer.
  ``socket_authenticate_values`` also tags every step's bytes. Without a
  secret the ring logs once that it is unauthenticated.
* **When**: the ring connects at the first all-reduce (the first training
  step), within ``socket_connect_timeout_seconds``; after that a peer that
  sends nothing for ``socket_timeout_seconds`` is declared lost, and one
  that exits is noticed at once. The error, a `tfdist.WorkerLostError` or
  `tfdist.StartupTimeoutError` naming the peer, reaches the caller inside
  TensorFlow's error for the failed step.
"""

from tfdist.strategy.buckets import buckets
from tfdist.strategy.buckets import socket_all_reduce
from tfdist.strategy.gradient_hook import keras_all_reduce
from tfdist.strategy.gradient_hook import sum_pairs
from tfdist.strategy.gradient_options import TRANSPORT_VARIABLE
from tfdist.strategy.gradient_options import TRANSPORTS
from tfdist.strategy.packing import ALONE_BYTES
from tfdist.strategy.rings import CoordinationRendezvous
from tfdist.strategy.rings import check_strategy
from tfdist.strategy.rings import close_transports
from tfdist.strategy.rings import failure_of
from tfdist.strategy.rings import peers
from tfdist.strategy.rings import ring_for
from tfdist.strategy.rings import rings_of
from tfdist.strategy.transport_choice import Choice
from tfdist.strategy.transport_choice import agree
from tfdist.strategy.transport_choice import announce
from tfdist.strategy.transport_choice import auto_rule
from tfdist.strategy.transport_choice import choose
from tfdist.strategy.transport_choice import environment_problems
from tfdist.strategy.transport_choice import gradient_transport
from tfdist.strategy.transport_choice import plan
from tfdist.strategy.transport_choice import record

__all__ = ["TRANSPORTS", "TRANSPORT_VARIABLE", "Choice", "auto_rule",
           "choose", "plan", "agree", "record", "gradient_transport",
           "announce",
           "keras_all_reduce", "sum_pairs", "check_strategy", "peers",
           "CoordinationRendezvous", "ring_for", "socket_all_reduce",
           "rings_of", "failure_of", "close_transports", "ALONE_BYTES",
           "environment_problems", "buckets"]
