"""`tfdist launch` with real processes: roles, failures, signals, restarts."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
import tfdist
from tfdist import _net
from tfdist import launch

TASK = os.path.join(cluster_utils.SCRIPTS, "launch_task.py")
LAUNCH = [sys.executable, "-m", "tfdist", "launch"]


def _launch(*args, timeout=120):
  return subprocess.run(LAUNCH + list(args), env=cluster_utils.base_env(),
                        capture_output=True, text=True, timeout=timeout,
                        cwd=cluster_utils.REPO)


def _pids(output):
  return {int(p) for p in re.findall(r"pid=(\d+)", output)}


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:  # A zombie is not alive.
    return f.read().split()[2] != "Z"


class ClusterTfConfigsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("workers", {"worker": 2}, "127.0.0.1", None,
       [("worker", 0), ("worker", 1)]),
      ("ps_cluster", {"chief": 1, "worker": 1, "ps": 1, "evaluator": 0},
       "127.0.0.1", None, [("chief", 0), ("worker", 0), ("ps", 0)]),
      ("port_base", {"worker": 2}, "127.0.0.1", 23456,
       [("worker", 0), ("worker", 1)]),
      ("ipv6", {"worker": 1}, "::1", 23456, [("worker", 0)]),
  )
  def test_one_cluster_distinct_ports(self, jobs, host, base, tasks):
    configs = _net.cluster_tf_configs(jobs, host=host, port_base=base)
    self.assertEqual([(c["task"]["type"], c["task"]["index"])
                      for c in configs], tasks)
    cluster = configs[0]["cluster"]
    self.assertTrue(all(c["cluster"] == cluster for c in configs))
    self.assertEqual(list(cluster), [j for j, n in jobs.items() if n])
    addresses = [a for job in cluster.values() for a in job]
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    self.assertLen(set(ports), len(ports))
    where = f"[{host}]" if ":" in host else host
    self.assertTrue(all(a.startswith(where + ":") for a in addresses))
    if base:
      self.assertEqual(ports, list(range(base, base + len(ports))))


class LaunchSpecTest(absltest.TestCase):
  """A `LaunchSpec` is a pure value: building one touches nothing."""

  def test_building_does_no_io(self):
    with socket.socket() as held, tempfile.TemporaryDirectory() as d:
      held.bind(("127.0.0.1", 0))
      held.listen()
      port = held.getsockname()[1]
      log_dir = os.path.join(d, "logs")
      spec = launch.LaunchSpec(command=("no-such-program-xyz", "x.py"),
                               num_workers=2, num_ps=1, port_base=port,
                               log_dir=log_dir)
      self.assertFalse(os.path.exists(log_dir))
      with self.assertRaises(tfdist.ConfigError):
        launch.preflight(spec)
    self.assertEqual(spec.jobs, {"chief": 1, "worker": 2, "ps": 1})
    self.assertEqual(spec.num_tasks, 4)
    self.assertEqual([c["task"]["type"] for c in spec.tf_configs()],
                     ["chief", "worker", "worker", "ps"])

  def test_frozen_and_keyword_only(self):
    spec = launch.LaunchSpec(command=["python", "t.py"])
    self.assertEqual(spec.command, ("python", "t.py"))
    with self.assertRaises(AttributeError):
      spec.num_workers = 2  # type: ignore[misc]
    with self.assertRaises(TypeError):
      launch.LaunchSpec(("python", "t.py"))  # pylint: disable=too-many-function-args


@pytest.mark.timeout(120)
class LaunchTest(parameterized.TestCase):

  def test_roles_prefix_output(self):
    r = _launch("--workers", "2", "--chief", "--", sys.executable, TASK, "ok")
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    for role in ("chief:0", "worker:0", "worker:1"):
      self.assertIn(f"[{role}] role={role} pid=", r.stdout)

  def test_tf_configs_share_one_cluster(self):
    with tempfile.TemporaryDirectory() as d:
      r = _launch("--workers", "2", "--ps", "1", "--log-dir", d, "--",
                  sys.executable, TASK, "serve")
      self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
      self.assertEqual(sorted(os.listdir(d)),
                       ["chief-0.log", "ps-0.log", "worker-0.log",
                        "worker-1.log"])
      with open(os.path.join(d, "ps-0.log")) as f:
        self.assertIn("role=ps:0", f.read())
    for pid in _pids(r.stdout):
      self.assertFalse(_alive(pid), f"task {pid} left behind")

  def test_failed_task_stops_the_rest_and_is_reported(self):
    start = time.monotonic()
    r = _launch("--workers", "3", "--", sys.executable, TASK, "fail1")
    self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
    self.assertIn("tfdist: task worker:1 exited with code 3", r.stdout)
    self.assertIn("| something broke", r.stdout)
    self.assertLess(time.monotonic() - start, 60)
    pids = _pids(r.stdout)
    self.assertLen(pids, 3)
    for pid in pids:
      self.assertFalse(_alive(pid), f"task {pid} left behind")

  def test_sigterm_is_forwarded(self):
    with tempfile.TemporaryDirectory() as d:
      proc = subprocess.Popen(
          LAUNCH + ["--workers", "2", "--", sys.executable, TASK, "trap", d],
          env=cluster_utils.base_env(), stdout=subprocess.PIPE, text=True,
          cwd=cluster_utils.REPO)
      try:
        ready = 0
        deadline = time.monotonic() + 60
        while ready < 2 and time.monotonic() < deadline:
          line = proc.stdout.readline()
          ready += line.rstrip().endswith("ready")
        self.assertEqual(ready, 2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
      finally:
        if proc.poll() is None:
          proc.kill()
          proc.wait()
      self.assertEqual(proc.returncode, 128 + signal.SIGTERM)
      self.assertEqual(sorted(os.listdir(d)), ["worker:0", "worker:1"])

  def test_max_restarts_relaunches(self):
    r = _launch("--workers", "2", "--max-restarts", "1", "--", sys.executable,
                TASK, "flaky")
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    self.assertIn("restarting the cluster (1 of 1)", r.stdout)
    self.assertIn("restart=1", r.stdout)

  def test_exhausted_restarts_fail(self):
    r = _launch("--workers", "1", "--", sys.executable, TASK, "flaky")
    self.assertEqual(r.returncode, 5, r.stdout + r.stderr)

  def test_two_worker_all_reduce_through_launcher(self):
    r = _launch("--workers", "2", "--", sys.executable,
                os.path.join(cluster_utils.SCRIPTS, "allreduce.py"),
                timeout=180)
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    sums = [json.loads(line.split("] ", 1)[1])["sum"]
            for line in r.stdout.splitlines() if "] {" in line]
    self.assertEqual(sums, [3.0, 3.0])


class LaunchBadInputTest(parameterized.TestCase):
  """Exit 2 with one 'tfdist:' line, before anything starts."""

  @parameterized.named_parameters(
      ("zero_workers", ["--workers", "0"], "--workers"),
      ("ps_without_workers", ["--workers", "0", "--ps", "1"], "--workers"),
      ("negative_ps", ["--ps", "-1"], "--ps"),
      ("negative_restarts", ["--max-restarts", "-1"], "--max-restarts"),
      ("zero_grace", ["--grace-seconds", "0"], "--grace-seconds"),
      ("port_base_too_low", ["--port-base", "80"], "--port-base"),
      ("port_base_too_high", ["--workers", "3", "--port-base", "65535"],
       "--port-base"),
      ("workers_not_a_number", ["--workers", "two"], "--workers"),
  )
  def test_bad_flags(self, flags, needle):
    self._assert_usage_error(flags + ["--", sys.executable, TASK, "ok"], needle)

  @parameterized.named_parameters(
      ("no_command", [], "command"),
      ("missing_script", [sys.executable, "no/such/script.py"], "script"),
      ("missing_program", ["no-such-program-xyz"], "command"),
  )
  def test_bad_command(self, command, needle):
    self._assert_usage_error(["--workers", "1", "--"] + command, needle)

  def test_command_needs_dashes(self):
    self._assert_usage_error(["--workers", "1", sys.executable, TASK, "ok"],
                             "-- and the program")

  def test_port_range_taken(self):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      s.listen()
      port = s.getsockname()[1]
      self._assert_usage_error(
          ["--workers", "2", "--port-base", str(port), "--", sys.executable,
           TASK, "ok"], f"port {port} on 127.0.0.1 is taken")

  def _assert_usage_error(self, args, needle):
    r = _launch(*args)
    self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
    lines = r.stderr.strip().splitlines()
    self.assertLen(lines, 1, r.stderr)
    self.assertTrue(lines[0].startswith("tfdist: "), lines[0])
    self.assertIn(needle, lines[0])
    self.assertNotIn("role=", r.stdout)  # Nothing started.


if __name__ == "__main__":
  absltest.main()
