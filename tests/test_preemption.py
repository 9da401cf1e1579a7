"""Preemption with real processes: SIGTERM or SIGUSR1 -> one step, exit 42.

Each test starts the tasks of tests/scripts/fault_job.py, signals one of them
mid-training, checks that every task exits with the preempted code after
saving at the same step, then reruns the job and checks that it finishes with
exactly the steps due and the weights of an uninterrupted run.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

import cluster_utils
from tfdist.errors import PREEMPTED_EXIT_CODE

JOB = os.path.join(cluster_utils.SCRIPTS, "fault_job.py")
TOLERANCE = 1e-5


class Tasks:
  """Tasks started by a test; stdout read line by line, stderr to a file."""

  def __init__(self, configs, args, tmp, *, env=None):
    self.procs, self.errs = [], []
    for i, config in enumerate(configs or [None]):
      extra = dict(env or {})
      if config is not None:
        extra["TF_CONFIG"] = json.dumps(config)
      err = open(os.path.join(tmp, f"task{i}.err"), "w+")
      self.errs.append(err)
      self.procs.append(subprocess.Popen(
          [sys.executable, JOB, *args], env=cluster_utils.base_env(extra),
          stdout=subprocess.PIPE, stderr=err, text=True,
          start_new_session=True))
    self.lines = [[] for _ in self.procs]

  def wait_for_line(self, index, text, timeout):
    """Reads task ``index``'s stdout until a line equals ``text``."""
    deadline = time.monotonic() + timeout
    proc = self.procs[index]
    while time.monotonic() < deadline:
      line = proc.stdout.readline()
      if not line:
        break
      self.lines[index].append(line.rstrip("\n"))
      if line.rstrip("\n") == text:
        return
    raise AssertionError(f"task {index} never printed {text!r}:\n"
                         f"{self.stderr(index)}")

  def signal(self, index, signum):
    self.procs[index].send_signal(signum)

  def wait(self, timeout):
    """Exit codes; every task must end within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    codes = []
    for i, proc in enumerate(self.procs):
      try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        raise AssertionError(f"task {i} still running after {timeout} s") from None
      self.lines[i] += out.splitlines()
      codes.append(proc.returncode)
    return codes

  def json(self, index):
    for line in reversed(self.lines[index]):
      if line.startswith("{"):
        return json.loads(line)
    raise AssertionError(f"no JSON from task {index}:\n{self.stderr(index)}")

  def stderr(self, index):
    if self.errs[index].closed:
      with open(self.errs[index].name) as f:
        return f.read()[-3000:]
    self.errs[index].seek(0)
    return self.errs[index].read()[-3000:]

  def close(self):
    for proc in self.procs:  # Only the tasks this object started.
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
      proc.wait(timeout=30)
      if proc.stdout:
        proc.stdout.close()
    for err in self.errs:
      err.close()


def run_to_end(configs, args, tmp, timeout=240):
  tasks = Tasks(configs, args, tmp)
  try:
    codes = tasks.wait(timeout)
    for i, code in enumerate(codes):
      assert code == 0, f"task {i} exited {code}:\n{tasks.stderr(i)}"
    return [tasks.json(i) for i in range(len(codes))]
  finally:
    tasks.close()


def preempt(configs, args, tmp, *, target, signum, after_step, timeout=240):
  """Signals task ``target`` once task 0 printed ``step after_step``."""
  tasks = Tasks(configs, args, tmp)
  try:
    tasks.wait_for_line(0, f"step {after_step}", timeout)
    sent = time.monotonic()
    tasks.signal(target, signum)
    codes = tasks.wait(60)
    return codes, time.monotonic() - sent, tasks
  finally:
    tasks.close()


@pytest.mark.timeout(420)
class PreemptionTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with tempfile.TemporaryDirectory() as d:
      cls.fit_reference = run_to_end(
          None, ["default", "fit", os.path.join(d, "b"), "--sleep", "0"], d)[0]
      # Plain model.fit with tfdist.BackupAndRestore trains the same steps.
      cls.keras_reference = cls.fit_reference
      cls.runner_reference = run_to_end(
          None, ["default", "runner", os.path.join(d, "r"), "--sleep", "0"],
          d)[0]

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
          cluster_utils.worker_configs(2), args, d, target=target,
          signum=signum, after_step=5)
      self.assertEqual(codes, [PREEMPTED_EXIT_CODE] * 2,
                       tasks.stderr(0) + tasks.stderr(1))
      self.assertLess(seconds, 30)
      # Both saved at the same step.
      saved = [int(re.findall(r"checkpoint saved at step (\d+)",
                              tasks.stderr(i))[-1]) for i in (0, 1)]
      self.assertEqual(saved[0], saved[1])
      self.assertGreaterEqual(saved[0], 5)
      resumed = run_to_end(cluster_utils.worker_configs(2),
                           [*args, "--sleep", "0"], d)
    for out in resumed:
      self.assertEqual(out["iterations"], 18)
      np.testing.assert_allclose(out["weights"], reference["weights"],
                                 atol=TOLERANCE)
    if loop == "runner":
      self.assertEqual(resumed[0]["start"], saved[0])

  @parameterized.parameters("fit", "keras")
  def test_single_process_preempted_twice(self, loop):
    """Preempted twice in a row, a run still finishes exactly."""
    with tempfile.TemporaryDirectory() as d:
      args = ["mirrored", loop, os.path.join(d, "b")]
      for after in (3, 10):
        codes, seconds, tasks = preempt(None, args, d, target=0,
                                        signum=signal.SIGTERM,
                                        after_step=after)
        self.assertEqual(codes, [PREEMPTED_EXIT_CODE], tasks.stderr(0))
        self.assertLess(seconds, 20)
      out = run_to_end(None, [*args, "--sleep", "0"], d)[0]
      self.assertFalse(os.path.exists(os.path.join(d, "b")))
    self.assertEqual(out["iterations"], 18)
    np.testing.assert_allclose(out["weights"], self.fit_reference["weights"],
                               atol=TOLERANCE)


@pytest.mark.timeout(180)
class AgreementTest(parameterized.TestCase):
  """Workers agree about once per check_seconds, at the same steps."""

  @parameterized.named_parameters(
      # 10 ms steps, agreements every ~0.2 s: about one per 20 steps.
      ("rare_agreements", 0.2, 0.01, 60, 20),
      # check_seconds=0: an agreement at every step, as before.
      ("every_step", 0.0, 0.01, 60, 1),
  )
  def test_same_stop_step_with_few_all_reduces(self, check, sleep, signal_at,
                                               steps_per_agreement):
    results = cluster_utils.run_cluster(
        "agreement.py", cluster_utils.worker_configs(2),
        args=[str(check), str(sleep), str(signal_at)], timeout=150)
    outs = [r.json() for r in results]
    for r in results:
      self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    # Both stop at one step, at or after the signal, within one interval.
    self.assertEqual(outs[0]["stopped"], outs[1]["stopped"])
    self.assertEqual(outs[0]["agreements"], outs[1]["agreements"])
    stopped = outs[0]["stopped"]
    self.assertBetween(stopped, signal_at, signal_at + 3 * steps_per_agreement)
    if steps_per_agreement == 1:
      self.assertEqual(outs[0]["agreements"], stopped)
    else:
      self.assertLess(outs[0]["agreements"], stopped / 4)


if __name__ == "__main__":
  absltest.main()
