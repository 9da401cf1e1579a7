"""The socket rings of a strategy's workers: made once, closed at exit.

Hosts come from the strategy's cluster resolver (TF_CONFIG or SLURM), ranks
in the order chief, then workers. Each worker listens on its own cluster
address (every interface only when that is not an address of this host,
logged), on a port the OS picks, or the first free one of ``socket_ports``
/ ``TFDIST_RING_PORTS`` (e.g. ``20000-20100``, to open in a firewall), and
publishes it in TensorFlow's coordination service (the key-value store that
MultiWorkerMirroredStrategy runs on its leader task) under
``tfdist/socket_transport/<ring>/<rank>``. Small buffers take recursive
doubling, and from 4 workers larger ones recursive halving
(`tfdist.ring.socket_ring.choose`): with 3 workers or more each of their
partners gets a connection, and a port, of its own.

A strategy's rings are kept in its `tfdist.strategy.introspect.Record`, by
their settings; they close when the process exits (``atexit``) or on
`close_transports`.
"""

from __future__ import annotations

import atexit

import tensorflow as tf

from tfdist import _process
from tfdist import ring as ring_lib
from tfdist.errors import ConfigError
from tfdist.strategy import introspect

__all__ = ["KEY_PREFIX", "SOURCE", "CoordinationRendezvous", "check_strategy",
           "peers", "tasks", "ring_for", "rings_of", "failure_of",
           "close_transports"]

#: Where the socket transport publishes in the coordination service.
KEY_PREFIX = "tfdist/socket_transport"
#: Where its errors say ``transport="socket"`` came from, by default.
SOURCE = "GradientOptions(transport='socket')"


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


def _unsupported(strategy, why: str, source: str) -> ConfigError:
  return ConfigError(
      field="transport", value="socket", source=source,
      expected=("MultiWorkerMirroredStrategy with one replica per worker, or "
                "a single replica"),
      hint=f"{type(strategy).__name__} {why}; use transport='collective' "
           "there")


def check_strategy(strategy, source: str = SOURCE) -> bool:
  """Whether ``strategy`` needs the ring (True) or has one replica (False).

  Args:
    strategy: the strategy.
    source: where ``transport="socket"`` was asked for, for errors.

  Raises:
    ConfigError: a strategy the socket transport cannot serve.
  """
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    raise _unsupported(strategy, "updates variables on ps tasks, it has no "
                       "all-reduce to replace", source)
  if isinstance(strategy, (tf.distribute.TPUStrategy,
                           tf.distribute.experimental.TPUStrategy)):
    raise _unsupported(strategy, "reduces on the TPU interconnect", source)
  if isinstance(strategy,
                tf.distribute.experimental.CentralStorageStrategy):
    raise _unsupported(strategy, "keeps variables on one device", source)
  if strategy.num_replicas_in_sync == 1:
    return False
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    raise _unsupported(strategy, f"has {strategy.num_replicas_in_sync} "
                       "replicas in one process", source)
  local = len(strategy.extended.worker_devices)
  if local != 1:
    raise _unsupported(strategy, f"has {local} replicas on each worker "
                       f"({', '.join(strategy.extended.worker_devices)})",
                       source)
  return True


def peers(strategy) -> tuple[int, list[str], list[str]]:
  """This worker's rank, every worker's host and name, chief first."""
  task_type, task_id, spec = introspect.task_of(strategy)
  by_name = tasks(spec)
  names = list(by_name)
  me = f"{task_type}:{task_id}"
  if me not in names or len(by_name) != strategy.num_replicas_in_sync:
    raise ConfigError(
        field="cluster", value=spec, source=f"{SOURCE}, cluster resolver",
        expected=(f"{strategy.num_replicas_in_sync} chief/worker tasks, "
                  f"{me} among them"))
  return names.index(me), [_host(a) for a in by_name.values()], names


def tasks(spec) -> dict[str, str]:
  """Every chief and worker task, named as ``worker:1``, to its address;
  chief first, the order of the ring's ranks."""
  return {f"{job}:{i}": address for job in ("chief", "worker")
          for i, address in enumerate(_addresses(spec.get(job, ())))}


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
             threaded_bytes: int | None = None
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
      and a receiving thread; ``None``: `tfdist.ring.exchange.threaded_bytes`.

  Returns:
    ``None`` when the strategy has a single replica.

  Raises:
    ConfigError: a strategy the socket transport cannot serve, malformed
      ``ports``, or ``authenticate_values`` without a secret.
  """
  if not check_strategy(strategy):
    return None
  settings = (float(connect_timeout_s), float(timeout_s), secret, ports,
              authenticate_values, threaded_bytes)
  record = introspect.record_of(strategy)
  with record.lock:
    if settings in record.rings:
      return record.rings[settings]
    rank, hosts, names = peers(strategy)
    # Numbered in the order the program makes them, the same on every worker
    # (the same program runs everywhere): one coordination service a process.
    number = _process.number("ring")
    ring = ring_lib.SocketRing(
        rank=rank, hosts=hosts, names=names,
        rendezvous=CoordinationRendezvous(), key=f"{KEY_PREFIX}/{number}",
        connect_timeout_s=connect_timeout_s, timeout_s=timeout_s,
        source=f"{SOURCE}, cluster resolver", secret=secret, ports=ports,
        authenticate_values=authenticate_values,
        threaded_bytes=threaded_bytes)
    record.rings[settings] = ring
  if _process.once(close_transports):
    atexit.register(close_transports)
  return ring


def rings_of(strategy) -> list[ring_lib.SocketRing]:
  """The socket rings this process made for ``strategy``'s workers."""
  record = introspect.record_of(strategy)
  with record.lock:
    return list(record.rings.values())


def failure_of(strategy) -> BaseException | None:
  """The first error of a socket ring of ``strategy`` (a lost peer, a step
  out of order), or ``None``.

  A ring's error reaches the training loop as TensorFlow's ``UnknownError``
  (it is raised inside ``tf.numpy_function``); the loops of the training
  floor ask here what it was (`tfdist.training._worker_errors`).
  """
  return next((ring.failure for ring in rings_of(strategy)
               if ring.failure is not None), None)


def close_transports() -> None:
  """Closes every socket ring of this process (also run at exit).

  Call it once training is over on every worker; a later socket all-reduce
  in this process fails.
  """
  for record in introspect.records():
    with record.lock:
      rings = list(record.rings.values())
    for ring in rings:
      ring.close()
