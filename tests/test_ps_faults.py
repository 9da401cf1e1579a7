"""ParameterServerStrategy faults with real processes on localhost.

Each test runs tests/scripts/ps_fault_job.py as the tasks of a cluster of one
chief (the coordinator, training with tfdist.fit), one ps and two workers,
each in its own process with its own TF_CONFIG, and SIGKILLs one of them:

* a worker: the coordinator goes on with the other worker, a restarted
  worker on the same address gets steps again, and fit completes every step;
* the ps: the coordinator raises WorkerLostError naming the ps within
  seconds; relaunching the cluster with the same backup_dir resumes from the
  last backup, restored onto the new ps (one chain with USR1 to every task
  before it: saved, exit 42, resumed by the run whose ps is killed);
* the chief: the ps and worker servers end by themselves, as they do when it
  ends normally or with an error; a server whose chief never starts gives up
  after tfdist.serve's chief_timeout.

Every wait is bounded and every process started here is killed by its process
group. The unit tests at the end cover fit's error mapping without a cluster.
"""

import os
import shutil
import signal
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest
import tensorflow as tf

import cluster_utils
from cluster_utils import tail
import stalls
import tfdist
from tfdist import _flight
from tfdist.strategy import server
from tfdist.training import _worker_errors

JOB = "ps_fault_job.py"
TRAIN_STEP = "tfdist-test: train step ran here"  # As in ps_fault_job.py.
SERVED = "served the chief until it ended"  # tfdist.strategy.server.
# Task indices in cluster_utils.worker_configs(2, num_ps=1, chief=True).
CHIEF, WORKER0, WORKER1, PS = range(4)
STEPS = 6  # Per epoch, as in ps_fault_job.py.


def _cluster(configs, args, *, start=True):
  """The tasks of ps_fault_job.py, one per config, all started unless
  ``start`` is false."""
  return cluster_utils.Tasks.of_script(JOB, configs, args=args, start=start)


def _scheduled(line):
  """K in ``step K applied M``, or -1."""
  return int(line.split()[1]) if line.startswith("step ") else -1


def _applied(line):
  """M in ``step K applied M``, or -1."""
  parts = line.split()
  return int(parts[3]) if line.startswith("step ") and parts[3] != "?" else -1


def _latest_checkpoint_number(directory):
  path = tf.train.latest_checkpoint(directory)
  return int(path.rsplit("-", 1)[1]) if path else None


def _configs():
  configs = cluster_utils.worker_configs(2, num_ps=1, chief=True)
  assert [c["task"]["type"] for c in configs] == ["chief", "worker", "worker",
                                                  "ps"]
  return configs


class _PsClusterTest(absltest.TestCase):
  """A chief, two workers and a ps (`_configs`), backing up to ``backup``."""

  def setUp(self):
    super().setUp()
    self.configs = _configs()
    directory = tempfile.mkdtemp(prefix="tfdist-ps-faults-")
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    self.backup = os.path.join(directory, "b")


@pytest.mark.timeout(200)
class WorkerLostTest(_PsClusterTest):

  def test_sigkilled_worker_training_goes_on_and_restarted_worker_rejoins(self):
    # Steps sleep 0.4 s until the restarted worker has rejoined, then none:
    # 120 steps leave it about 45 s to start and get work (it took 8-18 s).
    # Backups only at epoch ends, so the steps after it rejoined are quick.
    epochs = 20
    with _cluster(self.configs, [self.backup, "--sleep", "0.4", "--epochs",
                                 str(epochs), "--backup-every", "1000"]) as c:
      line = c.wait_for(CHIEF, lambda l: _scheduled(l) >= 4, 150)
      c.kill(WORKER1)
      killed = time.monotonic()
      self.assertEqual(c.wait(WORKER1, 30), -signal.SIGKILL)
      # The remaining worker carries on: 4 more steps applied on the ps.
      at_kill = _applied(line)
      c.wait_for(CHIEF, lambda l: _applied(l) >= at_kill + 4, 60)
      four_more = stalls.running_since(killed)
      # A new process on the same address, as a scheduler restarts it.
      c.start(WORKER1)
      cluster_utils.wait_until(lambda: TRAIN_STEP in c.stderr(WORKER1)
                               or not c.running(CHIEF), 90)
      rejoined = c.stderr(WORKER1).count(TRAIN_STEP)
      rejoin_seconds = stalls.running_since(killed) - four_more
      open(self.backup + ".fast", "w").close()  # The rest without sleeping.
      self.assertEqual(c.wait(CHIEF, 90), 0, tail(c.stderr(CHIEF)))
      # The servers end by themselves once the chief has ended.
      for index in (WORKER0, WORKER1, PS):
        self.assertEqual(c.wait(index, 30), 0, tail(c.stderr(index)))
        self.assertIn(SERVED, c.stderr(index))
      out = c.json(CHIEF)
      chief_err = c.stderr(CHIEF)
      ran = sum(err.count(TRAIN_STEP) for err in c.stderr_of_all())
    print(f"4 steps applied {four_more:.1f} s after the kill; the restarted "
          f"worker ran a step {rejoin_seconds:.1f} s after its start; steps "
          f"run on workers {ran} for {out['scheduled']} scheduled; iterations "
          f"{out['iterations']}")
    self.assertGreater(rejoined, 0, "the restarted worker got no step")
    self.assertEqual(out["scheduled"], epochs * STEPS)
    # Every scheduled step ran at least once, on one worker or another.
    self.assertGreaterEqual(ran, epochs * STEPS)
    # The coordinator saw worker 1 fail (and rescheduled its step).
    self.assertIn("Worker /job:worker/replica:0/task:1 failed", chief_err)


@pytest.mark.timeout(360)
class PreemptedThenPsLostTest(absltest.TestCase):
  """One chain of clusters on the same addresses and backup: USR1 to every
  task, which saves and exits 42; a relaunch that resumes there until its ps
  is SIGKILLed, a clear error; a relaunch that resumes from that run's last
  backup and trains to the end. Every test reads the chain's results."""

  EPOCHS = 4
  TOTAL = EPOCHS * STEPS

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    configs = _configs()
    cls.ps_address = configs[PS]["cluster"]["ps"][0]
    directory = tempfile.mkdtemp(prefix="tfdist-ps-faults-")
    cls.addClassCleanup(shutil.rmtree, directory, ignore_errors=True)
    backup = os.path.join(directory, "b")
    # Preempted: backups only on the signal, so steps overlap.
    preempt_args = [backup, "--epochs", str(cls.EPOCHS), "--backup-every",
                    "1000", "--no-reads"]
    with _cluster(configs, [*preempt_args, "--sleep", "0.3"]) as c:
      c.wait_for(CHIEF, lambda l: _scheduled(l) >= 4, 150)
      # As srun forwards SLURM's USR1: every task gets it at once. The
      # servers keep serving while the chief saves (the backup reads the
      # ps), then end.
      for index in (PS, WORKER0, WORKER1, CHIEF):
        c.signal(index, signal.SIGUSR1)
      cls.usr1_codes = [c.wait(i, 60) for i in (CHIEF, WORKER0, WORKER1, PS)]
      cls.usr1_chief_err = c.stderr(CHIEF)
      cls.usr1_ps_err = c.stderr(PS)
      cls.usr1_served = [(SERVED in c.stderr(i))
                         for i in (WORKER0, WORKER1, PS)]
    cls.usr1_saved = _latest_checkpoint_number(backup)
    # PS lost: a backup after every step (with a join before it).
    with _cluster(configs, [backup, "--epochs", str(cls.EPOCHS),
                            "--backup-every", "1", "--no-reads", "--sleep",
                            "0.3"]) as c:
      cls.resumed_line = c.wait_for(CHIEF, lambda l: _scheduled(l) >= 0, 150)
      c.wait_for(CHIEF, lambda l: _scheduled(l) >= (cls.usr1_saved or 0) + 3,
                 150)
      killed = time.monotonic()
      c.kill(PS)
      cls.kill_code = c.wait(CHIEF, 60)
      cls.to_error = stalls.running_since(killed)
      # With the chief gone, the workers stop serving by themselves.
      cls.kill_worker_codes = [c.wait(i, 30) for i in (WORKER0, WORKER1)]
      cls.kill_chief_err = c.stderr(CHIEF)
    cls.kill_saved = _latest_checkpoint_number(backup)
    # The whole cluster again, without sleeping, to the end.
    with _cluster(configs, [*preempt_args, "--sleep", "0"]) as c:
      code = c.wait(CHIEF, 150)
      assert code == 0, tail(c.stderr(CHIEF))
      cls.out = c.json(CHIEF)
    print(f"chief exited {cls.to_error:.1f} s after the ps kill; saved at "
          f"step {cls.usr1_saved} (USR1), {cls.kill_saved} (ps kill); "
          f"resumed: {dict(cls.out, weights=None)}\n"
          + next((l for l in cls.kill_chief_err.splitlines()
                  if l.startswith("tfdist.errors.")), "no tfdist error"))

  def test_usr1_to_every_task_saves_exits_42_and_resumes(self):
    self.assertEqual(self.usr1_codes, [tfdist.PREEMPTED_EXIT_CODE, 0, 0, 0],
                     tail(self.usr1_chief_err))
    self.assertEqual(self.usr1_served, [True] * 3)
    self.assertIn("SIGUSR1 received by ps:0: serving until the chief",
                  self.usr1_ps_err)
    self.assertIn("checkpoint saved at step", self.usr1_chief_err)
    self.assertIsNotNone(self.usr1_saved)
    self.assertBetween(self.usr1_saved, 4, self.TOTAL - 4)
    # The relaunch resumed at the saved position, counted on the
    # coordinator: its first step is the one after it.
    self.assertEqual(_scheduled(self.resumed_line), self.usr1_saved + 1)

  def test_sigkilled_ps_is_a_clear_error_and_relaunch_resumes(self):
    self.assertEqual(self.kill_code, 1, tail(self.kill_chief_err))
    self.assertLess(self.to_error, 30)
    self.assertEqual(self.kill_worker_codes, [0, 0])
    self.assertIn("WorkerLostError", self.kill_chief_err)
    self.assertIn(f"chief:0: parameter server task ps:0 at {self.ps_address} "
                  "was lost mid-training", self.kill_chief_err)
    self.assertIn("restart the whole cluster", self.kill_chief_err)
    self.assertIsNotNone(self.kill_saved)
    self.assertIsNotNone(self.usr1_saved)
    self.assertBetween(self.kill_saved, self.usr1_saved + 1, self.TOTAL - 1)
    # The new ps holds the restored variables: training starts at the saved
    # step, schedules only the rest and ends with every step applied;
    # overlapping steps count exactly in the optimizer's iterations too
    # (keras_compat's atomic_assign_add).
    self.assertEqual(self.out["start"], self.kill_saved)
    self.assertEqual(self.out["scheduled"], self.TOTAL - self.kill_saved)
    self.assertEqual(self.out["iterations"], self.TOTAL)


@pytest.mark.timeout(300)
class ServersEndTest(absltest.TestCase):
  """ps and worker servers never outlive the chief for long."""

  def test_servers_end_after_the_chief_is_sigkilled(self):
    with tempfile.TemporaryDirectory() as d:
      # One worker is enough here: chief, worker:0, ps:0.
      configs = cluster_utils.worker_configs(1, num_ps=1, chief=True)
      chief, worker, ps = range(3)
      with _cluster(configs, [os.path.join(d, "b")]) as c:
        c.wait_for(chief, lambda l: _scheduled(l) >= 1, 100)
        # Scheduling is asynchronous: only a step the worker ran shows that
        # its server was up, and watching, while the chief was alive.
        self.assertTrue(cluster_utils.wait_until(
            lambda: TRAIN_STEP in c.stderr(worker), 100),
                        tail(c.stderr(worker)))
        # The contract: servers that wait for the chief probe it every
        # APPEAR_POLL_SECONDS, so a chief that answered that long and one
        # probe's bound (1 s) more was seen. Its server can have started
        # under a second before this line: when tfdist.serve probed once a
        # second then, in 3 of 5 runs its ps never saw the chief and waited
        # for chief_timeout.
        time.sleep(server.APPEAR_POLL_SECONDS + 1)
        killed = time.monotonic()
        c.kill(chief)
        ended = cluster_utils.wait_until(
            lambda: not (c.running(worker) or c.running(ps)), 30)
        self.assertTrue(ended, "".join(
            f"\n{name}: {c.lines(i)}\n{tail(c.stderr(i))}{c.stacks(i)}"
            for name, i in (("worker:0", worker), ("ps:0", ps))))
        codes = [c.wait(i, 1) for i in (worker, ps)]
        seconds = stalls.running_since(killed)
        served = [c.stderr(i) for i in (worker, ps)]
    print(f"servers ended {seconds:.1f} s after the chief was killed")
    self.assertEqual(codes, [0, 0])
    self.assertLess(seconds, 20)
    for err in served:
      self.assertIn(SERVED, err)

  def test_server_gives_up_when_the_chief_never_starts(self):
    configs = _configs()
    chief = configs[CHIEF]["cluster"]["chief"][0]
    with tempfile.TemporaryDirectory() as d:
      with _cluster(configs, [os.path.join(d, "b"), "--chief-timeout", "3"],
                    start=False) as c:
        start = time.monotonic()
        c.start(PS)  # A worker runs the same tfdist.serve.
        code = c.wait(PS, 60)
        seconds = stalls.running_since(start)
        err = c.stderr(PS)
    print(f"ps:0 gave up after {seconds:.1f} s")
    self.assertEqual(code, 1, tail(err))
    self.assertIn("StartupTimeoutError", err)
    self.assertIn(f"ps:0: the chief at {chief} did not start within 3 s", err)


@pytest.mark.beside
class ErrorMappingTest(parameterized.TestCase):
  """fit's mapping of TensorFlow's lost-peer errors, without a cluster."""

  GRAPH_ERROR = (
      "Graph execution error:\n\n2 root error(s) found.\n"
      "  (0) UNAVAILABLE:  failed to connect to all addresses\n"
      "Additional GRPC error information from remote target "
      "/job:ps/replica:0/task:1/device:CPU:0 while calling RunComponentFunction")

  @parameterized.named_parameters(
      ("graph_error", GRAPH_ERROR,
       "(0) UNAVAILABLE:  failed to connect to all addresses"),
      ("one_line", "Socket closed", "Socket closed"),
      ("only_generic", "Graph execution error:", "Graph execution error:"),
      ("traced_node",
       "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined "
       "at (most recent call last):\n  File \"train.py\", line 3, in <module>"
       "\n\nCollective has timed out during execution.",
       "Collective has timed out during execution."),
      ("empty", "", "no message"),
  )
  def test_summary_skips_generic_lines(self, message, expected):
    error = tf.errors.UnavailableError(None, None, message)
    self.assertEqual(_flight.summary(error), expected)

  @parameterized.named_parameters(
      ("fits", 60, "all-reduce order: call #5 differs. Every worker must"),
      ("cut_at_a_word", 30, "all-reduce order: call #5..."),
      ("one_long_word", 8, "all-r..."))
  def test_summary_cuts_a_long_line_at_a_word(self, limit, expected):
    error = tf.errors.UnavailableError(
        None, None, "all-reduce order: call #5 differs. Every worker must")
    self.assertEqual(_flight.summary(error, limit), expected)

  @parameterized.named_parameters(
      ("remote_target", ["h:1", "h:2"], GRAPH_ERROR, ["ps:1 at h:2"]),
      ("address", ["h:1", "h:2"], "connect to h:1 failed", ["ps:0 at h:1"]),
      ("address_prefix_is_not_a_match", ["h:1"], "connect to h:12", []),
      ("sparse", {0: "h:1", 2: "h:3"}, "h:3 down", ["ps:2 at h:3"]),
      ("none", ["h:1"], "Socket closed", []),
  )
  def test_lost_ps_tasks(self, addresses, message, expected):
    error = tf.errors.UnavailableError(None, None, message)
    self.assertEqual(_worker_errors.lost_ps_tasks(addresses, error), expected)

  @parameterized.named_parameters(
      ("unavailable", tf.errors.UnavailableError),
      ("deadline", tf.errors.DeadlineExceededError),
      ("aborted", tf.errors.AbortedError),
      ("cancelled", tf.errors.CancelledError),
  )
  def test_lost_peer_errors_become_worker_lost_error(self, error_type):
    with self.assertRaises(tfdist.WorkerLostError) as caught:
      with _worker_errors.worker_errors(tf.distribute.get_strategy()):
        raise error_type(None, None, self.GRAPH_ERROR)
    message = str(caught.exception)
    self.assertStartsWith(message, "this process: a peer task died")
    self.assertIn(f"{error_type.__name__}: (0) UNAVAILABLE", message)
    self.assertIn("tfdist launch --max-restarts K", message)
    self.assertIsInstance(caught.exception.__cause__, error_type)

  def test_other_errors_pass_through(self):
    with self.assertRaises(tf.errors.InvalidArgumentError):
      with _worker_errors.worker_errors(tf.distribute.get_strategy()):
        raise tf.errors.InvalidArgumentError(None, None, "bad shape")


if __name__ == "__main__":
  absltest.main()
