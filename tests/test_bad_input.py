"""Malformed input ends in a clear TfdistError, and on the CLI in exit 2.

Each case checks the error names the field; the CLI cases also check one
``tfdist: ...`` line on stderr, nothing written and no process left behind.
"""

import json
import os
import socket
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import tensorflow as tf

import cluster_utils
import tfdist
from tfdist import launch
from tfdist.training import checkpoints

PY = sys.executable
W2 = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}


def _tf_config(value):
  return value if isinstance(value, str) else json.dumps(value)


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


def _example(name):
  return os.path.join(cluster_utils.REPO, "examples", name)


_SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
               "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0",
               "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
               "SLURM_STEP_NUM_TASKS": "2"}


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
    if not argv[0].startswith("/"):
      argv = ["-m", "tfdist", *argv]
    with tempfile.TemporaryDirectory() as d, \
        tempfile.TemporaryDirectory() as home:
      r, left = cluster_utils.run_alone(
          [PY, *argv], env=cluster_utils.base_env({**(env or {}),
                                                   "HOME": home}),
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
