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
import logging
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
from tfdist.launch import rendezvous
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
  """Keras fit on 2 workers, one asleep, on TensorFlow's collectives; on 3,
  one stopped, on the socket ring: the dumps and the report take the same
  path on either transport, and each transport's records are read here."""

  def setUp(self):
    super().setUp()
    self.logs = tempfile.mkdtemp(prefix="tfdist-stall-")
    self.addCleanup(shutil.rmtree, self.logs, ignore_errors=True)

  def test_a_worker_asleep_in_a_callback_is_named_with_its_line(self):
    with _launcher("--workers", "2", "--log-dir", self.logs, "--grace-seconds",
                   "2", "--", sys.executable, STALL_JOB, "collective", "6",
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

  def test_a_stopped_worker_of_three_is_named(self):
    with _launcher("--workers", "3", "--log-dir", self.logs,
                   "--stall-seconds", "3", "--grace-seconds", "2", "--",
                   sys.executable, STALL_JOB, "socket", "300", "--epochs",
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


def _nodes(n: int, port: int, flags, job) -> cluster_utils.Tasks:
  """``n`` launchers on loopback standing for ``n`` nodes, a task each."""
  env = cluster_utils.base_env({"TFDIST_JOB_SECRET": "stall-test-secret"})
  return cluster_utils.Tasks(
      commands=[LAUNCH + ["--nnodes", str(n), "--node-rank", str(rank),
                          "--master-addr", "127.0.0.1", "--master-port",
                          str(port), "--grace-seconds", "2", *flags, "--",
                          sys.executable, *job] for rank in range(n)],
      envs=[env] * n, cwd=cluster_utils.REPO, merge_stderr=True)


@pytest.mark.timeout(400)
class ThreeNodesTest(absltest.TestCase):
  """Three launchers on loopback stand for three nodes, a task each; node
  0 prints one report of every node, whichever node saw the stall."""

  def test_sigusr2_to_node_1_gives_one_report_of_every_node(self):
    port = cluster_utils.free_ports(1)[0]
    with tempfile.TemporaryDirectory() as d:
      with _nodes(3, port, [], [RING_JOB, d, "--slow", "2", "--at",
                                "5"]) as nodes:
        self.addCleanup(lambda: _kill([p for i in range(3)
                                       for p in _pids(nodes, i).values()]))
        self.assertTrue(cluster_utils.wait_until(
            lambda: all(_pids(nodes, i) for i in range(3)), 90),
            nodes.stdout(0))
        cluster_utils.wait_until(lambda: False, 3)  # Into the stall.
        nodes.signal(1, stall.SIGNAL)
        self.assertTrue(cluster_utils.wait_until(
            lambda: "  dumps" in nodes.stdout(0), 60), nodes.stdout(0))
        outs = [nodes.stdout(i) for i in range(3)]
        for i in (2, 1, 0):
          nodes.signal(i, signal.SIGTERM)
        nodes.wait_all(60)
    report = _report(outs[0])
    self.assertIn("(node 1: SIGUSR2 to the launcher)", report[0])
    self.assertIn("behind: worker:2 (by 1 step, at step 5)", report[0])
    for rank in (0, 1, 2):
      self.assertTrue(any(l.startswith(f"  worker:{rank} on node {rank}: ")
                          for l in report), report)
    at = next(i for i, l in enumerate(report)
              if l.startswith("  worker:2 on node 2: step 5, BEHIND"))
    self.assertIn(f"{RING_JOB}:{_line_of(RING_JOB)} in <module>",
                  report[at + 1])
    self.assertRegex(report[-1], r"node 0 .*, node 1 .*, node 2 .*; this "
                                 r"report: .*report-1\.1\.json")
    self.assertLen([l for l in outs[0].splitlines()
                    if l.startswith("tfdist: stall report (")], 1, outs[0])
    for out in outs[1:]:  # Node 0 alone says the report.
      self.assertNotIn("tfdist: stall report (", out)

  def _three_nodes(self, job) -> tuple[list[int], list[str]]:
    """Each launcher's exit code and output, up to twice more where a task
    died in TensorFlow's own threads (`cluster_utils.native_crash`): one
    full run met it twice in a row, 14 runs of this test alone never."""
    for attempt in (1, 2, 3):
      port = cluster_utils.free_ports(1)[0]
      with _nodes(3, port, [], job) as nodes:
        self.addCleanup(lambda n=nodes: _kill(
            [p for i in range(3) for p in _pids(n, i).values()]))
        codes = nodes.wait_all(300)
        outs = [nodes.stdout(i) for i in range(3)]
      if attempt == 3 or not any(map(cluster_utils.native_crash, outs)):
        return codes, outs
      logging.warning("a task crashed in TensorFlow; once more:\n%s",
                      cluster_utils.tail(outs[0]))

  def test_a_callback_asleep_on_node_2_with_steps_per_execution(self):
    codes, outs = self._three_nodes([
        STALL_JOB, "collective", "10", "--slow-worker", "2", "--at", "4",
        "--steps-per-execution", "2"])
    self.assertEqual(codes[0], 1, outs[0])
    report = _report(outs[0])
    self.assertRegex(report[0], r"stall report \(node [01]: worker:[01] "
                                r"exited 1: DeadlineExceededError: ")
    self.assertIn("behind: worker:2 (by 2 steps, at step 3)", report[0])
    at = next(i for i, l in enumerate(report)
              if l.startswith("  worker:2 on node 2: step 3, BEHIND"))
    self.assertIn("; left gradients", report[at])  # Its steps closed.
    self.assertIn(f"{STALL_JOB}:{_line_of(STALL_JOB)} in on_train_batch_end",
                  report[at + 1])
    for rank in (0, 1):
      self.assertTrue(any(l.startswith(f"  worker:{rank} on node {rank}: "
                                       "step 5; ") for l in report), report)
    self.assertLen([l for l in outs[0].splitlines()
                    if l.startswith("tfdist: stall report (")], 1, outs[0])


@pytest.mark.timeout(300)
class MismatchTest(absltest.TestCase):

  def test_a_worker_that_all_reduces_one_extra_tensor(self):
    with tempfile.TemporaryDirectory() as d, \
        tempfile.TemporaryDirectory() as logs:
      with _launcher("--workers", "3", "--log-dir", logs, "--", sys.executable,
                     RING_JOB, d, "--extra", "1", "--at", "5") as launcher:
        self.addCleanup(lambda: _kill(_pids(launcher).values()))
        code = launcher.wait(0, 120)
        out = launcher.stdout(0)
      directory = os.path.join(logs, "flight", "0")
      records = [n for n in os.listdir(directory) if n.startswith("report-")]
      self.assertLen(records, 1, out)
      with open(os.path.join(directory, records[0])) as f:
        record = json.load(f)
    self.assertEqual(code, 1, out)
    head = _report(out)[0]
    self.assertRegex(
        head, r"MISMATCHED collectives \(collective #6 of each task\): "
              r"worker:0, worker:2 in gradient bucket 1/1 \(socket ring "
              r"\(float32\), 4.0 KiB\); worker:1 in all-reduce \(socket "
              r"ring \(float32\), 2.0 KiB\); ")
    self.assertIn(record["mismatch"], head)
    self.assertEqual("tfdist: " + record["lines"][0], head)


@pytest.mark.timeout(300)
class WithoutLauncherTest(absltest.TestCase):
  """``srun python train.py`` by hand: TF_CONFIG from the resolver, no
  launcher, no dumps; each task says where it stood in one line."""

  def test_each_task_prints_one_line_when_its_collective_fails(self):
    ports = cluster_utils.free_ports(2)
    hosts = [f"127.0.0.1:{p}" for p in ports]
    with tempfile.TemporaryDirectory() as d:
      configs = [{"cluster": {"worker": hosts},
                  "task": {"type": "worker", "index": i}} for i in (0, 1)]
      with cluster_utils.Tasks.of_script(
          "ring_stall.py", configs, args=[d, "--slow", "1", "--at",
                                          "5"]) as tasks:
        self.assertTrue(cluster_utils.wait_until(
            lambda: all(tasks.lines(i) for i in (0, 1)), 60))
        cluster_utils.wait_until(lambda: False, 2)  # Into the stall.
        tasks.kill(1)
        tasks.wait(0, 60)
        stderr = tasks.stderr(0)
    lines = [l for l in stderr.splitlines() if l.startswith("tfdist: ")]
    self.assertLen(lines, 1, stderr)
    self.assertRegex(
        lines[0], r"^tfdist: worker:0 at step 6, in gradient bucket 1/1 "
                  r"\(socket ring \(float32\), ring of 2: .*\), at "
                  + f"{RING_JOB}:\\d+ in <module>: WorkerLostError: ")


@pytest.mark.timeout(300)
class UnwritableDumpTest(parameterized.TestCase):

  # sigusr2: worker:3 tries to dump only when asked, so its line always
  # comes after the ask; under --stall-seconds before or after it, as the
  # tasks' own stall dumps race.
  @parameterized.named_parameters(("no_step_for_2_s", ["--stall-seconds", "2"]),
                                  ("sigusr2", []))
  def test_a_dump_that_cannot_be_written_does_not_hide_the_stall(self, flags):
    with tempfile.TemporaryDirectory() as logs, \
        tempfile.TemporaryDirectory() as d:
      # worker:3's stacks file is a directory: its dump cannot be written.
      os.makedirs(os.path.join(logs, "flight", "0", "worker-3.stacks.txt"))
      with _launcher("--workers", "4", "--log-dir", logs, "--grace-seconds",
                     "2", *flags, "--", sys.executable,
                     RING_JOB, d, "--slow", "3", "--at", "5") as launcher:
        self.addCleanup(lambda: _kill(_pids(launcher).values()))
        if not flags:
          self.assertTrue(cluster_utils.wait_until(
              lambda: len(_pids(launcher)) == 4, 60), launcher.stdout(0))
          cluster_utils.wait_until(lambda: False, 3)  # Into the stall.
          launcher.signal(0, stall.SIGNAL)
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

  def test_steps_close_with_several_steps_per_execution(self):
    # pylint: disable=g-import-not-at-top: TensorFlow for this test only.
    import keras
    import numpy as np
    from tfdist.strategy import flight_steps
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
    before = max([r["seq"] for r in _flight.snapshot("probe")["records"]],
                 default=0)
    model.fit(np.ones((48, 4), "float32"), np.zeros((48, 2), "float32"),
              batch_size=4, epochs=2, verbose=0,
              callbacks=[flight_steps.FlightSteps()])
    steps = [r for r in _flight.snapshot("probe")["records"]
             if r["kind"] == "gradients" and r["seq"] > before]
    self.assertLen(steps, 8)  # 12 steps an epoch, 3 an execution.
    self.assertEqual([r["step"] for r in steps], list(range(1, 24, 3)))
    self.assertTrue(all(r["left"] is not None for r in steps), steps)

  def test_a_brief_of_1000_ring_calls_is_bounded(self):
    for _ in range(1000):  # A SocketRing used directly: no step advances.
      with _flight.recorded("all-reduce", transport="socket ring (float32)",
                            peers="ring of 64", nbytes=4096):
        pass
    record = _flight.enter("all-reduce", transport="socket ring (float32)",
                           peers="ring of 64", nbytes=4096)
    self.addCleanup(_flight.leave, record)
    found = stall.brief(_flight.snapshot("probe"), now=record[5] + 2)
    self.assertLen(found["records"], stall.BRIEF_RECORDS)
    self.assertEqual(found["last"]["for_s"], 2.0)
    self.assertNotIn("entered", found["last"])
    # One node's answer for 64 such tasks stays far below the limit.
    answer = {"kind": "report", "id": "0.1", "directory": "/d", "found": {
        f"worker:{i}": found for i in range(64)}}
    self.assertLess(len(json.dumps(answer)), rendezvous.MAX_MESSAGE_BYTES / 4)

  def test_only_a_dump_written_for_the_request_or_after_it_answers(self):
    with tempfile.TemporaryDirectory() as d:
      def write(role, **fields):
        with open(os.path.join(d, role.replace(":", "-") + ".json"),
                  "w") as f:
          json.dump({"role": role, "step": 1, "records": [], **fields}, f)
      write("worker:0", time=90.0, request=0, reason="no step for 2 s")
      write("worker:1", time=110.0, request=0, reason="no step for 2 s")
      write("worker:2", time=90.0, request=3, reason="the launcher asked")
      write("worker:3", time=90.0, request=0, reason="WorkerLostError: x")
      ended = 1 << 30  # No such process: ended.
      found = stall.collect(
          d, {"worker:0": os.getpid(), "worker:1": os.getpid(),
              "worker:2": os.getpid(), "worker:3": ended},
          request=3, since=80.0, asked_at=100.0, wait_s=0.3)
    self.assertEqual(found["worker:0"], "no dump within 0.3 s")  # Stale.
    for role in ("worker:1", "worker:2", "worker:3"):
      self.assertIsInstance(found[role], dict, role)

  def test_each_node_ages_its_tasks_by_its_own_clock(self):
    def answer(entered, now):  # Clocks 1000 s apart.
      dump = {"step": 3, "where": "train.py:9 in step", "records": [
          {"step": 3, "kind": "gradients", "bytes": 48, "transport": "tf",
           "peers": "worker:0-1", "entered": entered, "left": None,
           "failed": False, "seq": 3}]}
      return {"directory": "/d", "found": {
          f"worker:{int(entered > 500)}": stall.brief(dump, now)}}
    lines, _ = stall.report({0: answer(10.0, 14.0),
                             1: answer(1010.0, 1021.0)}, why="probe")
    self.assertIn("in gradients (tf, 48 B, worker:0-1) for 4.0 s", lines[1])
    self.assertIn("in gradients (tf, 48 B, worker:0-1) for 11.0 s", lines[3])

  @parameterized.named_parameters(
      ("kind", "all-reduce", 4096, "barrier", 4096),
      ("size", "gradients", 48, "gradients", 56),
      ("bucket_count", "bucket 1/2", 4096, "bucket 1/3", 4096))
  def test_tasks_in_different_collectives_lead_the_report(
      self, kind_a, bytes_a, kind_b, bytes_b):
    def task(kind, nbytes):
      return {"step": 5, "done": 1, "where": None, "records": [], "last": {
          "step": 5, "kind": kind, "bytes": nbytes, "transport": "tf",
          "peers": "all", "seq": 9, "failed": False, "for_s": 3.0}}
    lines, record = stall.report({0: {"directory": "/d", "found": {
        "worker:0": task(kind_a, bytes_a), "worker:1": task(kind_b, bytes_b),
        "worker:2": task(kind_a, bytes_a)}}}, why="probe")
    self.assertRegex(lines[0], r"^stall report \(probe\): MISMATCHED "
                               r"collectives \(collective #9 of each task\): "
                               rf"worker:0, worker:2 in {kind_a} .*; "
                               rf"worker:1 in {kind_b} ")
    self.assertIn(record["mismatch"], lines[0])

  def test_a_request_while_no_round_runs_is_one_line(self):
    said = []
    with tempfile.TemporaryDirectory() as logs:
      flight = stall.Flight(log_dir=logs, stall_seconds=0, say=said.append,
                            source="test")
      flight.request()
      self.assertTrue(cluster_utils.wait_until(lambda: said, 10))
      flight.close()
    self.assertEqual(said, ["no stall report: no round runs on this node"])
    self.assertFalse(flight.asked)


if __name__ == "__main__":
  absltest.main()
