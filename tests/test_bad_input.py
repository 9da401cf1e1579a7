"""Malformed input ends in a clear TfdistError, and on the CLI in exit 2.

Each case checks the error names the field; the CLI cases also check one
``tfdist: ...`` line on stderr, nothing written and no process left behind.
`CliArgumentsTest` generates ``tfdist launch`` and ``tfdist slurm`` argument
lists with hypothesis: each is accepted or refused as bad input, never met
with another exception.
"""

import contextlib
import io
import json
import os
import socket
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import pytest
import tensorflow as tf

import cluster_utils
import tfdist
from tfdist import launch
from tfdist.cli import _args
from tfdist.cli import launch as launch_cli
from tfdist.cli import main as cli_main
from tfdist.cli import slurm as slurm_cli
from tfdist.launch import spec as spec_lib
from tfdist.training import checkpoints

PY = sys.executable
W2 = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}


def _tf_config(value):
  return value if isinstance(value, str) else json.dumps(value)


@pytest.mark.beside
class TfConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("empty", "", "TF_CONFIG"),
      ("not_json", "{cluster", "TF_CONFIG"),
      ("list", "[1]", "TF_CONFIG"),
      ("index_too_big", {"cluster": W2, "task": {"type": "worker", "index": 2}},
       "task.index"),
      ("index_negative", {"cluster": W2,
                          "task": {"type": "worker", "index": -1}},
       "task.index"),
      ("unknown_task_type", {"cluster": W2,
                             "task": {"type": "boss", "index": 0}},
       "task.type"),
      ("address_without_port", {"cluster": {"worker": ["localhost"]},
                                "task": {"type": "worker", "index": 0}},
       "cluster.worker"),
      ("duplicate_addresses", {"cluster": {"worker": ["h:1", "h:1"]},
                               "task": {"type": "worker", "index": 0}},
       "cluster"),
      ("port_out_of_range", {"cluster": {"worker": ["h:70000"]},
                             "task": {"type": "worker", "index": 0}},
       "cluster.worker"),
      ("cluster_not_dict", {"cluster": ["h:1"],
                            "task": {"type": "worker", "index": 0}},
       "cluster"),
  )
  def test_resolve(self, value, field):
    with mock.patch.dict(os.environ, {"TF_CONFIG": _tf_config(value)}):
      with self.assertRaises(tfdist.TfdistError) as caught:
        tfdist.resolve_cluster()
    self.assertIn(field, str(caught.exception))


@pytest.mark.beside
class SlurmTest(parameterized.TestCase):

  BASE = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
          "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
          "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"}

  @parameterized.named_parameters(
      ("procid_not_int", {"SLURM_PROCID": "x"}, "SLURM_PROCID"),
      ("procid_too_big", {"SLURM_PROCID": "5"}, "SLURM_PROCID"),
      ("bad_hostlist", {"SLURM_STEP_NODELIST": "n[1-"}, "NODELIST"),
      ("bad_tasks_per_node", {"SLURM_STEP_TASKS_PER_NODE": "two"},
       "TASKS_PER_NODE"),
  )
  def test_resolve(self, override, field):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM") and k != "TF_CONFIG"}
    env.update(self.BASE)
    env.update(override)
    with mock.patch.dict(os.environ, env, clear=True):
      with self.assertRaises(tfdist.TfdistError) as caught:
        tfdist.resolve_cluster()
    self.assertIn(field, str(caught.exception))


@pytest.mark.beside
class StrategyMismatchTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("ps_without_ps_tasks", "parameter_server",
       {"cluster": W2, "task": {"type": "worker", "index": 0}}, {}, "cluster"),
      ("mwms_with_ps", "multi_worker_mirrored",
       {"cluster": {**W2, "ps": ["h:3"]},
        "task": {"type": "worker", "index": 0}}, {}, "cluster.ps"),
      ("mirrored_in_cluster", "mirrored",
       {"cluster": W2, "task": {"type": "worker", "index": 0}}, {}, "strategy"),
      ("wrong_num_workers", "multi_worker_mirrored",
       {"cluster": W2, "task": {"type": "worker", "index": 0}},
       {"num_workers": 3}, "num_workers"),
      ("unknown_strategy", "horovod", None, {}, "strategy"),
      ("unknown_option", "mirrored", None, {"bogus": 1}, "option"),
      ("bad_collective_timeout", "multi_worker_mirrored", None,
       {"timeout_seconds": 0}, "timeout_seconds"),
      ("bad_startup_timeout", "multi_worker_mirrored", None,
       {"startup_timeout_seconds": -1}, "startup_timeout_seconds"),
      ("bad_exit_timeout", "multi_worker_mirrored", None,
       {"exit_timeout_seconds": "60"}, "exit_timeout_seconds"),
      ("bad_implementation", "multi_worker_mirrored", None,
       {"implementation": "mpi"}, "implementation"),
      ("bad_device", "one_device", None, {"device": "/tpu:9"}, "device"),
      ("bad_partitioner", "parameter_server", None,
       {"variable_partitioner": "x"}, "variable_partitioner"),
      ("tpu_without_tpu", "tpu", None,
       {"tpu": "grpc://127.0.0.1:1", "connect_timeout_seconds": 1}, "TPU"),
  )
  def test_make_strategy(self, name, cluster, options, field):
    with self.assertRaises(tfdist.TfdistError) as caught:
      tfdist.make_strategy(name, cluster=cluster, **options)
    self.assertIn(field, str(caught.exception))


@pytest.mark.beside
class LaunchSpecTest(parameterized.TestCase):
  """Values that cannot work fail when the spec is built; what this machine
  must provide (program, script, free ports) fails in `launch.preflight`."""

  @parameterized.named_parameters(
      ("zero_workers", dict(num_workers=0), "num_workers"),
      ("negative_ps", dict(num_ps=-1), "num_ps"),
      ("negative_restarts", dict(max_restarts=-1), "max_restarts"),
      ("zero_grace", dict(grace_seconds=0), "grace_seconds"),
      ("low_port", dict(port_base=80), "port_base"),
      ("high_port", dict(port_base=65535, num_workers=3), "port_base"),
      ("no_command", dict(command=()), "command"),
      ("missing_program", dict(command=("no-such-program-xyz",)), "command"),
      ("missing_script", dict(command=(PY, "/no/such/script.py")), "script"),
      ("command_with_nul", dict(command=(PY, "-c", "pass\0")), "command"),
      ("command_word_empty", dict(command=(PY, "")), "command"),
      ("host_empty", dict(host=""), "host"),
      ("host_malformed", dict(host="bad..host"), "host"),
      ("host_not_this_machine", dict(host="203.0.113.7"), "host"),
      ("host_not_a_string", dict(host=7), "host"),
      ("workers_more_than_ports", dict(num_workers=100000), "num_workers"),
      ("tasks_more_than_ports", dict(num_workers=64000, num_ps=1000),
       "num_workers"),
      ("huge_ps", dict(num_ps=10**12), "num_ps"),
      ("grace_infinite", dict(grace_seconds=float("inf")), "grace_seconds"),
      ("grace_nan", dict(grace_seconds=float("nan")), "grace_seconds"),
      ("grace_years", dict(grace_seconds=1e9), "grace_seconds"),
      ("grace_string", dict(grace_seconds="10"), "grace_seconds"),
      ("stall_negative", dict(stall_seconds=-5), "stall_seconds"),
      ("stall_string", dict(stall_seconds="30"), "stall_seconds"),
      ("restart_delay_negative", dict(restart_delay_seconds=-1),
       "restart_delay_seconds"),
      ("restart_delay_nan", dict(restart_delay_seconds=float("nan")),
       "restart_delay_seconds"),
      ("log_dir_empty", dict(log_dir=""), "log_dir"),
      ("log_dir_with_nul", dict(log_dir="logs\0"), "log_dir"),
      ("log_dir_is_a_file", dict(log_dir=PY), "log_dir"),
      ("env_value_not_a_string", dict(env={"A": 1}), "env"),
      ("env_name_with_equals", dict(env={"A=B": "1"}), "env"),
      ("env_value_with_nul", dict(env={"A": "1\0"}), "env"),
  )
  def test_spec(self, overrides, field):
    kwargs = dict(command=(PY, "-c", "pass"))
    kwargs.update(overrides)
    with self.assertRaises(tfdist.TfdistError) as caught:
      launch.preflight(launch.LaunchSpec(**kwargs))
    self.assertIn(field, str(caught.exception))

  def test_port_taken(self):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
      spec = launch.LaunchSpec(command=(PY, "-c", "pass"), port_base=port)
      with self.assertRaises(tfdist.ConfigError) as caught:
        launch.preflight(spec)
    self.assertIn(f"port {port}", str(caught.exception))

  @parameterized.named_parameters(
      ("under_proc", "/proc/nope/logs"),
      ("under_a_file", os.path.join(PY, "logs")),
  )
  def test_log_dir_that_cannot_be_made_starts_nothing(self, log_dir):
    with tempfile.TemporaryDirectory() as d:
      marker = os.path.join(d, "started")
      spec = launch.LaunchSpec(
          command=(PY, "-c", f"open({marker!r}, 'w').close()"),
          log_dir=log_dir)
      out = io.StringIO()
      with self.assertRaises(tfdist.ConfigError) as caught:
        launch.launch(spec, out=out)
      self.assertEqual(os.listdir(d), [])  # No task ran.
    self.assertEqual(caught.exception.field, "log_dir")
    self.assertEqual(out.getvalue(), "")

  @parameterized.named_parameters(
      # CUDA_VISIBLE_DEVICES, workers, GPUs per task asked for, the hint,
      # and what it offers: (workers, GPUs per task; None: left out).
      ("one_gpu_two_workers", "0", 2, 1,
       "Run 1 such task, or leave it out so that the 2 tasks share GPU 0",
       [(1, 1), (2, None)]),
      ("two_gpus_three_workers", "0,1", 3, 1,
       "Run at most 2 such tasks, or leave it out so that the 3 tasks share "
       "GPUs 0,1 in turn", [(2, 1), (3, None)]),
      ("three_gpus_two_each", "0,1,2", 2, 2,
       "Run 1 such task, or ask for 1 each, the even share that leaving it "
       "out gives", [(1, 2), (2, 1), (2, None)]),
      ("more_than_the_node_has", "3,5", 1, 4,
       "Ask for 2 each, the even share that leaving it out gives",
       [(1, 2), (1, None)]),
  )
  def test_gpu_plan_says_what_fits(self, visible, workers, each, hint,
                                   offered):
    environ = {"CUDA_VISIBLE_DEVICES": visible}

    def plan(workers, each):
      spec = launch.LaunchSpec(command=("x",), num_workers=workers,
                               gpus_per_task=each)
      return spec_lib.gpu_plan(spec, spec.kinds, environ)

    with self.assertRaises(tfdist.ConfigError) as caught:
      plan(workers, each)
    self.assertEqual(caught.exception.field, "gpus_per_task")
    self.assertEqual(caught.exception.expected,
                     f"at most as many GPUs in all as this node has "
                     f"({visible}), not {each} for each task that uses GPUs "
                     f"({workers} here)")
    self.assertEqual(caught.exception.hint, hint)
    for choice in offered:  # Each choice offered works.
      self.assertLen(plan(*choice), choice[0])


def _example(name):
  return os.path.join(cluster_utils.REPO, "examples", name)


_SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
               "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0",
               "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
               "SLURM_STEP_NUM_TASKS": "2"}


@pytest.mark.beside
class BackupAndRestoreTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("empty_dir", dict(backup_dir=""), "backup_dir"),
      ("zero_freq", dict(save_freq=0), "save_freq"),
      ("freq_word", dict(save_freq="batch"), "save_freq"),
      ("freq_bool", dict(save_freq=True), "save_freq"),
  )
  def test_constructor(self, overrides, field):
    kwargs = dict(backup_dir="/tmp/never-written")
    kwargs.update(overrides)
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.BackupAndRestore(**kwargs)
    self.assertIn(field, str(caught.exception))
    self.assertFalse(os.path.exists("/tmp/never-written"))


# What importing Keras and TensorFlow creates in a fresh home directory
# (~/.keras/keras.json and caches): theirs, not written by tfdist.
LIBRARY_CACHES = {".keras", ".cache", ".config"}


@pytest.mark.beside
class CliTest(parameterized.TestCase):
  """The same kinds of input on command lines: the ``tfdist`` command and
  the absl example scripts. Exit 2, one ``tfdist:`` line naming the field,
  nothing written (working and home directory stay empty) and no process
  left behind."""

  @parameterized.named_parameters(
      ("zero_workers", ["launch", "--workers", "0", "--", PY, "-c", "pass"],
       None, "--workers"),
      ("negative_restarts", ["launch", "--max-restarts", "-1", "--", PY, "-c",
                             "pass"], None, "--max-restarts"),
      ("missing_script", ["launch", "--", PY, "/no/such.py"], None, "script"),
      ("workers_not_int", ["launch", "--workers", "two", "--", PY], None,
       "--workers"),
      ("bad_tf_config_info", ["info"], {"TF_CONFIG": "{bad"}, "TF_CONFIG"),
      ("bad_slurm_info", ["info"], {**_SLURM_STEP, "SLURM_PROCID": "x"},
       "SLURM_PROCID"),
      ("launch_port_base_privileged", ["launch", "--port-base", "80", "--",
                                       PY, "-c", "pass"], None, "--port-base"),
      ("launch_zero_grace", ["launch", "--grace-seconds", "0", "--", PY, "-c",
                             "pass"], None, "--grace-seconds"),
      ("launch_negative_ps", ["launch", "--ps", "-1", "--", PY, "-c", "pass"],
       None, "--ps"),
      ("launch_host_malformed", ["launch", "--host", "bad..host", "--", PY,
                                 "-c", "pass"], None, "--host"),
      ("launch_host_empty", ["launch", "--host", "", "--", PY, "-c", "pass"],
       None, "--host"),
      ("launch_host_not_this_machine", ["launch", "--host", "203.0.113.7",
                                        "--", PY, "-c", "pass"], None,
       "--host"),
      ("launch_workers_100000", ["launch", "--workers", "100000", "--", PY,
                                 "-c", "pass"], None, "--workers"),
      ("launch_log_dir_in_proc", ["launch", "--log-dir", "/proc/nope", "--",
                                  PY, "-c", "pass"], None, "--log-dir"),
      ("launch_grace_infinite", ["launch", "--grace-seconds", "inf", "--", PY,
                                 "-c", "pass"], None, "--grace-seconds"),
      ("launch_restart_delay_nan", ["launch", "--restart-delay-seconds", "nan",
                                    "--", PY, "-c", "pass"], None,
       "--restart-delay-seconds"),
      ("launch_nodes_without_master_addr", ["launch", "--nnodes", "2",
                                            "--node-rank", "1", "--", PY,
                                            "-c", "pass"], None,
       "--master-addr: received nothing (missing); expected node 0's"),
      ("launch_nodes_without_master_port", ["launch", "--nnodes", "2",
                                            "--node-rank", "1",
                                            "--master-addr", "127.0.0.1",
                                            "--", PY, "-c", "pass"], None,
       "--master-port: received nothing (missing); expected node 0's"),
      ("launch_stall_negative", ["launch", "--stall-seconds", "-1", "--", PY,
                                 "-c", "pass"], None, "--stall-seconds"),
      ("launch_stall_not_a_number", ["launch", "--stall-seconds", "soon",
                                     "--", PY, "-c", "pass"], None,
       "--stall-seconds"),
      ("launch_stall_nan", ["launch", "--stall-seconds", "nan", "--", PY,
                            "-c", "pass"], None, "--stall-seconds"),
      ("slurm_nodes_huge", ["slurm", "--nodes", "1000000000000", "--",
                            "python", "t.py"], None, "nodes"),
      ("slurm_cpus_per_task_huge", ["slurm", "--cpus-per-task", "70000",
                                    "--", "python", "t.py"], None,
       "--cpus-per-task"),
      ("slurm_time_beyond_slurm", ["slurm", "--time", "99999999999", "--",
                                   "python", "t.py"], None, "time"),
      ("slurm_job_name_newline", ["slurm", "--job-name", "x\n", "--",
                                  "python", "t.py"], None, "--job-name"),
      ("slurm_partition_newline", ["slurm", "--partition", "gpu\n", "--",
                                   "python", "t.py"], None, "partition"),
      ("slurm_zero_nodes", ["slurm", "--nodes", "0", "--", "python", "t.py"],
       None, "nodes"),
      ("slurm_unknown_role", ["slurm", "--roles", "boss=1", "--", "python",
                              "t.py"], None, "roles"),
      ("slurm_unknown_preset", ["slurm", "--preset", "nope", "--", "python",
                                "t.py"], None, "--preset"),
      ("slurm_output_in_missing_dir", ["slurm", "-o", "/nonexistent/d/x.sbatch",
                                       "--", "python", "t.py"], None,
       "--output"),
      ("bench_plot_in_missing_dir", ["bench", "--quick", "--plot",
                                     "/nonexistent/x.png"], None, "--plot"),
      ("bench_plot_not_an_image", ["bench", "--quick", "--plot", "out.txt"],
       None, "--plot: received 'out.txt'; expected a file name ending in "
       ".png, "),
      ("bench_plot_without_extension", ["bench", "--plot", "out"], None,
       "--plot"),
      ("bench_json_not_json", ["bench", "--quick", "--json", "out.txt"], None,
       "--json: received 'out.txt'; expected a file name ending in .json"),
      ("bench_project_plot_not_an_image", ["bench", "--project", "--plot",
                                           "out.txt"], None, "--plot"),
      ("bench_project_and_quick", ["bench", "--project", "--quick"], None,
       "--project: received '--project --quick'; expected --project without "
       "--quick"),
      ("bench_quick_project_across_hosts",
       ["bench", "--quick", "--project", "--across-hosts"], None,
       "expected --project without --quick or --across-hosts"),
      ("bench_model_on_one_machine", ["bench", "--quick", "--model",
                                      "deep_mlp"], None,
       "--model: received 'deep_mlp'; expected --model with --across-hosts"),
      ("bench_buckets_on_one_machine", ["bench", "--bucket-mib", "8"], None,
       "--bucket-mib: received 8; expected --bucket-mib with --across-hosts"),
      ("bench_negative_buckets", ["bench", "--across-hosts", "--bucket-mib",
                                  "-1"], None,
       "--bucket-mib: received -1; expected an integer >= 0"),
      ("bench_buckets_not_a_number", ["bench", "--across-hosts",
                                      "--bucket-mib", "big"], None,
       "--bucket-mib"),
      ("bench_unknown_model", ["bench", "--across-hosts", "--model", "vgg"],
       None, "--model: received 'vgg'; expected one of cnn, deep_mlp, mlp, "
       "wide_mlp"),
      # The absl example scripts (tfdist.flags.run) answer the same way.
      ("example_misspelt_strategy", [_example("keras_fit.py"),
                                     "--strategy=mirorred"], None,
       "strategy"),
      ("example_task_index_out_of_hosts",
       [_example("keras_fit.py"), "--worker_hosts=127.0.0.1:1,127.0.0.1:2",
        "--task_index=2"], None, "task_index"),
      ("example_bad_tf_config", [_example("keras_fit.py")],
       {"TF_CONFIG": '{"cluster": {"worker": ["h"]}}'}, "cluster.worker"),
      ("example_bad_slurm_hostlist", [_example("custom_loop.py")],
       {**_SLURM_STEP, "SLURM_STEP_NODELIST": "n[1-"}, "NODELIST"),
      ("example_parameter_server_without_ps",
       [_example("parameter_server.py")],
       {"TF_CONFIG": json.dumps({"cluster": W2, "task": {"type": "worker",
                                                         "index": 0}})},
       "cluster"),
      ("example_tpu_without_tpu", [_example("keras_fit.py"),
                                   "--strategy=tpu",
                                   "--tpu=grpc://127.0.0.1:1"], None, "TPU"),
  )
  def test_exit_2_one_line(self, argv, env, field):
    # tfdist bench looks for matplotlib before it reads --plot's name.
    make_env = (cluster_utils.plotting_env if argv[0] == "bench"
                else cluster_utils.base_env)
    if not argv[0].startswith("/"):
      argv = ["-m", "tfdist", *argv]
    with tempfile.TemporaryDirectory() as d, \
        tempfile.TemporaryDirectory() as home:
      r, left = cluster_utils.run_alone(
          [PY, *argv], env=make_env({**(env or {}), "HOME": home}),
          cwd=d, timeout=120)
      self.assertEqual(os.listdir(d), [])  # Nothing written.
      self.assertEqual(set(os.listdir(home)) - LIBRARY_CACHES, set())
    self.assertEqual(left, [])  # No process left behind.
    self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.startswith("tfdist:")]
    self.assertLen(lines, 1, r.stderr)
    self.assertIn(field, lines[0])

  def test_launch_port_taken(self):
    with socket.socket() as held, tempfile.TemporaryDirectory() as d:
      held.bind(("127.0.0.1", 0))
      held.listen()
      port = held.getsockname()[1]
      r, left = cluster_utils.run_alone(
          [PY, "-m", "tfdist", "launch", "--port-base", str(port), "--", PY,
           "-c", "pass"], env=cluster_utils.base_env(), cwd=d, timeout=60)
      self.assertEqual(os.listdir(d), [])
    self.assertEqual(left, [])
    self.assertEqual(r.returncode, 2, r.stderr)
    self.assertRegex(r.stderr.strip(), rf"^tfdist: .*port {port}")


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_VALUES = st.one_of(
    st.integers(-2**70, 2**70).map(str),
    st.floats().map(repr),
    _TEXT,
    st.sampled_from(["", "0", "1", "2", "-1", "nan", "inf", "1e309",
                     "bad..host", "::1", "localhost", "0.0.0.0",
                     "203.0.113.7", "/proc/nope", "x\n", "a b", "04:00:00",
                     "1-02", "chief=1,ps=1,worker=2", "worker=1", "--"]))


def _argv(flags):
  """Argument lists: flags from ``flags`` each followed by a value, then a
  command after ``--`` (usually one that exists)."""
  pairs = st.lists(st.tuples(st.sampled_from(flags), _VALUES), max_size=4)
  command = st.one_of(st.just([PY, "-c", "pass"]),
                      st.lists(_TEXT, min_size=0, max_size=3))
  return st.tuples(pairs, command).map(
      lambda t: [w for pair in t[0] for w in pair] + ["--", *t[1]])


_LAUNCH_FLAGS = ["--workers", "--ps", "--chief", "--evaluator", "--host",
                 "--port-base", "--log-dir", "--max-restarts",
                 "--restart-delay-seconds", "--grace-seconds", "--nnodes",
                 "--node-rank", "--last-call-seconds", "--stall-seconds",
                 "--run-id"]
_SLURM_FLAGS = ["--preset", "--job-name", "--nodes", "--tasks-per-node",
                "--gpus-per-node", "--cpus-per-task", "--time", "--partition",
                "--roles", "--signal-seconds", "--requeue", "--no-requeue"]


@pytest.mark.beside
class CliArgumentsTest(absltest.TestCase):
  """Generated ``tfdist launch`` / ``tfdist slurm`` argument lists, parsed
  and checked in-process (nothing is started or written): each is accepted
  or refused with a usage error or a `TfdistError`, never another error."""

  def setUp(self):
    super().setUp()
    self._cwd = os.getcwd()
    self._dir = tempfile.mkdtemp()
    os.chdir(self._dir)  # Relative --log-dir values land here, if anywhere.

  def tearDown(self):
    os.chdir(self._cwd)
    written = os.listdir(self._dir)
    os.rmdir(self._dir)
    self.assertEqual(written, [])  # Nothing written.
    super().tearDown()

  def _build(self, command, argv, build):
    """``build(args)``, or None when the arguments are refused."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      try:
        args = cli_main.build_parser().parse_args([command, *argv])
      except SystemExit as e:
        self.assertEqual(e.code, 2)
        self.assertStartsWith(err.getvalue(), "tfdist: ")
        return None
    try:
      return build(args)
    except tfdist.TfdistError as e:
      self.assertNotIn("\n", str(e).rstrip())
      return None

  @settings(max_examples=200, deadline=None)
  @given(_argv(_LAUNCH_FLAGS))
  def test_launch(self, argv):
    spec = self._build("launch", argv, launch_cli.build_spec)
    if spec is not None:
      self.assertBetween(spec.num_tasks, 1, 65536 - 1024)

  @settings(max_examples=200, deadline=None)
  @given(_argv(_SLURM_FLAGS))
  def test_slurm(self, argv):
    spec = self._build("slurm", argv, slurm_cli.build_spec)
    if spec is not None:
      text = launch.render(spec)
      self.assertNotIn("\0", text)
      for line in text.splitlines():  # No option smuggled into a value.
        if line.startswith("#SBATCH"):
          self.assertRegex(line, r"^#SBATCH --[a-z-]+(=[^\s]+)?$")


#: Text that looks like the CLI's own words: flags, fields, dashes, spaces.
_LOOKALIKE = st.lists(st.one_of(
    st.sampled_from([" ", "-", "--", "host", "--host", "master_port",
                     "num_workers", "log_dir", "--workers", "workers", ".",
                     "'", '"', "`", "(", ")", ":", "="]),
    st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp"),
                          exclude_characters="/"), max_size=4)),
    max_size=8).map("".join)


@pytest.mark.beside
class VerbatimValuesTest(absltest.TestCase):
  """The user's values appear in errors exactly as given."""

  @settings(max_examples=100, deadline=None)
  @given(_LOOKALIKE)
  def test_launch_quotes_the_log_dir_as_given(self, text):
    # Under /proc no directory can be made, whatever the name.
    log_dir = f"/proc/tfdist-no-such-dir {text}"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      code = cli_main.main(["launch", "--log-dir", log_dir, "--", PY, "-c",
                            "pass"])
    self.assertEqual(code, 2)
    line, = err.getvalue().splitlines()
    self.assertStartsWith(line, "tfdist: --log-dir: received ")
    self.assertEndsWith(line, f": {log_dir}")

  @settings(max_examples=200, deadline=None)
  @given(st.one_of(_LOOKALIKE, st.text()))
  def test_config_errors_keep_the_text(self, value):
    with self.assertRaises(tfdist.ConfigError) as caught:
      with _args.config_errors(source="tfdist launch arguments",
                               renamed={"master_port": "--master-port"}):
        raise tfdist.ConfigError(
            field="master_port", value=value, source="LaunchSpec",
            expected=f"a port of {value}", hint=f"{value} (master_port)")
    e = caught.exception
    self.assertEqual((e.field, e.value, e.expected, e.hint, e.source),
                     ("--master-port", value, f"a port of {value}",
                      f"{value} (master_port)", "tfdist launch arguments"))


@pytest.mark.beside
class CheckpointIntegrityTest(parameterized.TestCase):
  """A corrupt latest checkpoint falls back; none readable fails clearly."""

  def _saves(self, d, n=2):
    v = tf.Variable(0.0)
    ckpt = tf.train.Checkpoint(v=v)
    manager = tf.train.CheckpointManager(ckpt, d, max_to_keep=3)
    for i in range(1, n + 1):
      v.assign(float(i))
      manager.save(checkpoint_number=i)
    return v, ckpt

  @parameterized.named_parameters(("truncated", b""),
                                  ("garbage", b"\0garbage" * 64))
  def test_corrupt_latest_falls_back(self, content):
    with tempfile.TemporaryDirectory() as d:
      v, ckpt = self._saves(d)
      for name in os.listdir(d):
        if name.startswith("ckpt-2.data"):
          with open(os.path.join(d, name), "wb") as f:
            f.write(content)
      v.assign(-1.0)
      path = checkpoints.restore_latest(ckpt, d)
    self.assertTrue(path.endswith("ckpt-1"))
    self.assertEqual(float(v.numpy()), 1.0)

  def test_all_corrupt_fails_clearly(self):
    with tempfile.TemporaryDirectory() as d:
      _, ckpt = self._saves(d)
      for name in os.listdir(d):
        if ".data" in name:
          with open(os.path.join(d, name), "wb") as f:
            f.write(b"x")
      with self.assertRaises(tfdist.CheckpointError) as caught:
        checkpoints.restore_latest(ckpt, d)
    self.assertIn("will not start over silently", str(caught.exception))

  def test_half_written_save_is_ignored(self):
    """A kill mid-save leaves files the state file does not name."""
    with tempfile.TemporaryDirectory() as d:
      v, ckpt = self._saves(d)
      with open(os.path.join(d, "ckpt-3_temp.index"), "wb") as f:
        f.write(b"partial")
      path = checkpoints.restore_latest(ckpt, d)
    self.assertTrue(path.endswith("ckpt-2"))
    self.assertEqual(float(v.numpy()), 2.0)


if __name__ == "__main__":
  absltest.main()
