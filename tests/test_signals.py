"""The signal contract with real processes and real signals.

A preemption signal (SIGTERM, SIGUSR1) before training watches signals
(start-up, restore) exits 42 at once, saving nothing and saying so; during a
blocked MultiWorkerMirrored start-up too. SIGINT during training saves at
the next step and exits 130 without a traceback; a second SIGINT ends the
process at once. In-process: the watcher never loses a signal and agrees
about once per ``check_seconds`` however its calls are spaced.
"""

import os
import pickle
import re
import signal
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
import fault_runs
import stalls
import tfdist
from tfdist.errors import INTERRUPTED_EXIT_CODE
from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.training import preemption


def _has_guard_helper(pid: int) -> bool:
  return any(p.ppid == pid and "startup._watch()" in p.cmdline
             for p in cluster_utils.processes())


def _nothing_written(path: str) -> bool:
  return not os.path.exists(path) or not os.listdir(path)


@pytest.mark.beside  # One process, without a cluster.
@pytest.mark.timeout(300)
class BeforeTrainingTest(parameterized.TestCase):
  """Nothing exists to save yet: exit with the signal's code, saying so."""

  @parameterized.named_parameters(
      ("sigterm", signal.SIGTERM),
      ("sigusr1", signal.SIGUSR1),
  )
  def test_preemption_signal_before_training_exits_42(self, signum):
    with tempfile.TemporaryDirectory() as d:
      backup = os.path.join(d, "b")
      with cluster_utils.Tasks.of_script(
          fault_runs.JOB, args=["default", "fit", backup, "--pause", "60"]
      ) as tasks:
        tasks.wait_for(0, "paused", 120)
        sent = time.monotonic()
        tasks.signal(0, signum)
        code = tasks.wait(0, 20)
        err = tasks.stderr(0)
      self.assertEqual(code, PREEMPTED_EXIT_CODE, cluster_utils.tail(err))
      self.assertLess(stalls.running_since(sent), 20)
      self.assertIn(f"tfdist: {signal.Signals(signum).name} with nothing to "
                    "save yet", err)
      self.assertNotIn("Traceback", err)
      self.assertTrue(_nothing_written(backup))


@pytest.mark.timeout(300)
class BlockedStartupTest(parameterized.TestCase):
  """A signal while MultiWorkerMirrored start-up waits: nothing to save yet."""

  @parameterized.named_parameters(
      ("sigusr1_exits_42", signal.SIGUSR1, PREEMPTED_EXIT_CODE),
      ("sigint_ends_by_sigint", signal.SIGINT, -signal.SIGINT),
  )
  def test_signal_during_blocked_startup(self, signum, code):
    """Worker 0 waits for a peer that never starts; the group is signalled."""
    configs = cluster_utils.worker_configs(2)[:1]
    with tempfile.TemporaryDirectory() as d, cluster_utils.Tasks.of_script(
        fault_runs.JOB, configs,
        args=["multi_worker_mirrored", "fit", os.path.join(d, "b"),
              "--startup-timeout", "200"]) as tasks:
      tasks.wait_for(0, "building", 120)
      cluster_utils.wait_until(lambda: _has_guard_helper(tasks.pid(0)), 60)
      time.sleep(1)
      tasks.signal(0, signum, group=True)
      got = tasks.wait(0, 20)
      err = tasks.stderr(0)
    self.assertEqual(got, code, cluster_utils.tail(err))
    self.assertIn(f"{signal.Signals(signum).name} during cluster start-up: "
                  "nothing to save yet", err)


@pytest.mark.beside  # One process, without a cluster.
@pytest.mark.timeout(300)
class SigintTest(absltest.TestCase):
  """Ctrl-C saves at the next step and exits 130."""

  def test_sigint_saves_exits_130_and_resumes(self):
    with tempfile.TemporaryDirectory() as d:
      args = ["default", "fit", os.path.join(d, "b")]
      with cluster_utils.Tasks.of_script(fault_runs.JOB, args=args) as tasks:
        tasks.wait_for(0, "step 4", 120)
        tasks.signal(0, signal.SIGINT)
        code = tasks.wait(0, 30)
        err = tasks.stderr(0)
      self.assertEqual(code, INTERRUPTED_EXIT_CODE, cluster_utils.tail(err))
      self.assertNotIn("Traceback", err)
      saved = int(re.findall(r"checkpoint saved at step (\d+) in \S+; "
                             r"exiting with code 130", err)[-1])
      self.assertGreaterEqual(saved, 4)
      result = cluster_utils.run_script(fault_runs.JOB,
                                        args=[*args, "--sleep", "0"])
    self.assertEqual(result.returncode, 0, cluster_utils.tail(result.stderr))
    steps = [int(m) for m in re.findall(r"^step (\d+)$", result.stdout, re.M)]
    self.assertEqual(steps[0], saved + 1)  # Resumed, not started over.
    self.assertEqual(result.json()["iterations"], fault_runs.STEPS)


@pytest.mark.beside  # One process, without a cluster.
@pytest.mark.timeout(300)
class SecondSigintTest(absltest.TestCase):
  """A second Ctrl-C ends the process at once."""

  def test_second_sigint_exits_at_once(self):
    with tempfile.TemporaryDirectory() as d, cluster_utils.Tasks.of_script(
        fault_runs.JOB, args=["default", "fit", os.path.join(d, "b"),
                              "--sleep", "30"]) as tasks:
      tasks.wait_for(0, "step 1", 120)
      tasks.signal(0, signal.SIGINT)
      cluster_utils.wait_until(
          lambda: "SIGINT received" in tasks.stderr(0), 20)
      sent = time.monotonic()
      tasks.signal(0, signal.SIGINT)
      code = tasks.wait(0, 10)
      err = tasks.stderr(0)
    self.assertEqual(code, -signal.SIGINT, cluster_utils.tail(err))
    self.assertLess(stalls.running_since(sent), 10)
    self.assertNotIn("Traceback", err)


@pytest.mark.beside
class WatcherTest(parameterized.TestCase):
  """In this process, with the default strategy."""

  def test_signal_after_last_agreement_is_not_lost(self):
    strategy = tfdist.make_strategy("default", cluster=tfdist.ClusterInfo(
        source="local"))
    with self.assertRaises(tfdist.PreemptedError) as caught:
      with preemption.PreemptionWatcher(strategy):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)  # The handler runs; training then ends.
    self.assertEqual(caught.exception.code, PREEMPTED_EXIT_CODE)
    self.assertIsNone(caught.exception.step)
    self.assertIn("nothing saved", str(caught.exception))

  def test_stop_code_follows_the_signal(self):
    strategy = tfdist.make_strategy("default", cluster=tfdist.ClusterInfo(
        source="local"))
    watcher = preemption.PreemptionWatcher(strategy)
    with watcher:
      self.assertFalse(watcher.should_stop())
      os.kill(os.getpid(), signal.SIGUSR1)
      time.sleep(0.1)
      self.assertTrue(watcher.should_stop())
      with self.assertRaises(tfdist.PreemptedError) as caught:
        watcher.exit(7)
    self.assertEqual((caught.exception.code, caught.exception.step),
                     (PREEMPTED_EXIT_CODE, 7))
    self.assertEqual(tfdist.PreemptedError(step=3, signal_name="SIGINT").code,
                     INTERRUPTED_EXIT_CODE)

  def test_the_saved_directory_is_said_and_travels(self):
    error = tfdist.PreemptedError(step=4, signal_name="SIGTERM",
                                  directory="/shared/backup")
    again = pickle.loads(pickle.dumps(error))  # As a notebook worker's does.
    for e in (error, again):
      self.assertEqual(str(e), "stopped by SIGTERM: checkpoint saved at step "
                       "4 in /shared/backup; exiting with code 42 to be "
                       "restarted")
      self.assertEqual((e.directory, e.step, e.code),
                       ("/shared/backup", 4, PREEMPTED_EXIT_CODE))

  @parameterized.named_parameters(
      # The first agreement measured nothing: agree again at the next call.
      ("first_agreement", 1, None, 1.0, 1),
      # A near-zero span (two calls in one step) can at most double it.
      ("tiny_span_doubles_at_most", 1, 1e-6, 1.0, 2),
      ("ramps_up", 8, 1e-3, 1.0, 16),
      ("settles_at_check_seconds", 64, 0.05, 1.0, 20),
      ("capped", 1000, 1e-9, 1.0, preemption.MAX_CHECK_INTERVAL),
      ("every_call", 50, 0.01, 0.0, 1),
  )
  def test_next_interval(self, previous, per_call, check, expected):
    self.assertEqual(preemption.next_interval(previous, per_call, check),
                     expected)


if __name__ == "__main__":
  absltest.main()
