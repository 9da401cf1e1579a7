"""Gradient transports: what carries the all-reduce of `with_gradient_options`.

| name         | what carries the gradients                                   |
|--------------|--------------------------------------------------------------|
| ``collective`` | TensorFlow's collectives, as MultiWorkerMirroredStrategy does (default) |
| ``socket``     | tfdist's ring all-reduce over plain TCP (`tfdist.perf.ring`)  |

The ``socket`` transport, step by step:

* **Where it works**: MultiWorkerMirroredStrategy with one replica per worker
  (each worker a process, as ``tfdist launch`` and SLURM start them), and any
  strategy with a single replica (nothing to reduce: gradients pass through).
  Several local replicas per worker, ParameterServerStrategy,
  CentralStorageStrategy and TPUStrategy raise `tfdist.ConfigError`.
* **Packing**: one all-reduce per step. Every dense floating gradient is
  cast to float32, flattened and concatenated, in the optimizer's variable
  order (the same on every worker), into one buffer; a
  ``tf.numpy_function`` hands it to the ring; the sum is split back and cast
  to each gradient's dtype. Sparse gradients (``IndexedSlices``) are made
  dense first; other dtypes (float64, integers) take the collective path.
* **Wire dtype**: ``compression`` picks it: ``none`` sends float32, ``fp16``
  float16, ``bf16`` bfloat16. Sums accumulate in float32 either way.
* **Finding peers**: hosts come from the strategy's cluster resolver
  (TF_CONFIG or SLURM), ranks in the order chief, then workers. Each worker
  listens on a port the operating system picks and publishes it in
  TensorFlow's coordination service (the key-value store that
  MultiWorkerMirroredStrategy runs on its leader task) under
  ``tfdist/socket_transport/<ring>/<rank>``. Each listens on its own
  cluster address (every interface only when that is not an address of this
  host, logged), on a port the OS picks, or the first free one of
  ``socket_ports`` / ``TFDIST_RING_PORTS`` (e.g. ``20000-20100``, to open
  in a firewall).
* **Who may join**: workers prove the job's secret (``TFDIST_JOB_SECRET``,
  which ``tfdist launch`` and ``tfdist slurm`` set, or ``socket_secret``)
  to each other when they connect (`tfdist.perf.ring.auth`); anything else
  that connects is dropped and the ring keeps waiting for its peer.
  ``socket_authenticate_values`` also tags every step's bytes. Without a
  secret the ring logs once that it is unauthenticated.
* **When**: the ring connects at the first all-reduce (the first training
  step), within ``socket_connect_timeout_seconds``; after that a peer that
  sends nothing for ``socket_timeout_seconds`` is declared lost, and one
  that exits is noticed at once. The error, a `tfdist.WorkerLostError` or
  `tfdist.StartupTimeoutError` naming the peer, reaches the caller inside
  TensorFlow's error for the failed step.
* **Closing**: the sockets close when the process exits (``atexit``) or on
  `close_transports`.
"""

from __future__ import annotations

import atexit
import threading
import weakref
import zlib
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.perf import ring as ring_lib
from tfdist.perf.ring import exchange
from tfdist.strategy import introspect

__all__ = ["TRANSPORTS", "check_strategy", "peers", "CoordinationRendezvous",
           "ring_for", "socket_all_reduce", "close_transports"]

#: Every transport name `GradientOptions` accepts.
TRANSPORTS: tuple[str, ...] = ("collective", "socket")

_SOURCE = "GradientOptions(transport='socket')"
_KEY_PREFIX = "tfdist/socket_transport"

# The wire dtype of each compression name.
_WIRE = {"none": "float32", "fp16": "float16", "bf16": "bfloat16"}

# Gradients of these dtypes are packed into the float32 buffer.
_PACKED = (tf.float32, tf.float16, tf.bfloat16)

_lock = threading.Lock()
_rings: dict[tuple, tuple[Any, ring_lib.SocketRing]] = {}
_ring_count = 0
_atexit_registered = False


class CoordinationRendezvous:
  """TensorFlow's coordination-service key-value store as a `Rendezvous`."""

  def publish(self, key: str, value: str) -> None:
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    context.context().set_config_key_value(key, value)

  def lookup(self, key: str, timeout_s: float) -> str:
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    try:
      return context.context().get_config_key_value(
          key, timeout_in_ms=max(1, int(timeout_s * 1000)))
    except tf.errors.DeadlineExceededError:
      raise TimeoutError(key) from None


def _unsupported(strategy, why: str) -> ConfigError:
  return ConfigError(
      field="transport", value="socket", source=_SOURCE,
      expected=("MultiWorkerMirroredStrategy with one replica per worker, or "
                "a single replica"),
      hint=f"{type(strategy).__name__} {why}; use transport='collective' "
           "there")


def check_strategy(strategy) -> bool:
  """Whether ``strategy`` needs the ring (True) or has one replica (False).

  Raises:
    ConfigError: a strategy the socket transport cannot serve.
  """
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    raise _unsupported(strategy, "updates variables on ps tasks, it has no "
                       "all-reduce to replace")
  if isinstance(strategy, (tf.distribute.TPUStrategy,
                           tf.distribute.experimental.TPUStrategy)):
    raise _unsupported(strategy, "reduces on the TPU interconnect")
  if isinstance(strategy,
                tf.distribute.experimental.CentralStorageStrategy):
    raise _unsupported(strategy, "keeps variables on one device")
  if strategy.num_replicas_in_sync == 1:
    return False
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    raise _unsupported(strategy, f"has {strategy.num_replicas_in_sync} "
                       "replicas in one process")
  local = len(strategy.extended.worker_devices)
  if local != 1:
    raise _unsupported(strategy, f"has {local} replicas on each worker "
                       f"({', '.join(strategy.extended.worker_devices)})")
  return True


def peers(strategy) -> tuple[int, list[str], list[str]]:
  """This worker's rank, every worker's host and name, chief first."""
  task_type, task_id, spec = introspect.task_of(strategy)
  tasks = [(job, i, address) for job in ("chief", "worker")
           for i, address in enumerate(_addresses(spec.get(job, ())))]
  names = [f"{job}:{i}" for job, i, _ in tasks]
  me = f"{task_type}:{task_id}"
  if me not in names or len(tasks) != strategy.num_replicas_in_sync:
    raise ConfigError(
        field="cluster", value=spec, source=f"{_SOURCE}, cluster resolver",
        expected=(f"{strategy.num_replicas_in_sync} chief/worker tasks, "
                  f"{me} among them"))
  return names.index(me), [_host(a) for _, _, a in tasks], names


def _addresses(job) -> list[str]:
  if isinstance(job, dict):  # {index: address} for sparse jobs.
    return [job[i] for i in sorted(job)]
  return list(job)


def _host(address: str) -> str:
  """The host of ``[grpc://]host:port`` (IPv6 in brackets)."""
  address = address.split("://", 1)[-1]
  host = address.rsplit(":", 1)[0] if ":" in address else address
  return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def ring_for(strategy, *, connect_timeout_s: float, timeout_s: float,
             secret: str | None = None, ports: str | None = None,
             authenticate_values: bool = False,
             threaded_bytes: int = exchange.THREADED_BYTES
             ) -> ring_lib.SocketRing | None:
  """The ring of ``strategy``'s workers (made once, connected lazily).

  Args:
    strategy: the strategy whose workers all-reduce.
    connect_timeout_s: bound on connecting the ring.
    timeout_s: a peer silent this long is lost.
    secret: the job's secret; ``TFDIST_JOB_SECRET`` when ``None``.
    ports: ``"FIRST-LAST"`` to listen on; ``TFDIST_RING_PORTS`` when
      ``None``.
    authenticate_values: tag every step's bytes too.
    threaded_bytes: steps receiving this many bytes or more run a sending
      and a receiving thread (`tfdist.perf.ring.exchange`).

  Returns:
    ``None`` when the strategy has a single replica.

  Raises:
    ConfigError: a strategy the socket transport cannot serve, malformed
      ``ports``, or ``authenticate_values`` without a secret.
  """
  global _ring_count, _atexit_registered
  if not check_strategy(strategy):
    return None
  cache_key = (id(strategy), float(connect_timeout_s), float(timeout_s),
               secret, ports, authenticate_values, threaded_bytes)
  with _lock:
    entry = _rings.get(cache_key)
    if entry is not None and entry[0]() is strategy:
      return entry[1]
    rank, hosts, names = peers(strategy)
    # Rings are numbered in the order the program makes them, the same on
    # every worker (the same program runs everywhere).
    key = f"{_KEY_PREFIX}/{_ring_count}"
    _ring_count += 1
    ring = ring_lib.SocketRing(
        rank=rank, hosts=hosts, names=names,
        rendezvous=CoordinationRendezvous(), key=key,
        connect_timeout_s=connect_timeout_s, timeout_s=timeout_s,
        source=f"{_SOURCE}, cluster resolver", secret=secret, ports=ports,
        authenticate_values=authenticate_values,
        threaded_bytes=threaded_bytes)
    _rings[cache_key] = (weakref.ref(strategy), ring)
    if not _atexit_registered:
      atexit.register(close_transports)
      _atexit_registered = True
    return ring


def close_transports() -> None:
  """Closes every socket ring of this process (also run at exit).

  Call it once training is over on every worker; a later socket all-reduce
  in this process fails.
  """
  with _lock:
    rings = [ring for _, ring in _rings.values()]
  for ring in rings:
    ring.close()


def _signature(grads: Sequence[tf.Tensor]) -> int:
  """A number naming the gradients' shapes and dtypes, checked across peers."""
  text = ";".join(f"{g.dtype.name}{g.shape}" for g in grads)
  return zlib.crc32(text.encode())


# Plain Python over static shapes: autograph has nothing to convert here, and
# converting the numpy callback's closure fails noisily ("can't be nonlocal").
@tf.autograph.experimental.do_not_convert
def socket_all_reduce(grads: Sequence[Any], *, compression: str,
                      connect_timeout_s: float, timeout_s: float,
                      fallback, secret: str | None = None,
                      ports: str | None = None,
                      authenticate_values: bool = False) -> list[Any]:
  """Sums ``grads`` over the workers through the socket ring.

  Call in a replica context, with the gradients of one step in the same order
  on every worker.

  Args:
    grads: gradient tensors or ``IndexedSlices`` (none ``None``).
    compression: a `tfdist.perf.COMPRESSIONS` name: the wire dtype.
    connect_timeout_s: bound on connecting the ring.
    timeout_s: a peer silent this long is lost.
    fallback: ``fallback(list_of_tensors)`` sums tensors the ring does not
      carry (not float32/float16/bfloat16) with TensorFlow's collectives.
    secret: the job's secret; ``TFDIST_JOB_SECRET`` when ``None``.
    ports: ``"FIRST-LAST"`` to listen on; ``TFDIST_RING_PORTS`` when
      ``None``.
    authenticate_values: tag every step's bytes too.

  Returns:
    The summed gradients, dense, each in its gradient's dtype.
  """
  strategy = tf.distribute.get_strategy()
  ring = ring_for(strategy, connect_timeout_s=connect_timeout_s,
                  timeout_s=timeout_s, secret=secret, ports=ports,
                  authenticate_values=authenticate_values)
  dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
           for g in grads]
  if ring is None:
    return dense
  packed = [i for i, g in enumerate(dense) if g.dtype in _PACKED]
  others = [i for i, g in enumerate(dense) if g.dtype not in _PACKED]
  result: list[Any] = list(dense)
  if others:
    for i, r in zip(others, fallback([dense[i] for i in others])):
      result[i] = r
  if not packed:
    return result
  tensors = [dense[i] for i in packed]
  wire = _WIRE[compression]
  tag = _signature(tensors)
  flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1])
                    for g in tensors], axis=0)
  # Several gradients: ``flat`` is concat's new buffer, read by nothing but
  # the all-reduce, which sums into it and returns it: TensorFlow takes the
  # array back without a copy. One gradient: ``flat`` may share the
  # gradient's buffer, so the sum goes to a buffer of its own (copied out).
  in_place = len(tensors) > 1
  spare: list[np.ndarray] = []

  def reduce(buffer):
    if in_place:
      return ring.all_reduce(buffer, wire=wire, tag=tag, out=buffer)
    if not spare or spare[0].size != buffer.size:
      spare[:] = [np.empty(buffer.size, np.float32)]
    return ring.all_reduce(buffer, wire=wire, tag=tag, out=spare[0])

  summed = tf.numpy_function(reduce, [flat], tf.float32, stateful=True,
                             name="tfdist_socket_all_reduce")
  summed.set_shape(flat.shape)
  sizes = [g.shape.num_elements() for g in tensors]
  if any(s is None for s in sizes):
    sizes = tf.stack([tf.size(g) for g in tensors])
  for i, g, piece in zip(packed, tensors,
                         tf.split(summed, sizes, num=len(tensors))):
    shape = g.shape if g.shape.is_fully_defined() else tf.shape(g)
    result[i] = tf.cast(tf.reshape(piece, shape), g.dtype)
  return result
