"""When a run stalls, the launcher says who is behind, where and why.

Real launches (``tfdist launch``) of real tasks: 2 and 3 MultiWorkerMirrored
workers training Keras ``fit`` on both transports (tests/scripts/
stall_job.py), and 8 tasks of a socket ring without TensorFlow (tests/
scripts/ring_stall.py). One task sleeps in a callback, or is SIGSTOPped; the
report must name it, its step and the line it is on, and stay short. The
report comes on a collective's timeout, after ``--stall-seconds`` without a
step, and on SIGUSR2 to the launcher; a dump that cannot be written does not
hide the stall.
"""

import json
import os
import shutil
import signal
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
from tfdist import _flight
from tfdist.launch import stall

LAUNCH = [sys.executable, "-m", "tfdist", "launch"]
STALL_JOB = os.path.join(cluster_utils.SCRIPTS, "stall_job.py")
RING_JOB = os.path.join(cluster_utils.SCRIPTS, "ring_stall.py")


def _line_of(script: str) -> int:
  """The line of ``script`` marked ``SLEEP_LINE``."""
  with open(script) as f:
    return next(i for i, line in enumerate(f, 1)
                if "SLEEP_LINE" in line and "time.sleep" in line)


def _launcher(*args):
  return cluster_utils.Tasks(commands=[LAUNCH + list(args)],
                             envs=[cluster_utils.base_env()],
                             cwd=cluster_utils.REPO, merge_stderr=True)


def _report(output: str) -> list[str]:
  """The stall report's lines in the launcher's output."""
  lines = output.splitlines()
  start = next(i for i, l in enumerate(lines)
               if l.startswith("tfdist: stall report"))
  end = next(i for i in range(start, len(lines))
             if lines[i].startswith("  dumps") or "no dump was written"
             in lines[i])
  return lines[start:end + 1]


def _reported(test, launcher, timeout: float) -> list[str]:
  """The report of a launcher that goes on after it, then stopped."""
  test.assertTrue(cluster_utils.wait_until(
      lambda: "  dumps" in launcher.stdout(0), timeout), launcher.stdout(0))
  test.assertTrue(launcher.running(0))  # A report stops nothing.
  launcher.signal(0, signal.SIGTERM)
  launcher.wait(0, 60)
  return _report(launcher.stdout(0))


def _pids(launcher, index: int = 0) -> dict[int, int]:
  """Each task's rank -> its pid, from the JSON lines launcher ``index``
  printed."""
  found = {}
  for line in launcher.lines(index):
    start = line.find("{")
    if start >= 0 and '"pid"' in line:
      task = json.loads(line[start:])
      found[task["rank"]] = task["pid"]
  return found


def _kill(pids):
  for pid in pids:
    if cluster_utils.alive(pid):
      os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(600)
class StallReportTest(parameterized.TestCase):
  """Keras fit on 2 or 3 workers, each transport."""

  def setUp(self):
    super().setUp()
    self.logs = tempfile.mkdtemp(prefix="tfdist-stall-")
    self.addCleanup(shutil.rmtree, self.logs, ignore_errors=True)

  @parameterized.named_parameters(("collective", "collective"),
                                  ("socket", "socket"))
  def test_a_worker_asleep_in_a_callback_is_named_with_its_line(
      self, transport):
    with _launcher("--workers", "2", "--log-dir", self.logs, "--grace-seconds",
                   "2", "--", sys.executable, STALL_JOB, transport, "6",
                   "--slow-worker", "1", "--at", "5") as launcher:
      self.addCleanup(lambda: _kill(_pids(launcher).values()))
      code = launcher.wait(0, 240)
      out = launcher.stdout(0)
    self.assertEqual(code, 1, out)
    report = _report(out)
    self.assertLessEqual(len(report), 40, out)
    self.assertIn("behind: worker:1 (by 1 step, at step 5)", report[0])
    self.assertRegex(report[0], r"stall report \(worker:0 exited 1: "
                                r"(DeadlineExceededError|WorkerLostError)")
    where = f"{STALL_JOB}:{_line_of(STALL_JOB)} in on_train_batch_end"
    at = next(i for i, l in enumerate(report) if l.startswith("  worker:1: "))
    self.assertTrue(report[at].startswith(
        "  worker:1: step 5, BEHIND by 1 step; "), report)
    self.assertIn(where, report[at + 1])
    self.assertTrue(report[1].startswith("  worker:0: step 6;"), report)
    directory = os.path.join(self.logs, "flight", "0")
    self.assertIn(directory, report[-1])
    for name in ("worker-0.json", "worker-0.stacks.txt", "worker-1.json",
                 "worker-1.stacks.txt"):
      self.assertTrue(os.path.isfile(os.path.join(directory, name)), name)
    with open(os.path.join(directory, "worker-1.stacks.txt")) as f:
      self.assertIn(f'File "{STALL_JOB}", line {_line_of(STALL_JOB)}',
                    f.read())

  @parameterized.named_parameters(("collective", "collective"),
                                  ("socket", "socket"))
  def test_a_stopped_worker_of_three_is_named(self, transport):
    with _launcher("--workers", "3", "--log-dir", self.logs,
                   "--stall-seconds", "3", "--grace-seconds", "2", "--",
                   sys.executable, STALL_JOB, transport, "300", "--epochs",
                   "1000") as launcher:
      self.assertTrue(cluster_utils.wait_until(
          lambda: sum('"trained"' in l for l in launcher.lines(0)) == 3,
          180), launcher.stdout(0))
      pids = _pids(launcher)
      self.addCleanup(_kill, pids.values())
      os.kill(pids[2], signal.SIGSTOP)
      self.addCleanup(lambda: cluster_utils.alive(pids[2]) and os.kill(
          pids[2], signal.SIGCONT))
      report = _reported(self, launcher, 120)
    self.assertIn("saw no step for 3 s", report[0])
    self.assertIn("worker:2 (stopped (SIGSTOP or a debugger)", report[0])
    self.assertTrue(any(l.startswith("  worker:2: no flight record: stopped")
                        for l in report), report)
    for rank in (0, 1):
      line = next(l for l in report if l.startswith(f"  worker:{rank}: "))
      self.assertRegex(line, r"step \d+; in ")  # Waiting in a collective.


@pytest.mark.timeout(300)
class ManyTasksTest(parameterized.TestCase):
  """8 tasks of a socket ring without TensorFlow."""

  @parameterized.named_parameters(
      ("no_step_for_2_s", ["--stall-seconds", "2"], None,
       r"worker:\d saw no step for 2 s"),
      ("sigusr2", [], stall.SIGNAL, "SIGUSR2 to the launcher"),
  )
  def test_the_report_of_8_tasks_names_the_one_behind(self, flags, signum,
                                                      why):
    with tempfile.TemporaryDirectory() as d:
      with _launcher("--workers", "8", "--grace-seconds", "2", *flags, "--",
                     sys.executable, RING_JOB, d, "--slow", "3", "--at",
                     "5") as launcher:
        self.assertTrue(cluster_utils.wait_until(
            lambda: len(_pids(launcher)) == 8, 60), launcher.stdout(0))
        self.addCleanup(_kill, _pids(launcher).values())
        if signum:
          cluster_utils.wait_until(lambda: False, 3)  # Into the stall.
          launcher.signal(0, signum)
        report = _reported(self, launcher, 60)
    self.assertLessEqual(len(report), 40, report)
    self.assertRegex(report[0], why)
    self.assertIn("behind: worker:3 (by 1 step, at step 5)", report[0])
    line = report.index(next(l for l in report
                             if l.startswith("  worker:3: step 5, BEHIND")))
    self.assertIn(f"{RING_JOB}:{_line_of(RING_JOB)} in <module>",
                  report[line + 1])
    for rank in (0, 1, 2, 4, 5, 6, 7):
      entry = next(l for l in report if l.startswith(f"  worker:{rank}: "))
      self.assertIn("step 6; in gradient bucket 1/1 (socket ring", entry)


@pytest.mark.timeout(300)
class TwoNodesTest(absltest.TestCase):
  """Two launchers on loopback stand for two nodes, a ring task each."""

  def test_node_0_reports_every_nodes_tasks_together(self):
    port = cluster_utils.free_ports(1)[0]
    env = cluster_utils.base_env({"TFDIST_JOB_SECRET": "stall-test-secret"})
    with tempfile.TemporaryDirectory() as d:
      commands = [LAUNCH + ["--nnodes", "2", "--node-rank", str(rank),
                            "--master-addr", "127.0.0.1", "--master-port",
                            str(port), "--stall-seconds", "2",
                            "--grace-seconds", "2", "--", sys.executable,
                            RING_JOB, d, "--slow", "1", "--at", "5"]
                  for rank in (0, 1)]
      with cluster_utils.Tasks(commands=commands, envs=[env, env],
                               cwd=cluster_utils.REPO,
                               merge_stderr=True) as nodes:
        self.addCleanup(lambda: _kill([*_pids(nodes, 0).values(),
                                       *_pids(nodes, 1).values()]))
        self.assertTrue(cluster_utils.wait_until(
            lambda: "every node" in nodes.stdout(0)
            and "  dumps" in nodes.stdout(1), 90),
            nodes.stdout(0) + nodes.stdout(1))
        cluster_utils.wait_until(  # The whole combined report.
            lambda: "(node 1)" in nodes.stdout(0), 10)
        outs = [nodes.stdout(0), nodes.stdout(1)]
        nodes.signal(1, signal.SIGTERM)
        nodes.signal(0, signal.SIGTERM)
        nodes.wait_all(60)
    combined = next(l for l in outs[0].splitlines() if "every node" in l)
    self.assertIn("behind: worker:1 (by 1 step, at step 5)", combined)
    self.assertIn("node 1: worker:1 saw no step for 2 s", combined)
    report = outs[0].splitlines()
    at = report.index(combined)
    self.assertIn("(node 1)", "\n".join(report[at:at + 8]))
    # Each node says its own tasks: node 1's report has worker:1 alone.
    own = _report(outs[1])
    self.assertTrue(own[1].startswith("  worker:1: step 5"), own)
    self.assertLen([l for l in own if l.startswith("  worker:")], 1, own)


@pytest.mark.timeout(300)
class UnwritableDumpTest(absltest.TestCase):

  def test_a_dump_that_cannot_be_written_does_not_hide_the_stall(self):
    with tempfile.TemporaryDirectory() as logs, \
        tempfile.TemporaryDirectory() as d:
      # worker:3's stacks file is a directory: its dump cannot be written.
      os.makedirs(os.path.join(logs, "flight", "0", "worker-3.stacks.txt"))
      with _launcher("--workers", "4", "--log-dir", logs, "--grace-seconds",
                     "2", "--stall-seconds", "2", "--", sys.executable,
                     RING_JOB, d, "--slow", "3", "--at", "5") as launcher:
        self.addCleanup(lambda: _kill(_pids(launcher).values()))
        report = _reported(self, launcher, 90)
    entry = next(l for l in report if l.startswith("  worker:3: "))
    self.assertIn("could not write its flight record", entry)
    self.assertIn("worker-3.stacks.txt", entry)
    self.assertRegex(entry, r"it is at step 5, .*ring_stall.py:\d+")
    self.assertIn("worker:3 (tfdist: worker:3 could not write", report[0])


@pytest.mark.beside
class FlightBadInputTest(absltest.TestCase):

  def test_a_log_dir_that_cannot_hold_the_dumps_is_said_at_start(self):
    with tempfile.TemporaryDirectory() as logs:
      with open(os.path.join(logs, "flight"), "w") as f:
        f.write("mine")
      out = cluster_utils.run_processes(
          [LAUNCH + ["--log-dir", logs, "--", sys.executable, "-c",
                     f"open({os.path.join(logs, 'started')!r}, 'w')"]],
          [cluster_utils.base_env()], timeout=60)[0]
      self.assertEqual(out.returncode, 2, out.stderr)
      lines = [l for l in out.stderr.splitlines() if l.strip()]
      self.assertLen(lines, 1, out.stderr)
      self.assertRegex(lines[0], r"^tfdist: --log-dir: received .*flight "
                                 r"records")
      self.assertEqual(sorted(os.listdir(logs)), ["flight"])


@pytest.mark.beside
class RecordTest(parameterized.TestCase):
  """The recorder in this process: bounded, and what a dump holds."""

  def test_only_the_last_thousand_are_kept(self):
    for i in range(_flight.CAPACITY + 10):
      with _flight.recorded(f"probe {i}", transport="none", peers="none"):
        pass
    records = _flight.snapshot("probe")["records"]
    self.assertLen(records, _flight.CAPACITY)
    self.assertEqual(records[-1]["kind"], f"probe {_flight.CAPACITY + 9}")
    self.assertIsNotNone(records[-1]["left"])

  def test_a_failed_collective_is_left_failed(self):
    with self.assertRaises(RuntimeError):
      with _flight.recorded("probe failing", transport="none", peers="none"):
        raise RuntimeError("lost")
    last = _flight.snapshot("probe")["records"][-1]
    self.assertEqual((last["kind"], last["failed"]), ("probe failing", True))


if __name__ == "__main__":
  absltest.main()
