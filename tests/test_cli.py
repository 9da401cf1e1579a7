"""`tfdist info` and the CLI's error contract, run as real processes."""

import functools
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
import tfdist
from tfdist import report as tfdist_report
from tfdist._compat import keras as keras_compat
from tfdist.strategy import keras_hooks

TWO_WORKERS = {"cluster": {"worker": ["127.0.0.1:{p0}", "127.0.0.1:{p1}"]},
               "task": {"type": "worker", "index": 1}}


def _tfdist(*args, env=None, module=False, timeout=120, prefix=()):
  command = [*prefix] + ([sys.executable, "-m", "tfdist"] if module else
             [sys.executable, "-c",
              "from tfdist.cli import main; main.console_main()"])
  return subprocess.run(command + list(args), env=cluster_utils.base_env(env),
                        capture_output=True, text=True, timeout=timeout,
                        cwd=cluster_utils.REPO)


def _addresses():
  """This machine's IPv4 addresses but loopback and global IPv6 ones, as
  ``ip`` lists them."""
  found = set()
  for args in (["-4", "addr"], ["-6", "addr", "show", "scope", "global"]):
    out = subprocess.run(["ip", "-o", *args], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    found |= {line.split()[3].split("/")[0] for line in out.splitlines()}
  return sorted(a for a in found if not a.startswith("127."))


@functools.cache
def _local_report():
  """`tfdist info --json` on this machine alone: the result and the report
  (whose text form `tfdist info` prints, through report.format_report)."""
  r = _tfdist("info", "--json")
  return r, json.loads(r.stdout) if r.returncode == 0 else None


@pytest.mark.beside
class InfoTest(parameterized.TestCase):

  def test_json_local(self):
    r, report = _local_report()
    self.assertEqual(r.returncode, 0, r.stderr)
    for key in ("source", "task_type", "task_id", "cluster", "strategy",
                "strategy_reason", "versions", "devices", "checks"):
      self.assertIn(key, report)
    self.assertEqual(report["source"], "local")
    self.assertEqual(report["strategy"], "default")
    self.assertIn("tensorflow", report["versions"])
    self.assertEqual(report["versions"]["tfdist"], tfdist.__version__)
    self.assertEqual(report["python"], platform.python_version())
    system = report["system"]
    self.assertEqual(set(system), {"os", "cpus", "cuda_build", "cudnn_build",
                                   "gpus", "driver"})
    self.assertEqual(system["os"], platform.platform())
    self.assertEqual(system["cpus"], os.cpu_count())
    if shutil.which("nvidia-smi") is None:  # No driver: nothing invented.
      self.assertEqual((system["gpus"], system["driver"]), ([], None))
    # The Keras under test has the code every correction was verified on.
    self.assertEqual(
        report["keras_corrections"],
        {fix.name: [] for fix in keras_compat.FIXES + keras_hooks.HOOKS})

  def test_json_tf_config_two_workers(self):
    p0, p1 = cluster_utils.free_ports(2)
    config = json.loads(json.dumps(TWO_WORKERS).replace("{p0}", str(p0))
                        .replace("{p1}", str(p1)))
    r = _tfdist("info", "--json", env={"TF_CONFIG": json.dumps(config)},
                module=True)
    self.assertEqual(r.returncode, 0, r.stderr)
    report = json.loads(r.stdout)
    self.assertEqual(report["source"], "tf_config")
    self.assertEqual((report["task_type"], report["task_id"]), ("worker", 1))
    self.assertEqual(report["strategy"], "multi_worker_mirrored")
    self.assertEqual(report["cluster"]["worker"][1], f"127.0.0.1:{p1}")
    port_check, = [c for c in report["checks"] if c["name"] == "port"]
    self.assertTrue(port_check["ok"])
    # TensorFlow's server will listen on every address: said, as iproute2
    # lists them (every machine here has one besides loopback).
    addresses = _addresses()
    self.assertNotEqual(addresses, [])
    exposure, = [c for c in report["checks"] if c["name"] == "exposure"]
    self.assertTrue(exposure["ok"])
    self.assertIn(f"listens on port {p1} of every address here "
                  f"({', '.join(addresses)}), whatever TF_CONFIG says",
                  exposure["detail"])
    self.assertIn("can run TensorFlow ops in the task", exposure["detail"])

  def test_no_exposure_where_loopback_is_all_there_is(self):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
      self.skipTest("needs root and unshare(1) for a network namespace of "
                    "its own")
    port, = cluster_utils.free_ports(1)
    config = {"cluster": {"worker": [f"127.0.0.1:{port}"]},
              "task": {"type": "worker", "index": 0}}
    r = _tfdist("info", "--json", env={"TF_CONFIG": json.dumps(config)},
                prefix=["unshare", "--net", "sh", "-c",
                        'ip link set lo up && exec "$@"', "sh"])
    self.assertEqual(r.returncode, 0, r.stderr)
    names = [c["name"] for c in json.loads(r.stdout)["checks"]]
    self.assertIn("port", names)
    self.assertNotIn("exposure", names)

  @parameterized.named_parameters(
      ("job_secret_the_ring", {"TFDIST_JOB_SECRET": "s"}, "socket",
       "auto: 2 CPU workers with a job secret"),
      ("no_secret_tensorflow_collectives", {"TFDIST_JOB_SECRET": ""},
       "collective", "auto: no job secret (TFDIST_JOB_SECRET)"),
      ("forced_by_the_variable",
       {"TFDIST_JOB_SECRET": "s", "TFDIST_TRANSPORT": "collective"},
       "collective", "asked for by the TFDIST_TRANSPORT environment variable"),
  )
  def test_gradient_transport_of_a_multi_worker_cluster(self, env, transport,
                                                        why):
    p0, p1 = cluster_utils.free_ports(2)
    config = json.loads(json.dumps(TWO_WORKERS).replace("{p0}", str(p0))
                        .replace("{p1}", str(p1)))
    r = _tfdist("info", env={"TF_CONFIG": json.dumps(config), **env})
    self.assertEqual(r.returncode, 0, r.stderr)
    self.assertIn(f"gradients: {transport} transport ({why}", r.stdout)

  @parameterized.named_parameters(
      # One process reads neither variable, yet says each is wrong.
      ("transport_and_ring_ports_one_process", False,
       {"TFDIST_TRANSPORT": "tcp", "TFDIST_RING_PORTS": "70000"}),
      ("transport_two_workers", True, {"TFDIST_TRANSPORT": "tcp"}),
  )
  def test_a_bad_transport_variable_fails_the_check(self, cluster, env):
    expected = {
        "TFDIST_TRANSPORT": "expected one of ['auto', 'collective', 'socket']",
        "TFDIST_RING_PORTS": "expected a port or a range FIRST-LAST within "
                             "1-65535, e.g. 20000-20100"}
    env = dict(env)
    if cluster:
      p0, p1 = cluster_utils.free_ports(2)
      env["TF_CONFIG"] = json.dumps(TWO_WORKERS).replace(
          "{p0}", str(p0)).replace("{p1}", str(p1))
    r = _tfdist("info", env=env)
    self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
    failed = [l for l in r.stdout.splitlines() if "[FAIL]" in l]
    self.assertEqual(failed, [f"check:    [FAIL] {variable}: received "
                              f"{value!r}; {expected[variable]}"
                              for variable, value in env.items()
                              if variable in expected])
    self.assertNotIn("gradients:", r.stdout)  # Nothing to say until fixed.

  def test_port_taken_fails_the_check(self):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      s.listen()
      port = s.getsockname()[1]
      config = {"cluster": {"worker": [f"127.0.0.1:{port}"]},
                "task": {"type": "worker", "index": 0}}
      r = _tfdist("info", env={"TF_CONFIG": json.dumps(config)})
    self.assertEqual(r.returncode, 1, r.stderr)
    self.assertIn("[FAIL] port", r.stdout)
    self.assertIn("listens on port", r.stdout)

  def test_text_report(self):
    # The text `tfdist info` prints of test_json_local's report (the CLI's
    # text form itself: the tests of [FAIL] lines and of the transport).
    r, report = _local_report()
    self.assertEqual(r.returncode, 0, r.stderr)
    text = tfdist_report.format_report(report)
    self.assertIn("strategy: default", text)
    self.assertNotIn("gradients:", text)  # One process: nothing crosses.
    self.assertIn(f"system:   {platform.platform()}, {os.cpu_count()} CPUs",
                  text)
    self.assertIn("cuda:     built with CUDA ", text)
    known = len(keras_compat.FIXES + keras_hooks.HOOKS)
    self.assertIn(f"keras:    {known} of {known} tfdist corrections match this "
                  "Keras's code\n", text)


@pytest.mark.beside
@pytest.mark.timeout(120)
class InfoWithoutTensorFlowTest(parameterized.TestCase):
  """`tfdist info` in an environment that truly lacks TensorFlow and Keras:
  every section it can, and the import errors named."""

  @parameterized.named_parameters(
      ("this_machine", None, "cluster:  the local machine (source=local)"),
      ("tf_config", {"cluster": {"worker": ["127.0.0.1:{p0}",
                                            "127.0.0.1:{p1}"]},
                     "task": {"type": "worker", "index": 1}},
       "task:     worker:1\n"),
  )
  def test_reports_every_section_it_can(self, config, says):
    python = self._fresh_venv()
    env = {"PYTHONPATH": cluster_utils.REPO}
    if config:
      p0, p1 = cluster_utils.free_ports(2)
      env["TF_CONFIG"] = json.dumps(config).replace("{p0}", str(p0)).replace(
          "{p1}", str(p1))
    run = functools.partial(subprocess.run, env=cluster_utils.base_env(env),
                            capture_output=True, text=True, timeout=60,
                            cwd=cluster_utils.REPO)
    absent = run([python, "-c", "import tensorflow"])
    self.assertIn("No module named 'tensorflow'", absent.stderr)

    text, as_json = (run([python, "-m", "tfdist", "info", *flag])
                     for flag in ([], ["--json"]))
    for r in (text, as_json):
      self.assertEqual(r.returncode, 1, r.stderr)  # A check failed.
      self.assertNotIn("Traceback", r.stderr)
    self.assertIn(says, text.stdout)
    for line in (
        "check:    [FAIL] tensorflow: cannot be imported: "
        "ModuleNotFoundError: No module named 'tensorflow'\n",
        "check:    [FAIL] keras: cannot be imported: "
        "ModuleNotFoundError: No module named 'keras'",
        "devices:  unknown: TensorFlow cannot be imported\n",
        "strategy: unknown: TensorFlow or Keras cannot be imported\n",
        "versions: tfdist "):
      self.assertIn(line, text.stdout)
    report = json.loads(as_json.stdout)
    self.assertEqual(report["system"]["os"], platform.platform())
    self.assertEqual(report["versions"]["tensorflow"], "not installed")
    self.assertEqual(report["versions"]["tfdist"], tfdist.__version__)
    self.assertEqual((report["devices"], report["strategy"],
                      report["keras_corrections"]), (None, None, None))
    self.assertEqual(report["source"], "tf_config" if config else "local")
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["ok"]}
    self.assertEqual(sorted(failed), ["keras", "tensorflow"])
    if config:  # The checks that need no TensorFlow still run.
      port, = [c for c in report["checks"] if c["name"] == "port"]
      self.assertTrue(port["ok"], port)

  def _fresh_venv(self) -> str:
    """A fresh virtual environment's Python: the standard library alone, all
    that ``tfdist info`` needs."""
    directory = self.enterContext(tempfile.TemporaryDirectory())
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", directory],
        capture_output=True, text=True, timeout=60)
    if made.returncode:
      self.skipTest("`python -m venv --without-pip` cannot make an "
                    f"environment here: {made.stderr.strip()[-300:]}")
    return os.path.join(directory, "bin", "python")


@pytest.mark.beside
class ErrorContractTest(parameterized.TestCase):
  """Bad input: one line starting 'tfdist: ', exit 2, no traceback."""

  @parameterized.named_parameters(
      ("malformed_json", ["info"], {"TF_CONFIG": "{not json"}, "TF_CONFIG"),
      ("empty_tf_config", ["info", "--json"], {"TF_CONFIG": " "}, "TF_CONFIG"),
      ("index_out_of_range", ["info"],
       {"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:1"]},
                                 "task": {"type": "worker", "index": 3}})},
       "task.index"),
      ("duplicate_address", ["info"],
       {"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:1", "h:1"]},
                                 "task": {"type": "worker", "index": 0}})},
       "h:1"),
      ("unknown_command", ["frobnicate"], {}, "frobnicate"),
      ("unknown_flag", ["info", "--jsn"], {}, "--jsn"),
      ("abbreviated_flag", ["info", "--js"], {}, "--js"),
      ("launch_every_unknown_flag_and_the_subcommand",
       ["launch", "--wrokers", "2", "--foo=1", "--", "python", "t.py"], {},
       "launch: unknown flags --wrokers, --foo (see `tfdist launch --help`)"),
      ("slurm_unknown_flags", ["slurm", "--nodez", "2", "--bar", "--",
                               "python", "t.py"], {},
       "slurm: unknown flags --nodez, --bar"),
      ("misspelt_command_suggests", ["lanch", "--workers", "2"], {},
       "did you mean `tfdist launch`?"),
      ("launch_flags_after_dashes_belong_to_the_program",
       ["launch", "--workers", "0", "--", "python", "--unknown-to-tfdist"],
       {}, "--workers"),
      ("launch_command_without_dashes",
       ["launch", sys.executable, "-c", "pass"], {}, "-- and the program"),
      ("slurm_command_without_dashes", ["slurm", "python", "t.py"], {},
       "-- and the program"),
      ("launch_host_malformed", ["launch", "--host", "bad..host", "--",
                                 sys.executable, "-c", "pass"], {}, "--host"),
      ("launch_host_empty", ["launch", "--host", "", "--", sys.executable,
                             "-c", "pass"], {}, "--host"),
      ("launch_workers_100000", ["launch", "--workers", "100000", "--",
                                 sys.executable, "-c", "pass"], {},
       "--workers"),
      ("launch_log_dir_in_proc", ["launch", "--log-dir", "/proc/nope", "--",
                                  sys.executable, "-c", "pass"], {},
       "--log-dir"),
      ("slurm_nodes_huge", ["slurm", "--nodes", "1000000000000", "--",
                            "python", "t.py"], {}, "nodes"),
      ("slurm_job_name_newline", ["slurm", "--job-name", "x\n", "--",
                                  "python", "t.py"], {}, "--job-name"),
      ("slurm_partition_newline", ["slurm", "--partition", "x\n", "--",
                                   "python", "t.py"], {}, "partition"),
  )
  def test_exit_two_one_line(self, args, env, needle):
    r = _tfdist(*args, env=env)
    self.assertEqual(r.returncode, 2, r.stderr)
    lines = r.stderr.strip().splitlines()
    self.assertLen(lines, 1, r.stderr)
    self.assertTrue(lines[0].startswith("tfdist: "), lines[0])
    self.assertIn(needle, lines[0])
    self.assertNotIn("Traceback", r.stderr)
    self.assertEqual(r.stdout, "")


# Runs the command as `python -m tfdist` does, then lists what it imported.
_IMPORTS_OF = """
import json, runpy, sys
sys.argv = ["tfdist", *sys.argv[1:]]
try:
  runpy.run_module("tfdist", run_name="__main__", alter_sys=True)
except SystemExit as e:
  code = e.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


@pytest.mark.beside
class HelpTest(parameterized.TestCase):
  """``--help`` answers at once: it loads no TensorFlow, Keras or NumPy."""

  @parameterized.named_parameters(
      ("tfdist", []), ("launch", ["launch"]), ("slurm", ["slurm"]),
      ("info", ["info"]), ("bench", ["bench"]))
  def test_help_loads_no_tensorflow(self, args):
    r = subprocess.run([sys.executable, "-c", _IMPORTS_OF, *args, "--help"],
                       env=cluster_utils.base_env(), capture_output=True,
                       text=True, timeout=60, cwd=cluster_utils.REPO)
    self.assertEqual(r.returncode, 0, r.stderr)
    result = json.loads(r.stdout.strip().splitlines()[-1])
    self.assertEqual(result["code"], 0)
    self.assertIn("usage: tfdist", r.stdout)
    heavy = [m for m in result["modules"]
             if m.split(".")[0] in ("tensorflow", "keras", "numpy")]
    self.assertEqual(heavy, [])

  @parameterized.named_parameters(
      # A default of 0 is said too (0 == False hid it).
      ("max_restarts", "--max-restarts K", "(default 0)"),
      ("node_rank", "--node-rank R", "(default 0)"),
      ("stall_seconds", "--stall-seconds S", "0: no stall watch (default 0)"),
      ("grace_seconds", "--grace-seconds S", "(default 10)"),
      ("last_call_seconds", "--last-call-seconds S", "(default 10)"),
  )
  def test_launch_help_names_each_default(self, flag, said):
    r = _tfdist("launch", "--help", env={"COLUMNS": "80"})
    self.assertEqual(r.returncode, 0, r.stderr)
    text = " ".join(r.stdout.split())
    entry = text[text.index(flag, text.index("options:")):]
    entry = entry[:entry.index(" --", len(flag))]
    self.assertTrue(entry.endswith(said), entry)


@pytest.mark.beside
class VersionTest(absltest.TestCase):

  def test_version_is_one_line_and_loads_no_tensorflow(self):
    r = subprocess.run([sys.executable, "-c", _IMPORTS_OF, "--version"],
                       env=cluster_utils.base_env(), capture_output=True,
                       text=True, timeout=60, cwd=cluster_utils.REPO)
    self.assertEqual(r.returncode, 0, r.stderr)
    lines = r.stdout.strip().splitlines()
    self.assertEqual(lines[0], f"tfdist {tfdist.__version__}")
    result = json.loads(lines[-1])
    self.assertEqual(result["code"], 0)
    self.assertEqual([m for m in result["modules"]
                      if m.split(".")[0] in ("tensorflow", "keras", "numpy")],
                     [])


@pytest.mark.beside
class PublicApiTest(absltest.TestCase):

  def test_every_public_name_resolves(self):
    import tfdist  # pylint: disable=g-import-not-at-top
    for name in tfdist.__all__:
      self.assertIsNotNone(getattr(tfdist, name), name)
    self.assertEqual(sorted(tfdist.__all__), tfdist.__all__)

  def test_errors_share_a_root(self):
    import tfdist  # pylint: disable=g-import-not-at-top
    self.assertTrue(issubclass(tfdist.ConfigError, tfdist.TfdistError))
    self.assertTrue(issubclass(tfdist.TpuUnavailableError, tfdist.TfdistError))


if __name__ == "__main__":
  absltest.main()
