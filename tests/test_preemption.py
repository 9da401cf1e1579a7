"""Preemption with real processes: SIGTERM or SIGUSR1 -> one step, exit 42.

Each test starts the tasks of tests/scripts/fault_job.py, signals one of them
mid-training, checks that every task exits with the preempted code after
saving at the same step, then reruns the job and checks that it finishes with
exactly the steps due and the weights of an uninterrupted run.
"""

import concurrent.futures
import json
import os
import re
import shutil
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


def preempt(configs, args, *, target, signum, after_step, timeout=240):
  """Signals task ``target`` once task 0 printed ``step after_step``.

  Returns:
    The exit codes, the seconds from the signal to the last exit, and the
    (closed) tasks, whose output stays readable.
  """
  with cluster_utils.Tasks.of_script(fault_runs.JOB, configs,
                                     args=args) as tasks:
    tasks.wait_for(0, f"step {after_step}", timeout)
    sent = time.monotonic()
    tasks.signal(target, signum)
    codes = tasks.wait_all(60)
    return codes, stalls.running_since(sent), tasks


def _preempted_twice(d, loop):
  """A single-process run preempted after step 3 and again after step 10,
  then run to its end.

  Returns:
    Each preemption's exit codes, seconds from the signal to the exit and
    stderr; the last run's JSON; whether its backup was kept.
  """
  os.makedirs(d)
  args = ["mirrored", loop, os.path.join(d, "b")]
  preemptions = []
  for after in (3, 10):
    codes, seconds, tasks = preempt([None], args, target=0,
                                    signum=signal.SIGTERM, after_step=after)
    preemptions.append((codes, seconds, tasks.stderr(0)))
  out = cluster_utils.run_to_end(fault_runs.JOB,
                                 args=[*args, "--sleep", "0"])[0]
  return preemptions, out, os.path.exists(os.path.join(d, "b"))


@pytest.mark.timeout(420)
class PreemptionTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    """The references, then test_single_process_preempted_twice's runs, two
    single processes at a time (the load of one 2-worker cluster)."""
    super().setUpClass()
    d = tempfile.mkdtemp()
    cls.addClassCleanup(shutil.rmtree, d, ignore_errors=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      fit, runner = (pool.submit(fault_runs.reference, loop)
                     for loop in ("fit", "runner"))
      cls.fit_reference, cls.runner_reference = fit.result(), runner.result()
      # Plain model.fit with tfdist.BackupAndRestore trains the same steps.
      cls.keras_reference = cls.fit_reference
      cls.preempted_twice = {
          loop: pool.submit(_preempted_twice, os.path.join(d, loop), loop)
          for loop in ("fit", "keras")}
    # Leaving the block waited for them; a failure is raised in its test.

  @parameterized.named_parameters(
      # One worker gets the signal, as from a cloud preemption of one node.
      ("fit_sigterm_one_worker", "fit", signal.SIGTERM, 1),
      # SLURM's --signal=USR1@N, forwarded to the tasks (here: the leader).
      ("runner_sigusr1_leader", "runner", signal.SIGUSR1, 0),
      # Plain model.fit, hooked by the tfdist.BackupAndRestore callback.
      ("keras_fit_sigterm_leader", "keras", signal.SIGTERM, 0),
  )
  def test_multi_worker_mirrored(self, loop, signum, target):
    reference = getattr(self, f"{loop}_reference")
    with tempfile.TemporaryDirectory() as d:
      ckpt = os.path.join(d, "ckpt")
      args = ["multi_worker_mirrored", loop, ckpt]
      codes, seconds, tasks = preempt(
          cluster_utils.worker_configs(2), args, target=target,
          signum=signum, after_step=5)
      self.assertEqual(codes, [tfdist.PREEMPTED_EXIT_CODE] * 2,
                       cluster_utils.tail(tasks.stderr(0))
                       + cluster_utils.tail(tasks.stderr(1)))
      self.assertLess(seconds, 30)
      # Both saved at the same step.
      saved = [int(re.findall(r"checkpoint saved at step (\d+)",
                              tasks.stderr(i))[-1]) for i in (0, 1)]
      self.assertEqual(saved[0], saved[1])
      self.assertGreaterEqual(saved[0], 5)
      resumed = cluster_utils.run_to_end(
          fault_runs.JOB, cluster_utils.worker_configs(2),
          args=[*args, "--sleep", "0"])
    for out in resumed:
      fault_runs.assert_like(self, out, reference)
    if loop == "runner":
      self.assertEqual(resumed[0]["start"], saved[0])

  @parameterized.parameters("fit", "keras")
  def test_single_process_preempted_twice(self, loop):
    """Preempted twice in a row, a run still finishes exactly."""
    preemptions, out, backup_kept = self.preempted_twice[loop].result()
    self.assertLen(preemptions, 2)
    for codes, seconds, stderr in preemptions:
      self.assertEqual(codes, [tfdist.PREEMPTED_EXIT_CODE],
                       cluster_utils.tail(stderr))
      self.assertLess(seconds, 20)
    self.assertFalse(backup_kept)
    fault_runs.assert_like(self, out, self.fit_reference)


@pytest.mark.timeout(180)
class AgreementTest(parameterized.TestCase):
  """Workers agree about once per check_seconds, at the same steps.

  One cluster runs both watchers, one after the other (agreement.py).
  """

  SLEEP, SIGNAL_AT = 0.01, 60  # 10 ms steps; the signal at step 60.

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results = cluster_utils.run_cluster(
        "agreement.py", cluster_utils.worker_configs(2),
        args=[str(cls.SLEEP), str(cls.SIGNAL_AT), "0.2", "0.0"], timeout=150)

  @parameterized.named_parameters(
      # Agreements every ~0.2 s: about one per 20 steps.
      ("rare_agreements", 0, 0.2, 20),
      # check_seconds=0: an agreement at every step, as before.
      ("every_step", 1, 0.0, 1),
  )
  def test_same_stop_step_with_few_all_reduces(self, index, check,
                                               steps_per_agreement):
    for r in self.results:
      self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    outs = [[json.loads(line) for line in r.stdout.splitlines()
             if line.startswith("{")][index] for r in self.results]
    self.assertEqual(outs[0]["check_seconds"], check)
    # Both stop at one step, at or after the signal, within one interval.
    self.assertEqual(outs[0]["stopped"], outs[1]["stopped"])
    self.assertEqual(outs[0]["agreements"], outs[1]["agreements"])
    stopped = outs[0]["stopped"]
    self.assertBetween(stopped, self.SIGNAL_AT,
                       self.SIGNAL_AT + 3 * steps_per_agreement)
    if steps_per_agreement == 1:
      self.assertEqual(outs[0]["agreements"], stopped)
    else:
      self.assertLess(outs[0]["agreements"], stopped / 4)


if __name__ == "__main__":
  absltest.main()
