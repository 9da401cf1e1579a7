"""Faults with real processes: a lost worker, a start-up that cannot finish.

Every wait is bounded and every process started here is killed by its PID or
process group (tests/cluster_utils.py).
"""

import json
import os
import random
import re
import signal
import socket
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
from cluster_utils import tail
import tfdist
import fault_runs
import stalls
from fault_runs import JOB
# A stopped task is noticed by TensorFlow's heartbeats: measured with
# TensorFlow 2.21 on the test machine, the survivor failed 10-20 s after the
# SIGSTOP (2-3 s after a SIGKILL). The bound leaves room for a loaded machine.
STOPPED_BOUND = 90


def _mwms(configs, d, *extra, loop="fit", env=None):
  """fault_job.py training with MultiWorkerMirrored, one task per config."""
  return cluster_utils.Tasks.of_script(
      JOB, configs, env=env,
      args=["multi_worker_mirrored", loop, os.path.join(d, "b"), *extra])


def _kill_worker_1(tasks):
  """SIGKILLs worker 1 mid-training: exit codes, the seconds (of running)
  until both ended, and worker 0's stderr."""
  tasks.wait_for(0, "step 7", 240)
  killed = time.monotonic()
  tasks.signal(1, signal.SIGKILL)
  codes = tasks.wait_all(60)
  return codes, stalls.running_since(killed), tasks.stderr(0)


def _wait_for_guard_helper(tasks, index):
  """Until the start-up guard's helper of task ``index`` runs (it does while
  TensorFlow waits for a peer), at most 60 s."""
  pid = tasks.pid(index)
  cluster_utils.wait_until(
      lambda: any(p.ppid == pid and "startup._watch()" in p.cmdline
                  for p in cluster_utils.processes()), 60)


@pytest.mark.timeout(300)
class LostWorkerTest(absltest.TestCase):

  def test_sigkill_fails_fast_and_resumes_from_backup(self):
    with tempfile.TemporaryDirectory() as d:
      args = ["multi_worker_mirrored", "fit", os.path.join(d, "b")]
      with _mwms(cluster_utils.worker_configs(2), d) as tasks:
        codes, seconds, survivor = _kill_worker_1(tasks)
      self.assertEqual(codes[1], -signal.SIGKILL)
      self.assertNotIn(codes[0], (0, None))
      self.assertIn("WorkerLostError", survivor)
      self.assertIn("worker:0: a peer task died", survivor)
      self.assertLess(seconds, 30)
      resumed = cluster_utils.run_to_end(
          JOB, cluster_utils.worker_configs(2), args=[*args, "--sleep", "0"])
      reference = fault_runs.reference()
    for out in resumed:
      fault_runs.assert_like(self, out, reference)


# As under tfdist launch and tfdist slurm (a job secret): the socket ring
# carries the gradients (docs/benchmarks.md, "The default transport").
SOCKET_ENV = {"TFDIST_JOB_SECRET": "fault-test", "TFDIST_TRANSPORT": "auto"}


@pytest.mark.timeout(300)
class LostWorkerSocketTest(parameterized.TestCase):
  """A lost peer under the socket transport is a WorkerLostError too.

  Whichever notices first: the ring (its error comes out of TensorFlow as an
  ``UnknownError``, raised inside ``tf.numpy_function``, and tfdist.fit and
  Runner raise the ring's `WorkerLostError`, which names the peer), or a
  collective of the same step (the preemption agreement, the metrics).
  tests/test_transport.py's ``die`` case has only the ring.
  """

  @parameterized.parameters("fit", "runner")
  def test_sigkill_is_a_worker_lost_error_naming_the_peer(self, loop):
    with tempfile.TemporaryDirectory() as d, _mwms(
        cluster_utils.worker_configs(2), d, loop=loop, env=SOCKET_ENV) as tasks:
      codes, seconds, survivor = _kill_worker_1(tasks)
    self.assertEqual(codes[1], -signal.SIGKILL)
    self.assertNotIn(codes[0], (0, None))
    # The exception the survivor ended with: the last of its traceback.
    raised = re.findall(r"^([\w.]+Error): (.*)$", survivor, re.M)
    self.assertTrue(raised, tail(survivor))
    self.assertEqual(raised[-1][0], "tfdist.errors.WorkerLostError",
                     tail(survivor))
    self.assertRegex(raised[-1][1],
                     r"^(socket transport: worker:0 lost worker:1 "
                     r"\(127\.0\.0\.1\)|worker:0: a peer task died)")
    self.assertIn("estart the cluster", raised[-1][1])
    self.assertLess(seconds, 30)


@pytest.mark.beside  # One process at a time, without a cluster.
@pytest.mark.timeout(300)
class KillAnyMomentTest(absltest.TestCase):

  def test_sigkill_at_random_moments_then_resume_is_exact(self):
    """Killed at random moments (saves every 2 steps, so some kills land
    mid-save), a run resumed each time still ends with exactly the steps and
    weights of an uninterrupted one: no half-written backup is ever loaded
    and no step is applied twice."""
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
      # 0.1 s a step: a kill within 0.4 s of a run's first step lands at
      # most ~5 steps in, so three runs never reach the 18th (the last).
      args = ["default", "fit", os.path.join(d, "b"), "--sleep", "0.1"]
      reached = []
      for _ in range(3):
        with cluster_utils.Tasks.of_script(JOB, args=args) as tasks:
          tasks.wait_for(0, "building", 60)
          line = tasks.wait_for(0, lambda l: l.startswith("step "), 240)
          time.sleep(rng.uniform(0.0, 0.4))
          tasks.signal(0, signal.SIGKILL)
          self.assertEqual(tasks.wait_all(30), [-signal.SIGKILL])  # Mid-run.
          reached.append(line.strip())
      out = cluster_utils.run_to_end(JOB, args=[*args[:3], "--sleep", "0"])[0]
      reference = fault_runs.reference()
    print(f"first steps of the killed runs: {reached}")
    self.assertLen(reached, 3)
    fault_runs.assert_like(self, out, reference)


@pytest.mark.timeout(240)
class StoppedTaskTest(parameterized.TestCase):
  """SIGSTOP: a task that is alive but answers nothing."""

  @parameterized.named_parameters(
      ("worker", 1, 0),
      # Worker 0 leads TensorFlow's coordination service.
      ("leader", 0, 1),
  )
  def test_sigstop_ends_in_a_clear_failure(self, stopped, survivor):
    with tempfile.TemporaryDirectory() as d, _mwms(
        cluster_utils.worker_configs(2), d) as tasks:
      tasks.wait_for(0, "step 5", 180)
      sent = time.monotonic()
      tasks.signal(stopped, signal.SIGSTOP)
      cluster_utils.wait_until(lambda: not tasks.running(survivor),
                               STOPPED_BOUND, interval=0.5)
      seconds = stalls.running_since(sent)
      code = None if tasks.running(survivor) else tasks.wait(survivor, 0)
      err = tasks.stderr(survivor)
    # Leaving the block SIGKILLed the stopped task too.
    self.assertIsNotNone(code, f"survivor still running after {seconds:.0f} s")
    self.assertNotEqual(code, 0)
    self.assertIn("WorkerLostError", err)
    print(f"SIGSTOP of {self._testMethodName}: survivor failed after "
          f"{seconds:.1f} s")


@pytest.mark.timeout(240)
class SkippedCollectiveTest(parameterized.TestCase):
  """A worker that skips a collective the other waits in: bounded, named.

  Worker 1 takes one step fewer than worker 0 and then sleeps (600 s);
  worker 0's step fails after the collective timeout (5 s here) instead of
  waiting for it.
  """

  @parameterized.named_parameters(
      ("collective_first_step", "collective", "first",
       "DeadlineExceededError", "Collective has timed out"),
      ("collective_later_step", "collective", "second",
       "DeadlineExceededError", "Collective has timed out"),
      # The ring connects at its first all-reduce: the peer never came.
      ("socket_first_step", "socket", "first", "UnknownError",
       "StartupTimeoutError: socket transport: worker:0 waited 5 s for "
       "worker:1"),
      ("socket_later_step", "socket", "second", "UnknownError",
       "WorkerLostError: socket transport: worker:0 lost worker:1"),
  )
  def test_the_waiting_worker_fails_within_the_timeout(
      self, transport, which, error, message):
    with cluster_utils.Tasks.of_script(
        "skipped_collective.py", cluster_utils.worker_configs(2),
        args=[transport, which, "5"],
        env=cluster_utils.base_env({"TFDIST_JOB_SECRET": "skip"})) as tasks:
      code = tasks.wait(0, 180)
      out = tasks.stdout(0)
    # Leaving the block SIGKILLed worker 1, still asleep.
    self.assertEqual(code, 0, tasks.stderr(0)[-3000:])
    outcome = json.loads(out.strip().splitlines()[-1])
    self.assertEqual(outcome["error"], error, outcome)
    self.assertIn(message, outcome["message"])
    # It waited for the bound, and not for worker 1 (600 s).
    self.assertBetween(outcome["seconds"], 4.5, 120)


@pytest.mark.timeout(420)
class RelaunchTest(absltest.TestCase):

  def test_tfdist_launch_relaunches_after_sigkill_and_resumes(self):
    """`tfdist launch --max-restarts 1`: a worker SIGKILLed mid-epoch; the
    relaunched cluster resumes from the last backup (at most one backup
    interval, 2 steps, is redone) and ends with the uninterrupted weights."""
    with tempfile.TemporaryDirectory() as d:
      with cluster_utils.Tasks(
          commands=[[sys.executable, "-m", "tfdist", "launch", "--workers",
                     "2", "--max-restarts", "1", "--grace-seconds", "2", "--",
                     sys.executable, os.path.join(cluster_utils.SCRIPTS, JOB),
                     "multi_worker_mirrored", "fit", os.path.join(d, "b"),
                     "--sleep", "0.2"]],
          envs=[cluster_utils.base_env()], merge_stderr=True) as launcher:
        launcher.wait_for(0, lambda l: l.strip() == "[worker:0] step 7", 240)
        pid = int(next(l for l in launcher.lines(0)
                       if l.startswith("[worker:1] pid ")).split()[-1])
        os.kill(pid, signal.SIGKILL)  # A task the launcher started.
        code = launcher.wait(0, 240)
        lines = launcher.lines(0)
      reference = fault_runs.reference()
    text = "\n".join(lines)
    self.assertEqual(code, 0, tail(text, 5000))
    self.assertIn("task worker:1 was killed by signal 9", text)
    restart = lines.index(next(l for l in lines
                               if "restart 1 of 1" in l))
    before = [int(l.split()[-1]) for l in lines[:restart]
              if l.startswith("[worker:0] step ")]
    after = [int(l.split()[-1]) for l in lines[restart:]
             if l.startswith("[worker:0] step ")]
    # Resumed from a backup at most one interval (2 steps) behind.
    self.assertGreaterEqual(after[0] - 1, before[-1] - 2, tail(text, 5000))
    self.assertEqual(after[-1], fault_runs.STEPS)
    for role in ("worker:0", "worker:1"):
      out = json.loads(next(l for l in reversed(lines)
                            if l.startswith(f"[{role}] {{"))
                       .split(" ", 1)[1])
      fault_runs.assert_like(self, out, reference)


@pytest.mark.timeout(180)
class StartupTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # The leader waits for a missing task here as it does with no peer
      # started (2 listed, 1 launched, a row once: the same wait and message).
      ("two_of_three_launched", 3, 2),
  )
  def test_missing_tasks_time_out_naming_them(self, listed, launched):
    configs = cluster_utils.worker_configs(listed)
    missing = [f"worker:{i} at {a}" for i, a in
               enumerate(configs[0]["cluster"]["worker"]) if i >= launched]
    with tempfile.TemporaryDirectory() as d, _mwms(
        configs[:launched], d, "--startup-timeout", "4") as tasks:
      start = time.monotonic()
      codes = tasks.wait_all(60)
      errs = [tasks.stderr(i) for i in range(launched)]
    self.assertLess(stalls.running_since(start), 45)
    for code, err in zip(codes, errs):
      # Ended by its own bound (SIGKILL), or, when the leader's bound ended
      # the leader first, by the StartupTimeoutError make_strategy raises.
      self.assertIn(code, (-signal.SIGKILL, 1), tail(err))
      self.assertIn("StartupTimeoutError", err)
      for task in missing:
        self.assertIn(task, err)

  def test_leader_lost_during_startup_names_it_and_the_missing(self):
    """The leader runs the coordination service; when it ends mid start-up,
    a waiting task fails at once with the same error, not a raw gRPC one."""
    configs = cluster_utils.worker_configs(3)
    workers = configs[0]["cluster"]["worker"]
    with tempfile.TemporaryDirectory() as d, _mwms(configs[:2], d) as tasks:
      for i in (0, 1):
        tasks.wait_for(i, "building", 60)
      _wait_for_guard_helper(tasks, 1)
      time.sleep(5)  # Worker 1 has reached the leader and waits.
      sent = time.monotonic()
      tasks.signal(0, signal.SIGKILL)
      codes = tasks.wait_all(45)
      seconds = stalls.running_since(sent)
      err = tasks.stderr(1)
    self.assertEqual(codes, [-signal.SIGKILL, 1], tail(err))
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
    with tempfile.TemporaryDirectory() as d, _mwms(
        cluster_utils.worker_configs(2)[:1], d) as tasks:
      tasks.wait_for(0, "building", 60)
      # The start-up guard's helper runs while TensorFlow waits for the peer.
      _wait_for_guard_helper(tasks, 0)
      time.sleep(1)
      sent = time.monotonic()
      tasks.signal(0, signal.SIGTERM, group=True)
      codes = tasks.wait_all(20)
      err = tasks.stderr(0)
    # Nothing to save yet: the preemption code, without saving (the one
    # signal contract, docs/fault_tolerance.md).
    self.assertEqual(codes, [tfdist.PREEMPTED_EXIT_CODE], tail(err))
    self.assertLess(stalls.running_since(sent), 20)
    self.assertIn("SIGTERM during cluster start-up", err)

  def test_port_taken_is_a_config_error_naming_the_address(self):
    configs = cluster_utils.worker_configs(2)
    address = configs[0]["cluster"]["worker"][0]
    with socket.socket() as holder, tempfile.TemporaryDirectory() as d:
      holder.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
      holder.listen()
      with _mwms(configs[:1], d, "--startup-timeout", "20") as tasks:
        codes = tasks.wait_all(60)
        err = tasks.stderr(0)
    self.assertNotEqual(codes, [0])
    self.assertIn("ConfigError", err)
    self.assertIn(address, err)


if __name__ == "__main__":
  absltest.main()
