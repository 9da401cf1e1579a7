"""The program the cluster_configs/ templates run in tests (TFDIST_COMMAND).

Parses tfdist's flags (the parameter-server template exports TFDIST_SLURM_ROLES)
and prints one short ``RESULT {json}`` line per task. Modes:

* ``resolve``: resolves the cluster with `tfdist.flags.cluster_from_flags`;
  imports no TensorFlow, so it is quick. Under a ps, the ps and worker tasks
  are servers: each reports, then listens on its address until stopped; the
  chief reports only once every server accepts (a launcher stops its
  servers when the chief ends, so each must have reported by then).
* ``strategy``: builds the strategy with `tfdist.flags.strategy_from_flags`
  and all-reduces each replica's id + 1.
* ``signal``: waits for USR1 (what the template's trap forwards), reports it
  and then exits with ``--payload_usr1_exit`` (42, tfdist's preempted code,
  unless told otherwise); on a requeued run (SLURM_RESTART_COUNT > 0) it
  reports and exits 0 at once.
"""

import json
import os
import signal
import socket
import sys
import time

from absl import flags

import tfdist.flags

_MODE = flags.DEFINE_enum("payload_mode", "resolve",
                          ["resolve", "strategy", "signal"], "what to do")
_WAIT = flags.DEFINE_float(
    "payload_wait", 60.0, "max seconds to wait for USR1 (signal mode) or for "
    "a ps (resolve mode)")
_USR1_EXIT = flags.DEFINE_integer(
    "payload_usr1_exit", 42, "signal mode: exit code after USR1 came")


def _report(**extra):
  print("RESULT " + json.dumps({
      "procid": int(os.environ["SLURM_PROCID"]),
      "node": os.environ.get("SLURMD_NODENAME"),
      "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
      **extra}), flush=True)


def _host_port(address: str) -> tuple[str, int]:
  host, port = address.rsplit(":", 1)
  return host, int(port)


def _await(address: str) -> None:
  """Connects to a ps's address, retrying for up to --payload_wait s."""
  deadline = time.monotonic() + _WAIT.value
  while True:
    try:
      socket.create_connection(_host_port(address), timeout=5).close()
      return
    except OSError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.1)


def main():
  tfdist.flags.define_flags()
  tfdist.flags.parse_flags(sys.argv)
  if _MODE.value == "signal":
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(time.time()))
    if int(os.environ.get("SLURM_RESTART_COUNT", "0")) == 0:
      _report(waiting=True)
      deadline = time.time() + _WAIT.value
      while not got and time.time() < deadline:
        time.sleep(0.1)
    _report(usr1=bool(got))
    if got:
      sys.exit(_USR1_EXIT.value)
    return
  if _MODE.value == "resolve":
    info = tfdist.flags.cluster_from_flags()
    roles = ("ps", "worker") if "ps" in info.cluster else ()
    servers = [a for role in roles for a in info.cluster.get(role, ())]
    if info.task_type in roles:
      _report(task_type=info.task_type, task_id=info.task_id,
              cluster={k: list(v) for k, v in info.cluster.items()})
      with socket.create_server(_host_port(info.address)) as s:
        s.settimeout(_WAIT.value)
        while True:
          s.accept()[0].close()
    for address in servers:
      _await(address)
    _report(task_type=info.task_type, task_id=info.task_id,
            cluster={k: list(v) for k, v in info.cluster.items()})
    return
  strategy = tfdist.flags.strategy_from_flags()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @tf.function
  def replica_value():
    ctx = tf.distribute.get_replica_context()
    return tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)

  total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                          strategy.run(replica_value), axis=None)
  info = tfdist.flags.cluster_from_flags()
  _report(mwms=isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
          replicas=strategy.num_replicas_in_sync, sum=float(total),
          task_type=info.task_type, task_id=info.task_id,
          workers=len(info.cluster.get("worker", ())))


if __name__ == "__main__":
  main()
