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

Why: measured side by side in one bench run each (docs/benchmarks.md), the
ring moved float32 gradients faster than TensorFlow's collectives at every
size from 1 to 64 MiB: 4 to 5 times on loopback, 0.88-0.98 of a 1 Gbit/s
link against 0.63-0.82, and up to ten times at 10 Gbit/s. Every worker
applies the rule to the same strategy and environment, so all choose alike.

The ``socket`` transport, step by step:

* **Where it works**: MultiWorkerMirroredStrategy with one replica per worker
  (each worker a process, as ``tfdist launch`` and SLURM start them), and any
  strategy with a single replica (nothing to reduce: gradients pass through).
  Several local replicas per worker, ParameterServerStrategy,
  CentralStorageStrategy and TPUStrategy raise `tfdist.ConfigError`.
* **Buckets** (``bucket_bytes``, 25 MiB): the gradients are cut into
  buckets, the last variables' first (`buckets`), and each bucket is summed
  as soon as the backward pass has made it, while the pass goes on
  (`_overlapped`); a model of fewer bytes is one bucket, summed after it.
  While `tfdist.strategy.timeline` records, each bucket's times are noted.
* **Packing**: one all-reduce per bucket, of every dense floating gradient
  cast to float32 and flattened, in one order (the same on every
  worker). A ``tf.numpy_function`` hands the ring each
  gradient of `ALONE_BYTES` or more as it is, and each run of smaller ones
  concatenated into one buffer; the ring sums them as one
  (`tfdist.ring.pieces`), into one buffer where each gradient starts on a
  64-byte boundary, so its sum returns to TensorFlow as a view of that
  buffer (no copy), cast to the gradient's dtype. That buffer is reused by
  later steps once TensorFlow has let go of its views (no page faults).
  Sparse gradients (``IndexedSlices``) are made dense first; other dtypes
  (float64, integers) take the collective path.
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
  in a firewall). Small buffers take recursive doubling
  (`tfdist.ring.SocketRing`'s ``doubling_bytes``): with 3 workers or more
  each doubling partner gets a connection, and a port, of its own.
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
* **Closing**: the sockets close when the process exits (``atexit``) or on
  `close_transports`.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import os
import queue
import sys
import threading
import time
import zlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tfdist import _flight
from tfdist import _net
from tfdist import ring as ring_lib
from tfdist.errors import ConfigError
from tfdist.errors import StartupTimeoutError
from tfdist.ring import connection
from tfdist.ring import exchange
from tfdist.strategy import introspect
from tfdist.strategy import timeline
from tfdist.strategy.gradient_options import GradientOptions
from tfdist.strategy.gradient_options import TRANSPORT_VARIABLE
from tfdist.strategy.gradient_options import TRANSPORTS
from tfdist.strategy.gradient_options import get_compression
from tfdist.strategy.gradient_options import gradient_options_of

__all__ = ["TRANSPORTS", "TRANSPORT_VARIABLE", "Choice", "auto_rule",
           "choose", "plan", "agree", "record", "gradient_transport",
           "announce",
           "keras_all_reduce", "sum_pairs", "check_strategy", "peers",
           "CoordinationRendezvous", "ring_for", "socket_all_reduce",
           "rings_of", "failure_of", "close_transports", "ALONE_BYTES",
           "environment_problems"]

_SOURCE = "GradientOptions(transport='socket')"
_KEY_PREFIX = "tfdist/socket_transport"

# Gradients of these dtypes are packed into the float32 buffer.
_PACKED = (tf.float32, tf.float16, tf.bfloat16)

_lock = threading.Lock()
_every_ring: list[ring_lib.SocketRing] = []  # To close at exit.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
  """The transport a strategy's gradients take, and why.

  Attributes:
    transport: ``collective`` or ``socket``.
    reason: why, in words (said by the chief at the first step, `announce`).
    connect_timeout_s: the ring's bound on connecting (``socket``).
    timeout_s: a ring peer silent this long is lost (``socket``).
  """
  transport: str
  reason: str
  connect_timeout_s: float = 300.0
  timeout_s: float = 300.0




def auto_rule(*, workers: int, local_devices: Sequence[str],
              secret: bool) -> tuple[str, str]:
  """``auto``'s transport, and why, for a MultiWorkerMirroredStrategy.

  Args:
    workers: the processes of the cluster (chief and workers).
    local_devices: this worker's replica devices.
    secret: whether the job has a secret (``TFDIST_JOB_SECRET``).

  Returns:
    ``(transport, reason)``.
  """
  if workers < 2:
    return "collective", "one worker: nothing crosses between processes"
  if len(local_devices) != 1:
    return "collective", (f"{len(local_devices)} replicas on each worker; "
                          "the ring carries one per process")
  if any(":GPU:" in d.upper() or ":TPU:" in d.upper() for d in local_devices):
    return "collective", ("replicas on accelerators: TensorFlow's "
                          "collectives keep the gradients on the device")
  if not secret:
    return "collective", (
        f"no job secret ({_net.JOB_SECRET_VARIABLE}): the ring would let any "
        "process that reaches its port join it; tfdist launch and tfdist "
        "slurm set one")
  return "socket", (f"{workers} CPU workers with a job secret: the ring "
                    "moves gradients faster than TensorFlow's collectives "
                    "(docs/benchmarks.md)")


def choose(strategy, requested: str = "auto", *,
           connect_timeout_s: float = 300.0, timeout_s: float = 300.0,
           environ: Mapping[str, str] | None = None) -> Choice:
  """The transport of a MultiWorkerMirroredStrategy's gradients.

  Args:
    strategy: the strategy.
    requested: one of `TRANSPORTS`; ``auto`` reads `TRANSPORT_VARIABLE`
      first, then applies `auto_rule`.
    connect_timeout_s: the ring's bound on connecting.
    timeout_s: a ring peer silent this long is lost.
    environ: the environment (``os.environ`` when omitted).

  Raises:
    ConfigError: an unknown `TRANSPORT_VARIABLE` value, or ``socket`` for a
      strategy the ring cannot serve.
  """
  environ = os.environ if environ is None else environ
  requested, source = _requested(requested, environ)
  timeouts = {"connect_timeout_s": float(connect_timeout_s),
              "timeout_s": float(timeout_s)}
  if requested == "collective":
    return Choice(transport="collective", reason=f"asked for by {source}")
  if requested == "socket":
    if not check_strategy(strategy, source):
      return Choice(transport="collective",
                    reason="one replica: nothing to reduce")
    return Choice(transport="socket", reason=f"asked for by {source}",
                  **timeouts)
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return Choice(transport="collective", reason=(
        f"auto: {type(strategy).__name__} reduces within one process"))
  _, _, spec = introspect.task_of(strategy)
  transport, reason = plan(
      workers=len(_tasks(spec)),
      local_devices=list(strategy.extended.worker_devices), environ=environ)
  return Choice(transport=transport, reason=reason, **timeouts)


def plan(*, workers: int, local_devices: Sequence[str],
         environ: Mapping[str, str] | None = None) -> tuple[str, str]:
  """What ``auto`` will choose for a MultiWorkerMirrored cluster, and why.

  From the cluster's shape, before TensorFlow starts (``tfdist info``):
  `TRANSPORT_VARIABLE` when it is set, else `auto_rule`.

  Raises:
    ConfigError: an unknown `TRANSPORT_VARIABLE` value.
  """
  environ = os.environ if environ is None else environ
  requested, source = _requested("auto", environ)
  if requested != "auto":
    return requested, f"asked for by {source}"
  transport, reason = auto_rule(workers=workers, local_devices=local_devices,
                                secret=_net.job_secret(environ) is not None)
  return transport, f"auto: {reason}"


def _requested(requested: str, environ: Mapping[str, str]) -> tuple[str, str]:
  """``requested``, or `TRANSPORT_VARIABLE` for ``auto``; where it came from."""
  value = environ.get(TRANSPORT_VARIABLE)
  if requested != "auto" or not value:
    return requested, "make_strategy option transport"
  source = f"the {TRANSPORT_VARIABLE} environment variable"
  if value not in TRANSPORTS:
    raise ConfigError(field=TRANSPORT_VARIABLE, value=value, source=source,
                      expected=f"one of {list(TRANSPORTS)}")
  return value, source


def environment_problems(environ: Mapping[str, str] | None = None
                         ) -> dict[str, ConfigError]:
  """`TRANSPORT_VARIABLE` and `connection.RING_PORTS_VARIABLE`, where set to a
  value tfdist cannot use, to the `ConfigError` reading it raises."""
  environ = os.environ if environ is None else environ
  problems = {}
  for name, read in (
      (TRANSPORT_VARIABLE, lambda: _requested("auto", environ)),
      (connection.RING_PORTS_VARIABLE,
       lambda: connection.ring_ports(None, source="", environ=environ))):
    try:
      read()
    except ConfigError as e:
      problems[name] = e
  return problems


def agree(strategy, choice: Choice, *, timeout_s: float,
          rendezvous: ring_lib.Rendezvous | None = None) -> None:
  """Checks that every worker of ``strategy`` made the same ``choice``.

  Each task publishes its transport in the coordination service and reads
  every other task's, within ``timeout_s`` in all: workers that differ (a
  job secret or ``TFDIST_TRANSPORT`` set on some only) would otherwise wait
  on each other at the first step, one in the ring and one in a collective.

  Raises:
    ConfigError: a task chose another transport; names it and why.
    StartupTimeoutError: a task did not publish its choice in time.
  """
  rendezvous = rendezvous or CoordinationRendezvous()
  task_type, task_id, spec = introspect.task_of(strategy)
  me = f"{task_type}:{task_id}"
  rendezvous.publish(f"{_KEY_PREFIX}/choice/{me}",
                     f"{choice.transport}|{choice.reason}")
  deadline = time.monotonic() + timeout_s
  for task in _tasks(spec):
    if task == me:
      continue
    try:
      with _flight.recorded("barrier: transport agreement", peers=task,
                            transport="tensorflow coordination service"):
        value = rendezvous.lookup(f"{_KEY_PREFIX}/choice/{task}",
                                  max(0.001, deadline - time.monotonic()))
    except TimeoutError:
      raise StartupTimeoutError(
          f"transport: {me} waited {timeout_s:.0f} s for {task} to say "
          "which transport carries its gradients; is it running "
          "tfdist.make_strategy too?") from None
    transport, _, reason = value.partition("|")
    if transport != choice.transport:
      raise ConfigError(
          field="transport", value=f"{choice.transport} on {me}",
          source=f"make_strategy ({choice.reason})",
          expected=f"the same on every worker; {task} chose {transport} "
                   f"({reason})",
          hint=f"Set {_net.JOB_SECRET_VARIABLE} and {TRANSPORT_VARIABLE} "
               "alike on every worker (tfdist launch and tfdist slurm do)")


def record(strategy, choice: Choice) -> None:
  """Makes ``choice`` the transport of ``strategy``'s Keras optimizers."""
  introspect.record_of(strategy).transport = choice


def gradient_transport(strategy: tf.distribute.Strategy) -> Choice:
  """What carries ``strategy``'s gradients, and why.

  The transport `tfdist.make_strategy` chose for the strategy, which every
  Keras optimizer under it uses; one given `tfdist.perf.with_gradient_options`
  may ask for another.

  Args:
    strategy: a strategy, usually from `tfdist.make_strategy`.

  Returns:
    Its `Choice`: ``transport`` is ``socket`` (tfdist's ring) or
    ``collective`` (TensorFlow's, also for a strategy tfdist did not build),
    ``reason`` says why.

  Example:
    >>> tfdist.gradient_transport(strategy).transport
    'socket'
  """
  choice = introspect.record_of(strategy).transport
  if choice is not None:
    return choice
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return Choice(transport="collective",
                  reason="a strategy tfdist.make_strategy did not build")
  return Choice(transport="collective", reason=(
      f"{type(strategy).__name__.lstrip('_')}: the ring serves "
      "MultiWorkerMirrored only"))


def announce(strategy, choice: Choice) -> None:
  """Says on stderr, from ``strategy``'s chief, which transport carries its
  gradients: as the first step is built, and again for an optimizer that
  asks for the other one."""
  with _lock:
    said = introspect.record_of(strategy).announced
    if choice.transport in said or strategy.num_replicas_in_sync < 2:
      return
    said.add(choice.transport)
  if not introspect.is_chief(strategy):
    return
  if choice.transport == "socket":
    line = (f"gradients cross by the socket ring ({choice.reason}); "
            f"{TRANSPORT_VARIABLE}=collective for TensorFlow's")
  else:
    line = f"gradients cross by TensorFlow's collectives ({choice.reason})"
  print(f"tfdist: {line}", file=sys.stderr, flush=True)


def sum_pairs(pairs: Sequence[tuple[Any, Any]],
              reduce: Callable[[list[Any]], list[Any]]) -> list:
  """``pairs`` (gradient, variable) with every gradient not ``None`` summed.

  ``reduce`` sums the gradients present, in order, in one call.
  """
  pairs = list(pairs)
  present = [i for i, (g, _) in enumerate(pairs) if g is not None]
  if not present:
    return pairs
  result = list(pairs)
  for i, r in zip(present, reduce([pairs[i][0] for i in present])):
    result[i] = (r, pairs[i][1])
  return result


def keras_all_reduce(optimizer, grads_and_vars: list) -> list | None:
  """``optimizer``'s ``(gradient, variable)`` pairs summed over the replicas.

  The one hook of every Keras optimizer (`tfdist.strategy.keras_hooks`
  installs it): by the transport the optimizer's `GradientOptions` ask for,
  else its strategy's (`gradient_transport`), in their wire dtype.

  Returns:
    The summed pairs, or ``None`` where Keras's own all-reduce does the same
    (TensorFlow's collectives, no options given).
  """
  context = tf.distribute.get_replica_context()
  if context is None:  # Cross-replica context: nothing to reduce.
    return grads_and_vars
  given = gradient_options_of(optimizer)
  options = given or GradientOptions()
  strategy = tf.distribute.get_strategy()
  choice = gradient_transport(strategy)
  if options.transport != "auto":
    choice = Choice(
        transport=options.transport,
        reason=f"asked for by GradientOptions(transport={options.transport!r})")
  announce(strategy, choice)
  if choice.transport != "socket" and given is None:
    return None
  codec = get_compression(options.compression)
  communication = tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=options.bytes_per_pack)

  def collective(grads):
    return _collective(context, grads, codec, communication)

  if choice.transport != "socket":
    return sum_pairs(grads_and_vars, collective)
  connect_s, silent_s = (
      (given.socket_connect_timeout_seconds, given.socket_timeout_seconds)
      if given else (choice.connect_timeout_s, choice.timeout_s))
  return sum_pairs(grads_and_vars, lambda grads: socket_all_reduce(
      grads, compression=options.compression, connect_timeout_s=connect_s,
      timeout_s=silent_s, fallback=collective,
      secret=options.socket_secret, ports=options.socket_ports,
      authenticate_values=options.socket_authenticate_values,
      # As by default: an embedding's rows stay on the collectives unless
      # the ring was asked for.
      keep_sparse=options.transport == "auto",
      bucket_bytes=options.bucket_bytes))


def _collective(context, grads, codec, communication) -> list:
  """TensorFlow's all-reduce of ``grads``, each dtype group in one call."""
  # Packs concatenate tensors, so each dtype is reduced in its own call.
  groups: dict[tf.DType, list[int]] = {}
  wire = [codec.encode(g) for g in grads]
  for j, w in enumerate(wire):
    groups.setdefault(w.dtype, []).append(j)
  reduced: list[Any] = [None] * len(grads)
  for indices in groups.values():
    out = context.all_reduce(tf.distribute.ReduceOp.SUM,
                             [wire[j] for j in indices], options=communication)
    for j, r in zip(indices, out):
      reduced[j] = codec.decode(r, grads[j].dtype)
  return reduced


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


def check_strategy(strategy, source: str = _SOURCE) -> bool:
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
  tasks = _tasks(spec)
  names = list(tasks)
  me = f"{task_type}:{task_id}"
  if me not in names or len(tasks) != strategy.num_replicas_in_sync:
    raise ConfigError(
        field="cluster", value=spec, source=f"{_SOURCE}, cluster resolver",
        expected=(f"{strategy.num_replicas_in_sync} chief/worker tasks, "
                  f"{me} among them"))
  return names.index(me), [_host(a) for a in tasks.values()], names


def _tasks(spec) -> dict[str, str]:
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
      and a receiving thread (`tfdist.ring.exchange`).

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
  rings = introspect.record_of(strategy).rings
  with _lock:
    if settings in rings:
      return rings[settings]
    rank, hosts, names = peers(strategy)
    # Rings are numbered in the order the program makes them, the same on
    # every worker (the same program runs everywhere).
    key = f"{_KEY_PREFIX}/{len(_every_ring)}"
    ring = ring_lib.SocketRing(
        rank=rank, hosts=hosts, names=names,
        rendezvous=CoordinationRendezvous(), key=key,
        connect_timeout_s=connect_timeout_s, timeout_s=timeout_s,
        source=f"{_SOURCE}, cluster resolver", secret=secret, ports=ports,
        authenticate_values=authenticate_values,
        threaded_bytes=threaded_bytes)
    rings[settings] = ring
    if not _every_ring:
      atexit.register(close_transports)
    _every_ring.append(ring)
    return ring


def rings_of(strategy) -> list[ring_lib.SocketRing]:
  """The socket rings this process made for ``strategy``'s workers."""
  with _lock:
    return list(introspect.record_of(strategy).rings.values())


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
  with _lock:
    rings = list(_every_ring)
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
                      authenticate_values: bool = False,
                      keep_sparse: bool = False,
                      bucket_bytes: int = 0) -> list[Any]:
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
    keep_sparse: ``IndexedSlices`` go to ``fallback`` as they are (an
      embedding's rows, gathered by TensorFlow's collectives) instead of
      being made dense for the ring (its whole table every step).
    bucket_bytes: cut the gradients into buckets of at most this many
      float32 bytes, last variable first, each summed as soon as it exists
      (`buckets`); 0 sums them all in one call after the backward pass.

  Returns:
    The summed gradients, each in its gradient's dtype; dense, but those
    ``keep_sparse`` left to ``fallback``.
  """
  strategy = tf.distribute.get_strategy()
  ring = ring_for(strategy, connect_timeout_s=connect_timeout_s,
                  timeout_s=timeout_s, secret=secret, ports=ports,
                  authenticate_values=authenticate_values)
  dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
           for g in grads]
  if ring is None:
    return dense
  carried = [g.dtype in _PACKED and not (
      keep_sparse and isinstance(g, tf.IndexedSlices)) for g in grads]
  packed = [i for i, c in enumerate(carried) if c]
  others = [i for i, c in enumerate(carried) if not c]
  result: list[Any] = list(dense)
  if others:
    kept = [grads[i] if keep_sparse else dense[i] for i in others]
    for i, r in zip(others, fallback(kept)):
      result[i] = r
  if not packed:
    return result
  tensors = [dense[i] for i in packed]
  wire = get_compression(compression).ring_wire
  groups = buckets(tensors, bucket_bytes)
  if len(groups) == 1:
    args, reduce = _bucket(ring, tensors, wire, _SUMS, "gradient bucket 1/1")
    nbytes = _bytes(tensors)
    sums = tf.numpy_function(
        lambda *a: timeline.note_bucket(
            functools.partial(reduce, *a), bucket=0, of=1, nbytes=nbytes,
            ready=time.perf_counter()),
        args, [tf.float32] * len(tensors), stateful=True,
        name="tfdist_socket_all_reduce")
  else:
    sums = _overlapped(ring, tensors, wire, groups,
                       bound_s=connect_timeout_s + timeout_s * len(groups))
  for i, g, piece in zip(packed, tensors, sums):
    static = g.shape.is_fully_defined()
    piece.set_shape([g.shape.num_elements() if static else None])
    shape = g.shape if static else tf.shape(g)
    result[i] = tf.cast(tf.reshape(piece, shape), g.dtype)
  return result


def buckets(tensors: Sequence[tf.Tensor], bucket_bytes: int
            ) -> list[list[int]]:
  """Indices of ``tensors`` cut into buckets of at most ``bucket_bytes``.

  Last first: TensorFlow computes a model's gradients in the reverse order
  of its variables, layer by layer (measured on CPU, in ``fit`` and in a
  hand-written step alike), so each bucket is whole as early as it can be.
  A gradient larger than ``bucket_bytes`` is a bucket alone. One bucket of
  all, in order, when ``bucket_bytes`` is 0 or a size is not known when
  traced.
  """
  sizes = [g.shape.num_elements() for g in tensors]
  if not bucket_bytes or None in sizes:
    return [list(range(len(tensors)))]
  out: list[list[int]] = []
  filled = 0
  for i in reversed(range(len(tensors))):
    if out and filled + sizes[i] * 4 <= bucket_bytes:
      out[-1].append(i)
      filled += sizes[i] * 4
    else:
      out.append([i])
      filled = sizes[i] * 4
  return out


def _bytes(tensors: Sequence[tf.Tensor]) -> int:
  """float32 bytes of ``tensors`` (0 for those of unknown size)."""
  return sum((t.shape.num_elements() or 0) * 4 for t in tensors)


def _bucket(ring, tensors: Sequence[tf.Tensor], wire: str, sums: "_Buffers",
            kind: str):
  """The inputs of one all-reduce of ``tensors`` and the numpy function
  that sums them (into a buffer of ``sums``) and returns each one's sum;
  ``kind`` names it to the flight recorder."""
  tag = _signature(tensors)
  packed_inputs = [_packed([tensors[i] for i in group])
                   for group in _groups(tensors)]
  inputs = [flat for flat, _ in packed_inputs]
  # One input that is concat's new buffer, read by nothing but the
  # all-reduce: the sum goes into it. Else an input may be a gradient's own
  # buffer: the sum gets a buffer of its own.
  in_place = len(packed_inputs) == 1 and packed_inputs[0][1]
  counts = tf.stack([tf.size(t, out_type=tf.int64)
                     if t.shape.num_elements() is None
                     else tf.constant(t.shape.num_elements(), tf.int64)
                     for t in tensors])

  def reduce(*args):
    *xs, sizes = args
    if in_place:
      out = xs[0]
    else:
      out = sums.take(sum(c + (-c % _ALIGN) for c in sizes.tolist()))
    outs, start = [], 0
    for x in xs:  # Each input's place in the packed layout of `_views`.
      outs.append(out[start:start + x.size])
      start += x.size + (-x.size % _ALIGN)
    ring.all_reduce(xs, wire=wire, tag=tag, out=outs, kind=kind)
    return _views(out, sizes)

  return inputs + [counts], reduce


def _overlapped(ring, tensors, wire: str, groups: list[list[int]], *,
                bound_s: float) -> list[tf.Tensor]:
  """Each of ``groups`` summed as soon as its gradients exist.

  Bucket k has two ops. ``start_k`` only hands its gradients to the ring's
  `_Courier` thread, so no inter-op thread of TensorFlow waits on the
  network while the backward pass runs; graph execution is dataflow, so it
  runs as soon as its gradients exist, although it was issued after the
  whole backward pass. Each ``start_k`` follows ``start_{k-1}``, so every
  worker's thread sums the buckets in the same order. ``finish_k`` waits for
  bucket k's sums; it follows the last ``start`` and ``finish_{k-1}``, so it
  holds no thread before the backward pass is done.
  """
  courier = _courier_of(ring)
  sums: list[Any] = [None] * len(tensors)
  tickets, previous = [], []
  for k, group in enumerate(groups):
    members = [tensors[i] for i in group]
    args, reduce = _bucket(ring, members, wire, _Buffers(sizes=1),
                           f"gradient bucket {k + 1}/{len(groups)}")
    def start(*arrays, reduce=reduce, k=k, nbytes=_bytes(members)):
      return np.int64(courier.start(functools.partial(
          timeline.note_bucket, functools.partial(reduce, *arrays), bucket=k,
          of=len(groups), nbytes=nbytes, ready=time.perf_counter())))
    with tf.control_dependencies(previous):
      ticket = tf.numpy_function(start, args, tf.int64, stateful=True,
                                 name=f"tfdist_bucket_start_{k}")
    tickets.append(ticket)
    previous = [ticket]
  for k, group in enumerate(groups):
    with tf.control_dependencies(previous):
      summed = tf.numpy_function(
          lambda ticket: courier.finish(int(ticket), bound_s), [tickets[k]],
          [tf.float32] * len(group), stateful=True,
          name=f"tfdist_bucket_finish_{k}")
    previous = [summed[0]]
    for i, piece in zip(group, summed):
      sums[i] = piece
  return sums


class _Courier:
  """A ring's thread that sums buckets one after another, in the order
  their start ops handed them over (`_overlapped`)."""

  def __init__(self, ring):
    self._ring = ring
    self._inbox: "queue.Queue[tuple[int, Callable]]" = queue.Queue()
    self._done: dict[int, Any] = {}
    self._cv = threading.Condition()
    self._tickets = itertools.count()
    threading.Thread(target=self._run, daemon=True,
                     name="tfdist-buckets").start()

  def start(self, work: Callable[[], Any]) -> int:
    """Queues ``work``; returns the ticket `finish` takes."""
    ticket = next(self._tickets)
    self._inbox.put((ticket, work))
    return ticket

  def finish(self, ticket: int, bound_s: float) -> Any:
    """What ``ticket``'s work returned, or the error it raised."""
    deadline = time.monotonic() + bound_s
    with self._cv:
      while ticket not in self._done:
        left = deadline - time.monotonic()
        if left <= 0:
          raise StartupTimeoutError(
              f"socket transport: a gradient bucket was not summed within "
              f"{bound_s:.0f} s")
        self._cv.wait(left)
      result = self._done.pop(ticket)
    if isinstance(result, BaseException):
      raise result
    return result

  def _run(self) -> None:
    while True:
      ticket, work = self._inbox.get()
      try:
        result = work()
      except BaseException as e:  # pylint: disable=broad-except
        result = self._ring.failure or e
      with self._cv:
        self._done[ticket] = result
        self._cv.notify_all()


def _courier_of(ring) -> _Courier:
  with _lock:
    if ring not in _couriers:
      _couriers[ring] = _Courier(ring)
    return _couriers[ring]


_couriers: "dict[Any, _Courier]" = {}


#: Each gradient starts at a multiple of this many float32 values (64 bytes,
#: TensorFlow's tensor alignment) in the packed buffer, so every sum goes
#: back to TensorFlow as a view of that buffer: a ``tf.numpy_function``
#: output that starts on a 64-byte boundary is taken without a copy (where
#: ``tf.split`` copies every piece unless all offsets are aligned).
_ALIGN = 16


#: A gradient of at least this many float32 bytes (its shape known when
#: traced) reaches the ring as it is, an array of its own
#: (`tfdist.ring.pieces`): packing it would read and write every value once
#: more. Smaller ones, and those of unknown size, are packed together, so
#: that a block of the ring never spans many tiny arrays.
ALONE_BYTES = 256 << 10


def _alone(g: tf.Tensor) -> bool:
  """Whether ``g`` reaches the ring unpacked (`ALONE_BYTES`)."""
  count = g.shape.num_elements()
  return count is not None and count * 4 >= ALONE_BYTES


def _groups(tensors: Sequence[tf.Tensor]) -> list[list[int]]:
  """``tensors``' indices in order: each one alone (`_alone`), or a run of
  neighbours packed into one buffer."""
  groups: list[list[int]] = []
  for i, g in enumerate(tensors):
    if _alone(g):
      groups.append([i])
    elif groups and not _alone(tensors[groups[-1][-1]]):
      groups[-1].append(i)
    else:
      groups.append([i])
  return groups


def _pack(tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """The pieces to concatenate (gradients as float32, zeros to align them).

  Each gradient, flat, is followed by the zeros that bring the next one to a
  multiple of `_ALIGN` (none where that is 0).
  """
  pieces = []
  for g in tensors:
    flat = tf.reshape(tf.cast(g, tf.float32), [-1])
    count = g.shape.num_elements()
    pieces.append(flat)
    if count is None:  # Only known when the graph runs.
      count = tf.size(flat, out_type=tf.int64)
      pieces.append(tf.zeros([tf.math.floormod(-count, _ALIGN)],
                             tf.float32))
    elif count % _ALIGN:
      pieces.append(tf.zeros([-count % _ALIGN], tf.float32))
  return pieces


def _packed(tensors: Sequence[tf.Tensor]) -> tuple[tf.Tensor, bool]:
  """One input of the ring: the gradient itself if `_alone`, else
  ``tensors`` packed by `_pack`; and whether it is a buffer of its own
  (concatenated from two pieces or more that are surely not empty)."""
  if len(tensors) == 1 and _alone(tensors[0]):
    return tf.reshape(tf.cast(tensors[0], tf.float32), [-1]), False
  pieces = _pack(tensors)
  if len(pieces) == 1:
    return pieces[0], False
  return tf.concat(pieces, axis=0), sum(
      (p.shape.num_elements() or 0) > 0 for p in pieces) > 1


def _views(out: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
  """The gradients' sums: views of ``out`` laid out as `_pack` packed them."""
  views, start = [], 0
  for count in counts.tolist():
    views.append(out[start:start + count])
    start += count + (-count % _ALIGN)
  return views


def _aligned(raw: np.ndarray, size: int) -> np.ndarray:
  """``size`` values of ``raw`` (``size + _ALIGN`` long) on a 64-byte
  boundary."""
  skip = (-raw.ctypes.data % (_ALIGN * 4)) // 4
  return raw[skip:skip + size]


class _Buffers:
  """Buffers for the sums, reused once TensorFlow has let go of them.

  A sum goes back to TensorFlow as views of its buffer, and TensorFlow holds
  a reference to each view until it frees the tensor (``DelayedNumpyDecref``
  in tensorflow/python/lib/core/ndarray_tensor_bridge.cc), and every view
  one to the buffer: a buffer whose reference count is back to what this
  class alone holds is not seen by any tensor, and the next step of its size
  sums into it. A fresh buffer of 64 MiB costs its page faults, the kernel
  zeroing each page when it is first written: more than the additions
  written into it (docs/benchmarks.md).

  Args:
    keep: buffers kept per size (one in use, one TensorFlow has not let go
      of yet).
    sizes: sizes kept, the most recently used.
  """

  def __init__(self, *, keep: int = 2, sizes: int = 4):
    self._keep, self._sizes = keep, sizes
    self._held: dict[int, list[np.ndarray]] = {}
    self._lock = threading.Lock()
    #: Buffers allocated so far (a reused one is not counted again).
    self.allocations = 0

  def take(self, size: int) -> np.ndarray:
    """A float32 array of ``size`` values on a 64-byte boundary, no other
    array's."""
    with self._lock:
      held = self._held.pop(size, [])
      self._held[size] = held  # The most recent size last.
      while len(self._held) > self._sizes:
        del self._held[next(iter(self._held))]
      for raw in held:
        # References: `held`, `raw` and getrefcount's argument; a view
        # anywhere adds one.
        if sys.getrefcount(raw) == 3:
          return _aligned(raw, size)
      raw = np.empty(size + _ALIGN, np.float32)
      self.allocations += 1
      if len(held) < self._keep:
        held.append(raw)
      return _aligned(raw, size)


_SUMS = _Buffers()
