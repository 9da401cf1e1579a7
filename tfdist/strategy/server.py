"""Serving ps and worker tasks for ParameterServerStrategy.

Under ParameterServerStrategy the same script runs on every task. The chief
(the coordinator) builds the strategy and trains; ``ps`` and ``worker`` tasks
only host a `tf.distribute.Server` that the chief drives. `serve` runs that
server until the chief has come and gone, so a task ends by itself (under
``srun`` as under ``tfdist launch``) instead of blocking forever.

A preemption signal (SIGTERM, SIGUSR1) reaches every task of a SLURM step or
a launcher's process groups at once; the chief then saves a backup, which
reads the variables the ps tasks hold. So while serving, those signals are
logged, not obeyed: the servers end once the chief has saved and gone.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

from absl import logging

import tensorflow as tf

from tfdist import _net
from tfdist import _process
from tfdist.cluster import names as names_lib
from tfdist.cluster import resolve as resolve_lib
from tfdist.cluster.info import ClusterInfo
from tfdist.errors import ConfigError
from tfdist.errors import PREEMPTION_SIGNALS
from tfdist.errors import StartupTimeoutError

__all__ = ["start_server", "serve", "end_served", "linger_at_exit",
           "DEFAULT_CHIEF_TIMEOUT", "POLL_SECONDS", "APPEAR_POLL_SECONDS",
           "CHIEF_LINGER_SECONDS"]

#: Seconds a server waits for the chief to appear before giving up.
DEFAULT_CHIEF_TIMEOUT = 600.0
#: How often a ps or worker task probes the chief's server (`serve`) once
#: it has seen it.
POLL_SECONDS = 1.0
#: How often it probes until then: a probe of a port nobody listens on costs
#: nothing, and a chief killed (SIGKILL, out of memory) within a second of
#: starting its server is still seen, so its servers end instead of waiting
#: for ``chief_timeout`` (measured: a chief SIGKILLed right after its first
#: step answered for under a second, and with 1 s probes its ps task
#: never saw it in 3 of 5 runs of tests/test_ps_faults.py's ServersEndTest).
APPEAR_POLL_SECONDS = 0.2
_PROBE_SECONDS = 1.0  # `_net.grpc_answers`' bound on one probe.
#: How long the chief's server keeps answering when the chief exits
#: (`linger_at_exit`): longer than the widest gap between two probes, so
#: every server sees the chief at least once, however short its run.
CHIEF_LINGER_SECONDS = POLL_SECONDS + _PROBE_SECONDS + 0.5
_GONE_AFTER = 3  # Failed probes in a row that mean the chief has ended.


def start_server(cluster: resolve_lib.ClusterLike | None = None
                 ) -> tf.distribute.Server:
  """Starts this task's server and returns it (it runs until the process ends).

  Worker servers get ``inter_op_parallelism_threads >= num_workers + 1``:
  with fewer a parameter-server cluster can deadlock on a 2-core machine.

  Raises:
    ConfigError: the task is not a ps or worker task of a cluster.
  """
  info: ClusterInfo = resolve_lib.resolve_cluster(cluster)
  if info.task_type not in ("ps", "worker") or info.address is None:
    raise ConfigError(
        field="task.type", value=info.task_type, source=info.origin,
        expected="ps or worker: only those tasks serve",
        hint="The chief builds make_strategy('parameter_server') instead")
  info = names_lib.resolve_names(info)
  config = tf.compat.v1.ConfigProto()
  if info.task_type == "worker":
    config.inter_op_parallelism_threads = max(4, info.num_workers + 1)
  return tf.distribute.Server(
      info.cluster_spec(), job_name=info.task_type, task_index=info.task_id,
      protocol=info.rpc_layer or "grpc", config=config, start=True)


def serve(cluster: resolve_lib.ClusterLike | None = None, *,
          chief_timeout: float = DEFAULT_CHIEF_TIMEOUT,
          poll_seconds: float = POLL_SECONDS) -> None:
  """Serves until the chief has connected and then gone away.

  Args:
    cluster: this task's cluster; resolved from the environment by default.
    chief_timeout: seconds to wait for the chief's server to answer.
    poll_seconds: how often the chief's server is probed once it has answered
      (`_net.grpc_answers`: its gRPC server must answer, not only its port
      accept); until then every `APPEAR_POLL_SECONDS` at most.

  Raises:
    ConfigError: the task is not a ps or worker task.
    StartupTimeoutError: the chief did not appear within ``chief_timeout``.
  """
  info = resolve_lib.resolve_cluster(cluster)
  server = start_server(info)
  del server  # Kept alive by the TensorFlow runtime until the process ends.
  me = f"{info.task_type}:{info.task_id}"
  if threading.current_thread() is threading.main_thread():
    for signum in PREEMPTION_SIGNALS:
      signal.signal(signum, lambda n, _: logging.warning(
          "tfdist: %s received by %s: serving until the chief has saved "
          "and ended", signal.Signals(n).name, me))
  chief = info.cluster["chief"][0]
  deadline = time.monotonic() + chief_timeout
  while not _net.grpc_answers(chief, timeout=_PROBE_SECONDS):
    if time.monotonic() > deadline:
      raise StartupTimeoutError(
          f"{me}: the chief at {chief} did not "
          f"start within {chief_timeout:g} s ({info.origin}); start it, or "
          "check its address")
    time.sleep(min(poll_seconds, APPEAR_POLL_SECONDS))
  misses = 0
  while misses < _GONE_AFTER:
    time.sleep(poll_seconds)
    misses = 0 if _net.grpc_answers(chief, timeout=_PROBE_SECONDS) else (
        misses + 1)


def linger_at_exit() -> None:
  """Keeps the chief's server answering for `CHIEF_LINGER_SECONDS` at exit.

  The ps and worker tasks end once they have seen the chief's server and
  then lost it (`serve`). A chief whose whole run fell between two of their
  probes (a short job, or one that fails fast) was never seen, and they
  would wait `DEFAULT_CHIEF_TIMEOUT` for it: measured on the two-node SLURM
  test bed, 1 run in 3 of a chief that ran one step kept its ps and worker
  serving until srun's 300 s bound. Registered once per process (atexit).
  """
  if _process.once(linger_at_exit):
    atexit.register(time.sleep, CHIEF_LINGER_SECONDS)


def end_served(info: ClusterInfo) -> None:
  """Ends a ps or worker process whose chief has ended: exit status 0.

  Says so on stderr, flushes, and leaves with ``os._exit``: the interpreter's
  normal teardown can hang on the running `tf.distribute.Server` (measured
  with TensorFlow 2.21: in 3 of 8 runs of tests/test_ps_faults.py's
  ServersEndTest a worker that had printed its last line after ``sys.exit(0)``
  was still running 30 s later). Nothing of the task is left to save: it
  only served the chief.
  """
  print(f"tfdist: {info.task_type}:{info.task_id} served the chief until it "
        "ended; exiting with 0", file=sys.stderr, flush=True)
  logging.flush()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(0)  # pylint: disable=protected-access
