"""Multi-worker tasks leave together at a clean exit (tfdist.strategy.clean_exit).

Real 2-worker MultiWorkerMirroredStrategy clusters on localhost, one process
per task with its own TF_CONFIG. One task stays a while after the last
all-reduce, as Keras's `fit` does when it destroys its dataset iterators on
a busy machine; upstream, the task that leaves first makes the other log
coordination-service errors although nothing failed. A task that fails, in
any way, leaves at once: on two hosts of the network-namespace bed, every node
stops within README's bound.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist import _net

import cluster_utils
from cluster_utils import tail
import netbed

SCRIPT = "clean_exit.py"
# What TensorFlow logs when a peer of a finished job left before it.
NOISE = re.compile(r"StartAbort|UNAVAILABLE|stopped sending heartbeats|"
                   r"Failed to send RPC to coordination service")


#: How long the lingering task stays after the all-reduce: upstream, the task
#: still running logs errors within it once the leader left
#: (test_upstream_without_the_wait_the_lingering_task_logs_errors).
LINGER_S = "6"


def _left_at(result):
  times = re.findall(r"^LEFT_AT ([0-9.]+)$", result.stderr, re.M)
  if len(times) != 1:
    raise AssertionError("no LEFT_AT line:\n" + tail(result.stderr))
  return float(times[0])


def _run(*args, timeout=120):
  return cluster_utils.run_cluster(SCRIPT, cluster_utils.worker_configs(2),
                                   args=list(args), timeout=timeout)


@pytest.mark.timeout(400)
class CleanExitTest(absltest.TestCase):

  def test_leader_waits_for_a_lingering_worker_and_nobody_logs_errors(self):
    results = _run("--linger_task", "1", "--linger", LINGER_S)
    for r in results:
      self.assertEqual(r.returncode, 0, tail(r.stderr))
      self.assertEqual(r.json()["sum"], 2.0)
      self.assertIsNone(NOISE.search(r.stderr), tail(r.stderr))
    # The leader (worker 0) left only once worker 1 was done.
    self.assertGreaterEqual(_left_at(results[0]), results[1].json()["done_at"])

  def test_upstream_without_the_wait_the_lingering_task_logs_errors(self):
    # exit_timeout_seconds=None is TensorFlow's own behaviour: the leader
    # leaves at once and the task still running logs that it lost it.
    results = _run("--linger_task", "1", "--linger", LINGER_S,
                   "--exit_timeout", "none")
    self.assertEqual([r.returncode for r in results], [0, 0])
    self.assertLess(_left_at(results[0]), results[1].json()["done_at"])
    self.assertRegex(results[1].stderr, NOISE)

  def test_failing_task_leaves_at_once(self):
    results = _run("--fail_task", "1", "--linger_task", "0", "--linger",
                   "5")
    self.assertNotEqual(results[1].returncode, 0)
    self.assertIn("task 1 fails on purpose", results[1].stderr)
    # Worker 1 did not wait at the exit barrier for worker 0.
    self.assertLess(_left_at(results[1]), results[0].json()["done_at"])

  def test_wait_is_bounded_and_says_so(self):
    results = _run("--linger_task", "1", "--linger", "6", "--exit_timeout",
                   "2")
    leader = results[0]
    self.assertEqual(leader.returncode, 0, tail(leader.stderr))
    self.assertRegex(
        leader.stderr,
        r"tfdist: worker:0 waited \d+ s at exit for the other tasks \(bound "
        r"2 s, exit_timeout_seconds\) and leaves without them")
    self.assertLess(_left_at(leader), results[1].json()["done_at"])


# A task of a 2-worker cluster ends by PROGRAM; an atexit handler registered
# after tfdist's (so it runs first) says whether tfdist would wait, and
# leaves before TensorFlow is needed.
_ENDING = """
import atexit, os, sys
from absl import app
import tfdist
from tfdist.strategy import clean_exit

def main(argv=None):
  armed = clean_exit.arm(tfdist.ClusterInfo(
      cluster={"worker": ["a:1", "b:1"]}, task_type="worker", task_id=0,
      source="explicit"), 1)
  atexit.register(lambda: (print("wait" if armed.clean_end() else "leave",
                                 flush=True), os._exit(0)))
  %s

if __name__ == "__main__":
  %s
"""


@pytest.mark.beside  # One short process at a time.
class EndTest(parameterized.TestCase):
  """Only a clean end (exit status 0) waits at the exit barrier."""

  @parameterized.named_parameters(
      ("runs_to_its_end", "pass", "main()", "wait"),
      ("sys_exit_0", "sys.exit(0)", "main()", "wait"),
      ("sys_exit_of_main", "return 0", "sys.exit(main())", "wait"),
      ("absl_app_run", "pass", "app.run(main)", "wait"),
      ("sys_exit_caught", "try: sys.exit(3)\n  except SystemExit: pass",
       "main()", "wait"),
      ("sys_exit_3", "sys.exit(3)", "main()", "leave"),
      ("sys_exit_of_main_3", "return 3", "sys.exit(main())", "leave"),
      ("sys_exit_of_a_local", "status = 0\n  return status",
       "sys.exit(main())", "wait"),
      ("sys_exit_of_a_local_3", "status = 3\n  return status",
       "sys.exit(main())", "leave"),
      ("sys_exit_of_an_expression", "return int('0')", "sys.exit(main())",
       "leave"),  # Unknown: leaving at once is the safe side.
      ("absl_app_run_3", "return 3", "app.run(main)", "leave"),
      ("system_exit_raised", "raise SystemExit(3)", "main()", "leave"),
      ("builtin_exit", "exit(3)", "main()", "leave"),
      ("preempted", "raise tfdist.PreemptedError(step=1, "
       "signal_name='SIGTERM')", "main()", "leave"),
      ("uncaught_exception", "raise ValueError('x')", "main()", "leave"),
  )
  def test_waits_only_at_a_clean_end(self, body, ending, expected):
    r = subprocess.run([sys.executable, "-c", _ENDING % (body, ending)],
                       env=cluster_utils.base_env(), capture_output=True,
                       text=True, timeout=60, cwd=cluster_utils.REPO)
    self.assertEqual(r.stdout.strip(), expected, r.stderr)


_BED = netbed.netbed_unavailable_reason()
GRACE_S = 2
#: README: a task that fails anywhere "stops every node within 10 s plus
#: `--grace-seconds`".
BOUND_S = 10 + GRACE_S


def _exit_times(procs, timeout):
  """``time.time()`` at which each process was seen ended (bounded)."""
  ended = [None] * len(procs)
  deadline = time.monotonic() + timeout
  while None in ended and time.monotonic() < deadline:
    for i, proc in enumerate(procs):
      if ended[i] is None and proc.poll() is not None:
        ended[i] = time.time()
    time.sleep(0.05)
  return ended


@pytest.mark.timeout(240)
@absltest.skipIf(_BED is not None, _BED)
class FailureOnTwoHostsTest(parameterized.TestCase):
  """Worker 1 fails on node 2 while worker 0 lingers on node 1."""

  @parameterized.named_parameters(
      # The launcher reads every nonzero exit code alike (an uncaught
      # exception's 1 and os._exit(5) too; that a task failing by an
      # exception leaves at once, EndTest and CleanExitTest check); a signal
      # is its other path.
      ("sys_exit", "exit", 3),
      ("signal", "signal", 128 + signal.SIGKILL),
  )
  def test_every_node_stops_within_the_bound(self, fail, code):
    env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: "exit-bound"})
    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    with netbed.NetBed(hosts=("node1", "node2")) as bed:
      master = bed.address("node1")
      procs = [bed.popen(host, [
          sys.executable, "-m", "tfdist", "launch", "--nnodes", "2",
          "--node-rank", str(rank), "--master-addr", master,
          "--master-port", "29400", "--grace-seconds", str(GRACE_S), "--",
          sys.executable, os.path.join(cluster_utils.SCRIPTS, SCRIPT),
          "--fail_task", "1", "--fail", fail, "--linger_task", "0",
          "--linger", "120"], env=env, cwd=cluster_utils.REPO, stdout=log,
          stderr=subprocess.STDOUT, text=True)
          for rank, (host, log) in enumerate(zip(bed.hosts, logs))]
      ended = _exit_times(procs, timeout=180)
    outs = []
    for log in logs:
      log.seek(0)
      outs.append(log.read())
      log.close()
    self.assertEqual([p.returncode for p in procs], [code, code], outs)
    fails_at = float(re.search(r"FAILS_AT ([0-9.]+)", outs[1]).group(1))
    stopped = [round(t - fails_at, 1) for t in ended]
    print(f"{fail}: nodes stopped {stopped} s after the failure")
    self.assertLess(max(stopped), BOUND_S, outs)


if __name__ == "__main__":
  absltest.main()
