"""Faults with real processes: a lost worker, a start-up that cannot finish.

Every wait is bounded and every process started here is killed by its PID.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

import cluster_utils
from test_preemption import JOB
from test_preemption import Tasks
from test_preemption import run_to_end

TOLERANCE = 1e-5
# A stopped task is noticed by TensorFlow's heartbeats (10-20 s measured,
# UPSTREAM.md); the bound leaves room for a loaded machine.
STOPPED_BOUND = 90


@pytest.mark.timeout(300)
class LostWorkerTest(absltest.TestCase):

  def test_sigkill_fails_fast_and_resumes_from_backup(self):
    with tempfile.TemporaryDirectory() as d:
      backup = os.path.join(d, "b")
      args = ["multi_worker_mirrored", "fit", backup]
      tasks = Tasks(cluster_utils.worker_configs(2), args, d)
      try:
        tasks.wait_for_line(0, "step 7", 240)
        killed = time.monotonic()
        tasks.signal(1, signal.SIGKILL)
        codes = tasks.wait(60)
        seconds = time.monotonic() - killed
        survivor = tasks.stderr(0)
      finally:
        tasks.close()
      self.assertEqual(codes[1], -signal.SIGKILL)
      self.assertNotIn(codes[0], (0, None))
      self.assertIn("WorkerLostError", survivor)
      self.assertIn("worker:0: a peer task died", survivor)
      self.assertLess(seconds, 30)
      resumed = run_to_end(cluster_utils.worker_configs(2),
                           [*args, "--sleep", "0"], d)
      reference = run_to_end(None, ["default", "fit", os.path.join(d, "r"),
                                    "--sleep", "0"], d)[0]
    for out in resumed:
      self.assertEqual(out["iterations"], 18)
      np.testing.assert_allclose(out["weights"], reference["weights"],
                                 atol=TOLERANCE)


@pytest.mark.timeout(300)
class KillAnyMomentTest(absltest.TestCase):

  def test_sigkill_at_random_moments_then_resume_is_exact(self):
    """Killed at random moments (saves every 2 steps, so some kills land
    mid-save), a run resumed each time still ends with exactly the steps and
    weights of an uninterrupted one: no half-written backup is ever loaded
    and no step is applied twice."""
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
      args = ["default", "fit", os.path.join(d, "b"), "--sleep", "0.02"]
      reached = []
      for _ in range(3):
        tasks = Tasks(None, args, d)
        try:
          tasks.wait_for_line(0, "building", 60)
          line = ""
          while not line.startswith("step "):
            line = tasks.procs[0].stdout.readline()
            if not line:
              break
          time.sleep(rng.uniform(0.0, 0.4))
          tasks.signal(0, signal.SIGKILL)
          self.assertEqual(tasks.wait(30), [-signal.SIGKILL])  # Mid-run.
          reached.append(line.strip())
        finally:
          tasks.close()
      out = run_to_end(None, [*args[:3], "--sleep", "0"], d)[0]
      reference = run_to_end(None, ["default", "fit", os.path.join(d, "r"),
                                    "--sleep", "0"], d)[0]
    print(f"first steps of the killed runs: {reached}")
    self.assertLen(reached, 3)
    self.assertEqual(out["iterations"], 18)
    np.testing.assert_allclose(out["weights"], reference["weights"],
                               atol=TOLERANCE)


@pytest.mark.timeout(240)
class StoppedTaskTest(parameterized.TestCase):
  """SIGSTOP: a task that is alive but answers nothing."""

  @parameterized.named_parameters(
      ("worker", 1, 0),
      # Worker 0 leads TensorFlow's coordination service.
      ("leader", 0, 1),
  )
  def test_sigstop_ends_in_a_clear_failure(self, stopped, survivor):
    with tempfile.TemporaryDirectory() as d:
      tasks = Tasks(cluster_utils.worker_configs(2),
                    ["multi_worker_mirrored", "fit", os.path.join(d, "b")], d)
      try:
        tasks.wait_for_line(0, "step 5", 180)
        sent = time.monotonic()
        tasks.signal(stopped, signal.SIGSTOP)
        deadline = sent + STOPPED_BOUND
        while (tasks.procs[survivor].poll() is None
               and time.monotonic() < deadline):
          time.sleep(0.5)
        seconds = time.monotonic() - sent
        code = tasks.procs[survivor].poll()
        err = tasks.stderr(survivor)
      finally:
        tasks.close()  # SIGKILL ends the stopped task too.
    self.assertIsNotNone(code, f"survivor still running after {seconds:.0f} s")
    self.assertNotEqual(code, 0)
    self.assertIn("WorkerLostError", err)
    print(f"SIGSTOP of {self._testMethodName}: survivor failed after "
          f"{seconds:.1f} s")


@pytest.mark.timeout(420)
class RelaunchTest(absltest.TestCase):

  def test_tfdist_launch_relaunches_after_sigkill_and_resumes(self):
    """`tfdist launch --max-restarts 1`: a worker SIGKILLed mid-epoch; the
    relaunched cluster resumes from the last backup (at most one backup
    interval, 2 steps, is redone) and ends with the uninterrupted weights."""
    with tempfile.TemporaryDirectory() as d:
      launcher = subprocess.Popen(
          [sys.executable, "-m", "tfdist", "launch", "--workers", "2",
           "--max-restarts", "1", "--grace-seconds", "5", "--",
           sys.executable, JOB, "multi_worker_mirrored", "fit",
           os.path.join(d, "b"), "--sleep", "0.2"],
          env=cluster_utils.base_env(), stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True, start_new_session=True)
      lines = []
      try:
        deadline = time.monotonic() + 240
        pid = None
        while time.monotonic() < deadline:
          line = launcher.stdout.readline()
          if not line:
            break
          lines.append(line.rstrip("\n"))
          if line.startswith("[worker:1] pid "):
            pid = int(line.split()[-1])
          if line.strip() == "[worker:0] step 7":
            os.kill(pid, signal.SIGKILL)
            break
        else:
          self.fail("worker:0 never reached step 7:\n" + "\n".join(lines))
        out, _ = launcher.communicate(timeout=240)
        lines += out.splitlines()
      finally:
        if launcher.poll() is None:
          os.killpg(launcher.pid, signal.SIGKILL)
          launcher.wait(timeout=30)
        launcher.stdout.close()
      reference = run_to_end(None, ["default", "fit", os.path.join(d, "r"),
                                    "--sleep", "0"], d)[0]
    text = "\n".join(lines)
    self.assertEqual(launcher.returncode, 0, text[-5000:])
    self.assertIn("task worker:1 was killed by signal 9", text)
    restart = lines.index(next(l for l in lines
                               if "restarting the cluster (1 of 1)" in l))
    before = [int(l.split()[-1]) for l in lines[:restart]
              if l.startswith("[worker:0] step ")]
    after = [int(l.split()[-1]) for l in lines[restart:]
             if l.startswith("[worker:0] step ")]
    # Resumed from a backup at most one interval (2 steps) behind.
    self.assertGreaterEqual(after[0] - 1, before[-1] - 2, text[-5000:])
    self.assertEqual(after[-1], 18)
    for role in ("worker:0", "worker:1"):
      out = json.loads(next(l for l in reversed(lines)
                            if l.startswith(f"[{role}] {{"))
                       .split(" ", 1)[1])
      self.assertEqual(out["iterations"], 18)
      np.testing.assert_allclose(out["weights"], reference["weights"],
                                 atol=TOLERANCE)


def _has_guard_helper(pid):
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(f"/proc/{entry}/cmdline") as f:
        cmdline = f.read()
    except (OSError, ValueError, IndexError):
      continue
    if ppid == pid and "startup._watch()" in cmdline:
      return True
  return False


@pytest.mark.timeout(180)
class StartupTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("a_peer_never_starts", 2, 1),
      ("two_of_three_launched", 3, 2),
  )
  def test_missing_tasks_time_out_naming_them(self, listed, launched):
    configs = cluster_utils.worker_configs(listed)
    missing = [f"worker:{i} at {a}" for i, a in
               enumerate(configs[0]["cluster"]["worker"]) if i >= launched]
    with tempfile.TemporaryDirectory() as d:
      tasks = Tasks(configs[:launched], ["multi_worker_mirrored", "fit",
                                         os.path.join(d, "b"),
                                         "--startup-timeout", "4"], d)
      start = time.monotonic()
      try:
        codes = tasks.wait(60)
        errs = [tasks.stderr(i) for i in range(launched)]
      finally:
        tasks.close()
    self.assertLess(time.monotonic() - start, 45)
    for code, err in zip(codes, errs):
      # Ended by its own bound (SIGKILL), or, when the leader's bound ended
      # the leader first, by the StartupTimeoutError make_strategy raises.
      self.assertIn(code, (-signal.SIGKILL, 1), err)
      self.assertIn("StartupTimeoutError", err)
      for task in missing:
        self.assertIn(task, err)

  def test_leader_lost_during_startup_names_it_and_the_missing(self):
    """The leader runs the coordination service; when it ends mid start-up,
    a waiting task fails at once with the same error, not a raw gRPC one."""
    configs = cluster_utils.worker_configs(3)
    workers = configs[0]["cluster"]["worker"]
    with tempfile.TemporaryDirectory() as d:
      tasks = Tasks(configs[:2], ["multi_worker_mirrored", "fit",
                                  os.path.join(d, "b")], d)
      try:
        for i in (0, 1):
          tasks.wait_for_line(i, "building", 60)
        deadline = time.monotonic() + 60
        while (not _has_guard_helper(tasks.procs[1].pid)
               and time.monotonic() < deadline):
          time.sleep(0.2)
        time.sleep(5)  # Worker 1 has reached the leader and waits.
        sent = time.monotonic()
        tasks.signal(0, signal.SIGKILL)
        codes = tasks.wait(45)
        seconds = time.monotonic() - sent
        err = tasks.stderr(1)
      finally:
        tasks.close()
    self.assertEqual(codes, [-signal.SIGKILL, 1], err)
    self.assertLess(seconds, 30)
    self.assertIn("StartupTimeoutError: worker:1: the cluster did not start: "
                  f"the leader worker:0 at {workers[0]} went away", err)
    self.assertIn(f"worker:2 at {workers[2]}", err)

  def test_sigterm_during_blocked_startup_exits(self):
    """As tfdist launch, srun and scancel send it: to the process group.

    A SIGTERM to the blocked PID alone is taken by a thread TensorFlow
    started at import, whose handler swallows it; startup_timeout_seconds
    still ends that task (docs/fault_tolerance.md).
    """
    with tempfile.TemporaryDirectory() as d:
      tasks = Tasks(cluster_utils.worker_configs(2)[:1],
                    ["multi_worker_mirrored", "fit", os.path.join(d, "b")], d)
      try:
        tasks.wait_for_line(0, "building", 60)
        # The start-up guard's helper runs while TensorFlow waits for the peer.
        deadline = time.monotonic() + 60
        while (not _has_guard_helper(tasks.procs[0].pid)
               and time.monotonic() < deadline):
          time.sleep(0.2)
        time.sleep(1)
        sent = time.monotonic()
        os.killpg(tasks.procs[0].pid, signal.SIGTERM)
        codes = tasks.wait(20)
        err = tasks.stderr(0)
      finally:
        tasks.close()
    self.assertEqual(codes, [-signal.SIGKILL], err)
    self.assertLess(time.monotonic() - sent, 20)
    self.assertIn("SIGTERM during cluster start-up", err)

  def test_port_taken_is_a_config_error_naming_the_address(self):
    configs = cluster_utils.worker_configs(2)
    address = configs[0]["cluster"]["worker"][0]
    with socket.socket() as holder, tempfile.TemporaryDirectory() as d:
      holder.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
      holder.listen()
      tasks = Tasks(configs[:1], ["multi_worker_mirrored", "fit",
                                  os.path.join(d, "b"), "--startup-timeout",
                                  "20"], d)
      try:
        codes = tasks.wait(60)
        err = tasks.stderr(0)
      finally:
        tasks.close()
    self.assertNotEqual(codes, [0])
    self.assertIn("ConfigError", err)
    self.assertIn(address, err)


if __name__ == "__main__":
  absltest.main()
