"""A lost peer, as `tfdist.WorkerLostError`: who is lost and what to do.

TensorFlow reports a dead, stopped or unreachable peer as one of four
low-level errors whose first line is often generic ("Graph execution
error:"). `worker_errors` turns them into a `WorkerLostError` that names this
task, the lost ps task when TensorFlow's message names one, the informative
line of the message, and how to go on. Gradients carried by tfdist's socket
ring fail differently: the ring's own error (naming the lost peer) comes out
of ``tf.numpy_function`` as an ``UnknownError``; `worker_errors` raises the
ring's error instead.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Mapping, Sequence

import tensorflow as tf

from tfdist import _flight
from tfdist.errors import WorkerLostError
from tfdist.strategy import introspect
from tfdist.strategy import transport

__all__ = ["LOST_PEER_ERRORS", "lost_ps_tasks", "worker_errors"]

#: TensorFlow's errors for a peer that died, stopped or stopped answering.
LOST_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                    tf.errors.AbortedError, tf.errors.CancelledError)

# TensorFlow names the remote task an RPC failed on, e.g. "GRPC error
# information from remote target /job:ps/replica:0/task:1".
_REMOTE_PS = re.compile(r"remote target /job:ps/replica:\d+/task:(\d+)")


@contextlib.contextmanager
def worker_errors(strategy: tf.distribute.Strategy) -> Iterator[None]:
  """Turns TensorFlow's errors for a lost peer into WorkerLostError.

  Under ParameterServerStrategy the coordinator itself tolerates a lost
  worker (it reschedules the worker's steps), so an error that gets here most
  likely means a ps task was lost: the message names it, since its variables
  are gone and only a restart of the whole cluster can go on.

  Raises:
    WorkerLostError: one of `LOST_PEER_ERRORS` came out of the block, or a
      socket ring of ``strategy`` lost a peer.
    TfdistError: what else closed such a ring (e.g. a `ConfigError` for
      workers whose steps differ).
  """
  try:
    yield
  except tf.errors.OpError as e:
    ring_failure = transport.failure_of(strategy)
    _flight.failed(ring_failure or e)
    if ring_failure is not None:  # E.g. a WorkerLostError naming the peer.
      raise ring_failure.with_traceback(None) from e
    if not isinstance(e, LOST_PEER_ERRORS):
      raise
    task_type, task_id, cluster = introspect.task_of(strategy)
    me = f"{task_type}:{task_id}" if task_type else "this process"
    cause = f"{type(e).__name__}: {_flight.summary(e)}"
    lost_ps = (lost_ps_tasks(cluster.get("ps", []), e)
               if introspect.is_parameter_server(strategy) else [])
    if lost_ps:
      raise WorkerLostError(
          f"{me}: parameter server task {', '.join(lost_ps)} was lost "
          f"mid-training ({cause}). Its variables are gone, so this run "
          "cannot go on: restart the whole cluster, ps, workers and chief "
          "(tfdist launch --max-restarts K, or SLURM's requeue); with "
          "backup_dir training resumes from the last backup, restored onto "
          "the new ps tasks") from e
    raise WorkerLostError(
        f"{me}: a peer task died, stopped or stopped answering mid-training "
        f"({cause}). Restart the cluster (tfdist launch --max-restarts K, or "
        "SLURM's requeue); with backup_dir training resumes from the last "
        "backup") from e


def lost_ps_tasks(addresses: Sequence[str] | Mapping[int, str],
                  error: Exception) -> list[str]:
  """The ps tasks a ParameterServerStrategy error names, e.g. ``ps:0 at A``.

  A task is named when TensorFlow's message names it as a remote target or
  names its address (``addresses``: the cluster's ps job, a list or, for a
  sparse cluster, ``{index: address}``).
  """
  text = str(error)
  if isinstance(addresses, dict):  # A sparse cluster: {index: address}.
    addresses = [addresses.get(i, "?") for i in range(max(addresses) + 1)]
  lost = {int(i) for i in _REMOTE_PS.findall(text)}
  lost.update(i for i, address in enumerate(addresses)
              if re.search(re.escape(address) + r"(?!\d)", text))
  return [f"ps:{i} at {addresses[i]}" if i < len(addresses) else f"ps:{i}"
          for i in sorted(lost)]
