"""`tfdist launch` with real processes: roles, failures, signals, restarts."""

import functools
import hashlib
import json
import os
import pty
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
import stalls
import tfdist
from tfdist import _net
from tfdist import launch
from tfdist.launch import spec as launch_spec

TASK = os.path.join(cluster_utils.SCRIPTS, "launch_task.py")
LAUNCH = [sys.executable, "-m", "tfdist", "launch"]

#: TensorFlow's start-up lines that TF_CPP_MIN_LOG_LEVEL does not silence.
_TF_START_UP = ("oneDNN custom operations are on",
                "All log messages before absl::InitializeLog()",
                "Could not find cuda drivers", "failed call to cuInit")


def _launch(*args, timeout=120, env=None):
  return subprocess.run(LAUNCH + list(args),
                        env=cluster_utils.base_env() if env is None else env,
                        capture_output=True, text=True, timeout=timeout,
                        cwd=cluster_utils.REPO)


def _user_env():
  """The tests' environment without TF_CPP_MIN_LOG_LEVEL, as a user has it."""
  env = cluster_utils.base_env()
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  return env


def _launch_as_a_user(mode, workers=1):
  """``workers`` workers of ``mode`` launched as a user does: the result and
  worker 0's log file."""
  with tempfile.TemporaryDirectory() as d:
    r = _launch("--workers", str(workers), "--log-dir", d, "--",
                sys.executable, TASK, mode, env=_user_env())
    with open(os.path.join(d, "worker-0.log")) as f:
      return r, f.read()


@functools.cache
def _keras_bar():
  """2 workers drawing a real Keras progress bar, launched as a user does
  (one run for the tests of the bar and of TensorFlow's start-up lines)."""
  return _launch_as_a_user("keras_bar", workers=2)


#: The last lines of a task that saved at step 7.
_SAVED_AT_7 = ["WARNING:absl:tfdist: checkpoint saved at step 7; exiting "
               "with code 42"]


def _pids(output):
  return {int(p) for p in re.findall(r"pid=(\d+)", output)}


def _launcher(*args):
  """The launcher as a live process of the one test harness."""
  return cluster_utils.Tasks(commands=[LAUNCH + list(args)],
                             envs=[cluster_utils.base_env()],
                             cwd=cluster_utils.REPO, merge_stderr=True)


def _wait_ready(test, launcher, n, timeout=60):
  """The PIDs of the launcher's ``n`` tasks, once each printed "ready"; a
  failing test SIGKILLs those still alive."""
  cluster_utils.wait_until(
      lambda: sum(l.endswith("] ready") for l in launcher.lines(0)) >= n,
      timeout)
  pids = _pids(launcher.stdout(0))
  test.addCleanup(_kill_left, pids)
  test.assertLen(pids, n, launcher.stdout(0))
  return pids


def _kill_left(pids):
  """SIGKILLs the tasks a failing test left, by PID; those still alive."""
  left = [pid for pid in pids if cluster_utils.alive(pid)]
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  return left


def _local_address():
  """A non-loopback address of this machine, or None."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect(("203.0.113.1", 9))  # UDP: picks a route, sends nothing.
    except OSError:
      return None
    address = s.getsockname()[0]
  return None if _net.is_loopback(address) else address


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


_NODE = ["--master-addr", "127.0.0.1", "--master-port", "29999"]


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
    self.assertEqual(spec.kinds,
                     ["chief", "worker", "worker", "ps"])

  def test_frozen_and_keyword_only(self):
    spec = launch.LaunchSpec(command=["python", "t.py"])
    self.assertEqual(spec.command, ("python", "t.py"))
    with self.assertRaises(AttributeError):
      spec.num_workers = 2  # type: ignore[misc]
    with self.assertRaises(TypeError):
      launch.LaunchSpec(("python", "t.py"))  # pylint: disable=too-many-function-args


@pytest.mark.beside
class RunIdTest(parameterized.TestCase):
  """``--run-id``: checked when the spec is built; by default one made
  from the job secret, the same on every node."""

  @parameterized.named_parameters(
      ("empty", ""), ("a_space", "a b"), ("a_slash", "a/b"),
      ("not_ascii", "l\u00e4uft"), ("too_long", "x" * 129), ("a_number", 7))
  def test_bad_ids_are_named(self, value):
    with self.assertRaises(tfdist.ConfigError) as raised:
      launch.LaunchSpec(command=("x",), run_id=value)
    self.assertEqual(raised.exception.field, "run_id")

  def test_the_default_comes_from_the_secret(self):
    ids = {s: launch_spec.run_id_of(s) for s in ("a" * 64, "b" * 64)}
    self.assertEqual(ids["a" * 64], launch_spec.run_id_of("a" * 64))
    self.assertNotEqual(ids["a" * 64], ids["b" * 64])
    self.assertTrue(all(re.fullmatch("[0-9a-f]{12}", i)
                        for i in ids.values()))
    spec = launch.LaunchSpec(command=(sys.executable, "-c", "pass"),
                             env={_net.JOB_SECRET_VARIABLE: "a" * 64})
    self.assertEqual(launch.preflight(spec).run_id, ids["a" * 64])
    given = launch.LaunchSpec(command=spec.command, env=spec.env,
                              run_id="resnet-2026.11_27")
    self.assertEqual(launch.preflight(given).run_id, "resnet-2026.11_27")


@pytest.mark.timeout(120)
class LaunchTest(parameterized.TestCase):

  def test_roles_prefix_output(self):
    r = _launch("--workers", "2", "--chief", "--", sys.executable, TASK, "ok")
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    for role in ("chief:0", "worker:0", "worker:1"):
      self.assertIn(f"[{role}] role={role} pid=", r.stdout)

  def test_a_real_keras_progress_bar_reads_as_lines_in_a_pipe_and_log(self):
    r, log = _keras_bar()
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    for text in (r.stdout, log):
      self.assertNotIn("\r", text)
      self.assertNotIn("\b", text)
    bars = [line for line in r.stdout.splitlines() if "4/4" in line]
    self.assertLen(bars, 1, r.stdout)  # Only the final state, once.
    self.assertTrue(bars[0].startswith("[worker:0] 4/4 "), bars[0])
    self.assertEqual(bars[0].count("[worker:"), 1)
    self.assertIn("4/4", log)

  def test_tensorflow_start_up_lines_stay_in_the_log_not_the_console(self):
    # keras_bar imports TensorFlow; what TF_CPP_MIN_LOG_LEVEL cannot silence
    # (written before TensorFlow's logging starts) stays out of the console.
    r, log = _keras_bar()
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    console = r.stdout + r.stderr
    # Which of these TensorFlow prints depends on the processor (oneDNN's
    # notice is missing on some): the log keeps what it printed.
    self.assertIn("All log messages before absl::InitializeLog()", log)
    for line in _TF_START_UP:
      if line in log:
        self.assertNotIn(line, console)
    self.assertIn("[worker:0] 4/4 ", console)

  def test_a_progress_bar_on_a_terminal_keeps_one_prefix_per_line(self):
    main, sub = pty.openpty()
    try:
      proc = subprocess.Popen(
          LAUNCH + ["--workers", "2", "--", sys.executable, TASK, "progress"],
          env=cluster_utils.base_env(), stdout=sub, stderr=sub,
          cwd=cluster_utils.REPO)
      os.close(sub)
      out = b""
      while True:
        try:
          chunk = os.read(main, 65536)
        except OSError:  # EIO: the launcher closed the terminal.
          break
        if not chunk:
          break
        out += chunk
      self.assertEqual(proc.wait(timeout=60), 0, out)
    finally:
      os.close(main)
    # What a terminal shows: each line as its last carriage return left it.
    shown = [line.rsplit("\r", 1)[-1].replace("\x1b[K", "")
             for line in out.decode().replace("\r\n", "\n").split("\n")]
    shown = [line for line in shown if line.strip()]
    for line in shown:
      self.assertEqual(line.count("[worker:"), 1, shown)
    self.assertIn("[worker:0] 5/5 [=====] - loss: 0.2000", shown)
    self.assertEqual([l for l in shown if l.startswith("[worker:1] line")],
                     [f"[worker:1] line {i}" for i in range(3)])
    self.assertIn(b"\r[worker:0] 3/5", out)  # Drawn live on a terminal.

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
      self.assertFalse(cluster_utils.alive(pid), f"task {pid} left behind")

  def test_failed_task_stops_the_rest_and_is_reported(self):
    start = time.monotonic()
    r = _launch("--workers", "3", "--", sys.executable, TASK, "fail1")
    self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
    self.assertIn("tfdist: task worker:1 exited with code 3", r.stdout)
    self.assertIn("| something broke", r.stdout)
    self.assertLess(stalls.running_since(start), 60)
    pids = _pids(r.stdout)
    self.assertLen(pids, 3)
    for pid in pids:
      self.assertFalse(cluster_utils.alive(pid), f"task {pid} left behind")

  def test_a_failure_tail_drops_what_the_live_stream_drops(self):
    r, log = _launch_as_a_user("tf_fail")
    self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
    tail = r.stdout.split("last lines of its output:", 1)[1]
    self.assertIn("  | something broke", tail)
    self.assertIn("All log messages before absl::InitializeLog()", log)
    for line in _TF_START_UP:
      self.assertNotIn(line, tail)

  @parameterized.named_parameters(
      ("sigterm", signal.SIGTERM, signal.SIGTERM, 128 + signal.SIGTERM),
      ("sigint", signal.SIGINT, signal.SIGINT, 128 + signal.SIGINT),
      # SLURM's --signal=USR1@N: tfdist's tasks save on it as on SIGTERM,
      # and the launcher ends with their outcome (here: exited 0, finished),
      # which the job script's requeue reads.
      ("sigusr1", signal.SIGUSR1, signal.SIGUSR1, 0),
      # The terminal went away: the tasks are asked to save and stop.
      ("sighup", signal.SIGHUP, signal.SIGTERM, 128 + signal.SIGHUP),
  )
  def test_signal_is_forwarded(self, sent, received, exit_code):
    with tempfile.TemporaryDirectory() as d:
      with _launcher("--workers", "2", "--", sys.executable, TASK, "trap",
                     d) as launcher:
        pids = _wait_ready(self, launcher, 2)
        launcher.signal(0, sent)
        code = launcher.wait(0, 60)
      self.assertEqual(code, exit_code, launcher.stdout(0))
      self.assertEqual(sorted(os.listdir(d)), ["worker:0", "worker:1"])
      for name in os.listdir(d):
        with open(os.path.join(d, name)) as f:
          self.assertEqual(int(f.read()), received)
    self.assertEqual(_kill_left(pids), [])

  def test_sigkill_of_the_launcher_kills_every_task(self):
    """The kernel's parent-death signal: nothing can outlive the launcher."""
    with _launcher("--workers", "2", "--", sys.executable, TASK,
                   "stubborn") as launcher:
      pids = _wait_ready(self, launcher, 2)
      launcher.signal(0, signal.SIGKILL)  # The launcher's PID alone.
      self.assertEqual(launcher.wait(0, 30), -signal.SIGKILL)
    gone = cluster_utils.wait_until(
        lambda: not any(cluster_utils.alive(pid) for pid in pids), 10)
    left = _kill_left(pids)
    self.assertTrue(gone, f"tasks {left} outlived the launcher")

  def test_second_signal_kills_at_once(self):
    """Tasks that ignore SIGINT are killed by a second one, not after the
    grace period."""
    with _launcher("--workers", "2", "--grace-seconds", "600", "--",
                   sys.executable, TASK, "stubborn") as launcher:
      pids = _wait_ready(self, launcher, 2)
      launcher.signal(0, signal.SIGINT)
      time.sleep(0.5)
      self.assertTrue(launcher.running(0))  # Still within the grace period.
      launcher.signal(0, signal.SIGINT)
      self.assertEqual(launcher.wait(0, 30), 128 + signal.SIGINT)
    self.assertEqual(_kill_left(pids), [])

  @parameterized.named_parameters(("sigkill", signal.SIGKILL),
                                  ("sigterm", signal.SIGTERM))
  def test_task_killed_by_signal_n_exits_128_plus_n(self, signum):
    r = _launch("--workers", "2", "--", sys.executable, TASK, "die",
                str(int(signum)))
    self.assertEqual(r.returncode, 128 + signum, r.stdout + r.stderr)
    self.assertIn(f"tfdist: task worker:1 was killed by signal {signum}",
                  r.stdout)
    self.assertEqual(_kill_left(_pids(r.stdout)), [])

  def test_failed_evaluator_fails_the_launch_without_restart(self):
    r = _launch("--workers", "2", "--evaluator", "--max-restarts", "1",
                "--restart-delay-seconds", "0", "--", sys.executable, TASK,
                "evalfail")
    self.assertEqual(r.returncode, 4, r.stdout + r.stderr)
    self.assertIn("tfdist: task evaluator:0 exited with code 4", r.stdout)
    self.assertNotIn("tfdist: restart", r.stdout)  # Training had finished.

  def test_restarts_back_off(self):
    r = _launch("--workers", "1", "--max-restarts", "2",
                "--restart-delay-seconds", "0.5", "--", sys.executable, TASK,
                "flaky", "2")
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    self.assertIn("restart 1 of 2 after 0.5 s", r.stdout)
    self.assertIn("restart 2 of 2 after 1 s", r.stdout)
    starts = [float(t) for t in
              re.findall(r"\[worker:0\] started at ([\d.]+)", r.stdout)]
    self.assertLen(starts, 3)
    self.assertGreaterEqual(starts[1] - starts[0], 0.5)
    self.assertGreaterEqual(starts[2] - starts[1], 1.0)

  def test_each_launch_shares_a_fresh_secret(self):
    digests = []
    for _ in range(2):
      r = _launch("--workers", "2", "--", sys.executable, TASK, "secret")
      self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
      shared = set(re.findall(r"secret=(\w+)", r.stdout))
      self.assertLen(shared, 1, r.stdout)  # Both tasks, one secret.
      digests += shared
    self.assertNotIn("none", digests)
    self.assertNotEqual(digests[0], digests[1])

  def test_secret_from_the_environment_is_kept(self):
    r = subprocess.run(
        LAUNCH + ["--workers", "2", "--", sys.executable, TASK, "secret"],
        env=cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: "given"}),
        capture_output=True, text=True, timeout=120, cwd=cluster_utils.REPO)
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    digest = hashlib.sha256(b"given").hexdigest()[:16]
    self.assertEqual(re.findall(r"secret=(\w+)", r.stdout), [digest] * 2)

  @parameterized.named_parameters(
      # Tasks of one node share its cores: each gets its share, at least 1.
      ("two_tasks", 2, None, lambda cores: str(max(1, cores // 2))),
      ("three_tasks", 3, None, lambda cores: str(max(1, cores // 3))),
      # One task: TensorFlow's own default (every core).
      ("one_task", 1, None, lambda cores: "unset"),
      # The user's setting wins.
      ("users_own", 2, "3", lambda cores: "3"),
  )
  def test_tasks_share_the_cores_intra_op_threads(self, workers, given,
                                                   expected):
    env = cluster_utils.base_env(
        {} if given is None else {"TF_NUM_INTRAOP_THREADS": given})
    r = _launch("--workers", str(workers), "--", sys.executable, "-c",
                "import os; print('intra=' + os.environ.get("
                "'TF_NUM_INTRAOP_THREADS', 'unset'))", env=env)
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    self.assertEqual(re.findall(r"intra=(\w+)", r.stdout),
                     [expected(len(os.sched_getaffinity(0)))] * workers)

  def test_address_of_this_machine_is_accepted_with_a_warning(self):
    address = _local_address()
    if address is None:
      self.skipTest("this machine has no non-loopback address")
    r = _launch("--host", address, "--", sys.executable, TASK, "ok")
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    warnings = [l for l in r.stderr.splitlines() if "warning" in l]
    self.assertLen(warnings, 1, r.stderr)
    self.assertIn("every interface", warnings[0])
    self.assertNotIn("warning", _launch("--", sys.executable, TASK,
                                        "ok").stderr)

  def test_tensorflow_listens_on_every_interface(self):
    """What --host's help and docs/fault_tolerance.md say: TF_CONFIG names
    127.0.0.1, yet TensorFlow's gRPC server listens on every interface."""
    r = _launch("--", sys.executable, TASK, "grpc", timeout=180)
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    self.assertIn("[worker:0] bound=wildcard", r.stdout)

  def test_max_restarts_relaunches(self):
    r = _launch("--workers", "2", "--max-restarts", "1", "--", sys.executable,
                TASK, "flaky")
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    self.assertIn("restart 1 of 1", r.stdout)
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


@pytest.mark.beside  # tests/conftest.py: one short command a test.
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
      ("workers_more_than_ports", ["--workers", "100000"], "--workers"),
      ("host_empty", ["--host", ""], "--host"),
      ("host_malformed", ["--host", "bad..host"], "--host"),
      ("host_not_this_machine", ["--host", "203.0.113.7"], "--host"),
      ("log_dir_cannot_be_created", ["--log-dir", "/proc/nope"],
       "--log-dir"),
      ("log_dir_is_a_file", ["--log-dir", TASK], "--log-dir"),
      ("grace_infinite", ["--grace-seconds", "inf"], "--grace-seconds"),
      ("grace_nan", ["--grace-seconds", "nan"], "--grace-seconds"),
      ("restart_delay_negative", ["--restart-delay-seconds", "-1"],
       "--restart-delay-seconds"),
      # Elastic node counts: torchrun's MIN:MAX spelling, checked up front.
      ("nnodes_min_above_max", ["--nnodes", "3:2"] + _NODE, "--nnodes: received '3:2'"),
      ("nnodes_zero_min", ["--nnodes", "0:2"] + _NODE, "--nnodes: received '0:2'"),
      ("nnodes_no_max", ["--nnodes", "2:"] + _NODE,
       "invalid N or MIN:MAX value: '2:'"),
      ("nnodes_words", ["--nnodes", "a:b"] + _NODE,
       "invalid N or MIN:MAX value: 'a:b'"),
      ("node_rank_past_max", ["--nnodes", "1:2", "--node-rank", "2"] + _NODE,
       "--node-rank: received 2"),
      ("min_node_0_cannot_serve", ["--nnodes", "1:3", "--workers", "0",
                                   "--chief"] + _NODE, "cannot train alone"),
      ("ps_off_node_0_when_elastic", ["--nnodes", "2:3", "--node-rank", "1",
                                      "--ps", "1"] + _NODE, "--node-rank: received 1"),
      ("last_call_negative", ["--last-call-seconds", "-1"],
       "--last-call-seconds"),
      ("last_call_not_a_number", ["--last-call-seconds", "soon"],
       "--last-call-seconds"),
      ("last_call_nan", ["--last-call-seconds", "nan"],
       "--last-call-seconds"),
      ("run_id_empty", ["--run-id", ""], "--run-id: received ''"),
      ("run_id_other_characters", ["--run-id", "my run/1"],
       "--run-id: received 'my run/1'"),
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

  def test_more_tasks_than_open_files(self):
    self._assert_usage_error(
        ["--workers", "60", "--", sys.executable, TASK, "ok"], "--workers",
        prefix=["bash", "-c", 'ulimit -n 100 && exec "$@"', "-"])

  def _assert_usage_error(self, args, needle, prefix=()):
    r = subprocess.run([*prefix, *LAUNCH, *args], env=cluster_utils.base_env(),
                       capture_output=True, text=True, timeout=120,
                       cwd=cluster_utils.REPO)
    self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
    lines = r.stderr.strip().splitlines()
    self.assertLen(lines, 1, r.stderr)
    self.assertTrue(lines[0].startswith("tfdist: "), lines[0])
    self.assertIn(needle, lines[0])
    self.assertNotIn("role=", r.stdout)  # Nothing started.


class PreemptedLineTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("saved", ["WARNING:absl:tfdist: checkpoint saved at step 6; exiting "
                 "with code 42"], "run it again",
       "worker:0 was preempted and saved at step 6; run it again"),
      ("last_save_counts", ["checkpoint saved at step 2",
                            "checkpoint saved at step 4"], None,
       "worker:0 was preempted and saved at step 4"),
      ("nothing_saved", ["tfdist: SIGTERM during cluster start-up: nothing "
                         "to save yet; exiting with code 42"], "run it again",
       "worker:0 was preempted before it could save; run it again"),
      ("silent", [], "run it again",
       "worker:0 was preempted and saved; run it again"),
  )
  def test_the_line(self, tail, resume, line):
    self.assertEqual(launch.output.preempted_line("worker:0", tail,
                                                  resume=resume), line)


class SignalledLineTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("every_worker_saved", "SIGTERM", [("worker:0", 42, _SAVED_AT_7),
                                         ("worker:1", 42, _SAVED_AT_7)],
       "preempted (SIGTERM): every worker saved at step 7; run it again"),
      ("one_worker", "SIGUSR1", [("worker:0", 42, _SAVED_AT_7)],
       "preempted (SIGUSR1): worker:0 saved at step 7; run it again"),
      ("the_directory_when_said", "SIGTERM", [
          ("chief:0", 42, ["checkpoint saved at step 3 in /b; exiting"]),
          ("worker:0", 42, ["checkpoint saved at step 3 in /b; exiting"])],
       "preempted (SIGTERM): every worker saved at step 3 in /b; run it "
       "again"),
      ("ctrl_c", "SIGINT", [("worker:0", 130, _SAVED_AT_7),
                            ("worker:1", 130, _SAVED_AT_7)],
       "interrupted (SIGINT): every worker saved at step 7; run it again"),
      ("one_killed_after_the_grace", "SIGTERM", [
          ("worker:0", 42, _SAVED_AT_7), ("worker:1", -9, ["ready"])],
       "preempted (SIGTERM): worker:0 saved at step 7; worker:1 did not "
       "save (killed by signal 9); run it again"),
      ("before_anything_to_save", "SIGTERM", [
          ("worker:0", 42, ["tfdist: SIGTERM during cluster start-up: "
                            "nothing to save yet; exiting with code 42"]),
          ("worker:1", 42, ["tfdist: SIGTERM with nothing to save yet"])],
       "preempted (SIGTERM): no worker saved (nothing to save yet); run it "
       "again"),
      ("a_program_that_saves_nothing", "SIGTERM", [
          ("worker:0", -15, []), ("worker:1", 0, ["bye"])],
       "preempted (SIGTERM): worker:0 did not save (killed by signal 15); "
       "worker:1 did not save (exit code 0)"),
      ("preempted_without_a_step", "SIGTERM", [("worker:0", 42, [])],
       "preempted (SIGTERM): worker:0 saved; run it again"),
  )
  def test_the_line(self, name, tasks, line):
    self.assertEqual(launch.output.signalled_line(name, tasks,
                                                  resume="run it again"), line)


@pytest.mark.timeout(120)
class SignalledLauncherTest(parameterized.TestCase):
  """The launcher itself is signalled: its tasks save, and it says so in
  one line once they ended, naming a task that did not save. It exits
  ``128 + N``, but after SLURM's USR1 the tasks' 42 once every one saved
  (the job script requeues on 42)."""

  @parameterized.named_parameters(
      ("sigterm", signal.SIGTERM, "none",
       "preempted (SIGTERM): every worker saved at step 7", 128 + 15),
      ("sigusr1", signal.SIGUSR1, "none",
       "preempted (SIGUSR1): every worker saved at step 7", 42),
      ("sigint", signal.SIGINT, "none",
       "interrupted (SIGINT): every worker saved at step 7", 128 + 2),
      ("a_worker_that_did_not_save", signal.SIGTERM, "worker:1",
       "preempted (SIGTERM): worker:0 saved at step 7; worker:1 did not "
       "save (killed by signal 9)", 128 + 15),
      ("usr1_a_worker_that_did_not_save", signal.SIGUSR1, "worker:1",
       "preempted (SIGUSR1): worker:0 saved at step 7; worker:1 did not "
       "save (killed by signal 9)", 128 + 10),
  )
  def test_one_line_after_the_tasks_end(self, signum, stubborn, line, exit):
    with _launcher("--workers", "2", "--grace-seconds", "2", "--",
                   sys.executable, TASK, "saves", stubborn) as launcher:
      pids = _wait_ready(self, launcher, 2)
      launcher.signal(0, signum)
      code = launcher.wait(0, 60)
      out = launcher.stdout(0)
    self.assertEqual(code, exit, out)
    said = [l for l in out.splitlines() if l.startswith("tfdist: ")]
    self.assertEqual(said, [f"tfdist: {line}; {launch.output.RESUME}"], out)
    self.assertEqual(_kill_left(pids), [])


@pytest.mark.timeout(420)
class PreemptedTest(parameterized.TestCase):
  """Whoever got SIGTERM, the launcher says in one line where the tasks
  saved, and the same command resumes after the saved step."""

  @parameterized.named_parameters(
      # A cloud VM's preemption of one task: the launcher exits 42.
      ("the_task", "default", 1, tfdist.PREEMPTED_EXIT_CODE,
       r"worker:0 was preempted and saved at step (\d+) in {backup}"),
      # SLURM or Kubernetes stopping the launcher: both MultiWorkerMirrored
      # workers agree on a step and save there; the launcher exits 143.
      ("the_launcher", "multi_worker_mirrored", 2, 128 + signal.SIGTERM,
       r"preempted \(SIGTERM\): every worker saved at step (\d+) in "
       r"{backup}"),
  )
  def test_one_line_and_the_same_command_resumes(self, strategy, workers,
                                                 code, line):
    env = _user_env()
    with tempfile.TemporaryDirectory() as d:
      command = ["--workers", str(workers), "--log-dir",
                 os.path.join(d, "logs"), "--", sys.executable,
                 os.path.join(cluster_utils.SCRIPTS, "fault_job.py"),
                 strategy, "fit", os.path.join(d, "b"), "--sleep", "0.2"]
      with cluster_utils.Tasks(commands=[LAUNCH + command], envs=[env],
                               cwd=cluster_utils.REPO,
                               merge_stderr=True) as launcher:
        launcher.wait_for(0, lambda l: l.strip() == "[worker:0] step 3", 240)
        if code == tfdist.PREEMPTED_EXIT_CODE:  # The task alone.
          os.kill(int(next(l for l in launcher.lines(0) if l.startswith(
              "[worker:0] pid ")).split()[-1]), signal.SIGTERM)
        else:
          launcher.signal(0, signal.SIGTERM)
        got = launcher.wait(0, 120)
        first = launcher.stdout(0)
      self.assertEqual(got, code, first)
      said = [l for l in first.splitlines() if l.startswith("tfdist: ")]
      self.assertLen(said, 1, first)
      backup = re.escape(os.path.join(d, "b"))  # The chief's backup_dir.
      self.assertRegex(said[0], f"^tfdist: {line.format(backup=backup)}; run "
                       "the same command to resume$")
      step = int(re.search(r"at step (\d+)", said[0]).group(1))
      self.assertNotIn("last lines of its output", first)
      self.assertNotIn("All log messages before absl::InitializeLog()", first)
      for i in range(workers):
        with open(os.path.join(d, "logs", f"worker-{i}.log")) as f:
          self.assertIn(f"checkpoint saved at step {step}", f.read())
      again = _launch(*command[:-2], "--sleep", "0", env=env, timeout=240)
    self.assertEqual(again.returncode, 0, again.stdout + again.stderr)
    steps = [int(k) for k in re.findall(r"^\[worker:0\] step (\d+)$",
                                        again.stdout, re.M)]
    self.assertEqual(steps, list(range(step + 1, 19)), again.stdout)


if __name__ == "__main__":
  absltest.main()
