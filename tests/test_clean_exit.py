"""Multi-worker tasks leave together at a clean exit (tfdist.strategy.clean_exit).

Real 2-worker MultiWorkerMirroredStrategy clusters on localhost, one process
per task with its own TF_CONFIG. One task stays a while after the last
all-reduce, as Keras's `fit` does when it destroys its dataset iterators on
a busy machine; upstream, the task that leaves first makes the other log
coordination-service errors although nothing failed.
"""

import re

from absl.testing import absltest
import pytest

import cluster_utils
from cluster_utils import tail

SCRIPT = "clean_exit.py"
# What TensorFlow logs when a peer of a finished job left before it.
NOISE = re.compile(r"StartAbort|UNAVAILABLE|stopped sending heartbeats|"
                   r"Failed to send RPC to coordination service")


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
    results = _run("--linger_task", "1", "--linger", "12")
    for r in results:
      self.assertEqual(r.returncode, 0, tail(r.stderr))
      self.assertEqual(r.json()["sum"], 2.0)
      self.assertIsNone(NOISE.search(r.stderr), tail(r.stderr))
    # The leader (worker 0) left only once worker 1 was done.
    self.assertGreaterEqual(_left_at(results[0]), results[1].json()["done_at"])

  def test_upstream_without_the_wait_the_lingering_task_logs_errors(self):
    # exit_timeout_seconds=None is TensorFlow's own behaviour: the leader
    # leaves at once and the task still running logs that it lost it.
    results = _run("--linger_task", "1", "--linger", "12",
                   "--exit_timeout", "none")
    self.assertEqual([r.returncode for r in results], [0, 0])
    self.assertLess(_left_at(results[0]), results[1].json()["done_at"])
    self.assertRegex(results[1].stderr, NOISE)

  def test_failing_task_leaves_at_once(self):
    results = _run("--raise_task", "1", "--linger_task", "0", "--linger",
                   "15")
    self.assertNotEqual(results[1].returncode, 0)
    self.assertIn("task 1 fails on purpose", results[1].stderr)
    # Worker 1 did not wait at the exit barrier for worker 0.
    self.assertLess(_left_at(results[1]), results[0].json()["done_at"])

  def test_wait_is_bounded_and_says_so(self):
    results = _run("--linger_task", "1", "--linger", "10", "--exit_timeout",
                   "2")
    leader = results[0]
    self.assertEqual(leader.returncode, 0, tail(leader.stderr))
    self.assertRegex(
        leader.stderr,
        r"tfdist: worker:0 waited \d+ s at exit for the other tasks \(bound "
        r"2 s, exit_timeout_seconds\) and leaves without them")
    self.assertLess(_left_at(leader), results[1].json()["done_at"])


if __name__ == "__main__":
  absltest.main()
