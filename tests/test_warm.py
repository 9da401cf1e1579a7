"""The harness's warm starts (tests/warm.py): a child forked from the zygote
runs its script as ``python script.py`` would, and ends as it would."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
import warm

_PROBE = textwrap.dedent("""
    import json, os, random, sys, tempfile
    warm = "tensorflow" in sys.modules  # Imported before this line: warm.
    print(json.dumps({
        "warm": warm, "name": __name__, "argv": sys.argv,
        "path0": sys.path[0], "cwd": os.getcwd(),
        "tf_config": os.environ.get("TF_CONFIG"),
        "home": os.environ.get("HOME"),
        "tmp": tempfile.gettempdir(), "random": random.random(),
        "pid": os.getpid(), "session": os.getsid(0)}), flush=True)
    how = sys.argv[1]
    if how == "raise":
      raise ValueError("raised on purpose")
    if how == "sleep":
      import time
      time.sleep(60)
    sys.exit(int(how))
""")


@pytest.mark.beside
@pytest.mark.timeout(120)
class WarmChildTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(prefix="tfdist-warm-test-")
    self.addCleanup(shutil.rmtree, self.dir)
    self.script = os.path.join(self.dir, "probe.py")
    with open(self.script, "w") as f:
      f.write(_PROBE)

  def _tasks(self, *hows, **kwargs):
    env = cluster_utils.base_env()  # What the zygote started with,
    del env["HOME"]  # less a variable that start-up does not read.
    return cluster_utils.Tasks(
        commands=[[sys.executable, self.script, how] for how in hows],
        envs=[{**env, "TF_CONFIG": f"config {i}"} for i in range(len(hows))],
        cwd=self.dir, **kwargs)

  @absltest.skipIf(os.environ.get(warm.COLD_VARIABLE, "") not in ("", "0"),
                   f"{warm.COLD_VARIABLE} is set: every child starts cold")
  def test_each_child_starts_as_its_own_python_script(self):
    with self._tasks("0", "0") as tasks:
      self.assertEqual(tasks.wait_all(60), [0, 0])
      seen = [tasks.json(i) for i in range(2)]
    for i, child in enumerate(seen):
      self.assertTrue(child["warm"], child)
      self.assertEqual(child["name"], "__main__")
      self.assertEqual(child["argv"], [self.script, "0"])
      self.assertEqual(child["path0"], self.dir)
      self.assertEqual(child["cwd"], self.dir)
      self.assertEqual(child["tf_config"], f"config {i}")
      self.assertIsNone(child["home"])
      self.assertTrue(child["tmp"].startswith(tempfile.gettempdir()), child)
      self.assertNotEqual(child["tmp"], tempfile.gettempdir())
      self.assertEqual(child["session"], child["pid"])  # Its own session.
    self.assertNotEqual(seen[0]["random"], seen[1]["random"])
    self.assertNotEqual(seen[0]["pid"], seen[1]["pid"])

  def test_cold_starts_import_nothing_first(self):
    with self._tasks("0", warm=False) as tasks:
      self.assertEqual(tasks.wait_all(60), [0])
      self.assertFalse(tasks.json(0)["warm"])

  @parameterized.named_parameters(
      ("exit_code", "3", 3, False),
      ("uncaught_exception", "raise", 1, True),
  )
  def test_it_ends_as_python_would(self, how, code, traceback):
    with self._tasks(how) as tasks:
      self.assertEqual(tasks.wait(0, 60), code)
      stderr = tasks.stderr(0)
    self.assertEqual("Traceback" in stderr, traceback, stderr)
    if traceback:
      self.assertIn("ValueError: raised on purpose", stderr)

  def test_a_signal_ends_it_with_the_signals_code(self):
    with self._tasks("sleep") as tasks:
      tasks.wait_for(0, lambda line: line.startswith("{"), 60)
      tasks.kill(0)
      self.assertEqual(tasks.wait(0, 30), -signal.SIGKILL)

  def test_a_child_no_one_waits_for_leaves_its_zygote_serving(self):
    env = {**cluster_utils.base_env(), "TMPDIR": self.dir}
    argv = [sys.executable, self.script, "0"]
    abandoned = warm.spawn(argv, env=env, cwd=self.dir, stderr=None)
    zygote = warm._zygotes[warm.startup_key(argv, env)]
    abandoned._status.close()  # Its waiter is gone before it ends.
    abandoned.stdout.read()  # To its end: it exited.
    abandoned.stdout.close()
    process = warm.spawn(argv, env=env, cwd=self.dir, stderr=None)
    self.addCleanup(process.stdout.close)
    self.assertEqual(process.wait(60), 0)
    self.assertIs(warm._zygotes[warm.startup_key(argv, env)], zygote)
    self.assertTrue(zygote.alive())


@pytest.mark.beside
class StartupKeyTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("interpreter_option", [sys.executable, "-X", "importtime", "a.py"]),
      ("module", [sys.executable, "-m", "tfdist"]),
      ("another_interpreter", ["/usr/bin/python3", "a.py"]),
      ("not_python", ["bash", "a.sh"]),
  )
  def test_what_a_fork_cannot_start_starts_cold(self, argv):
    self.assertIsNone(warm.startup_key(argv, {}))
    with tempfile.TemporaryDirectory() as cwd, warm.spawn(
        argv, env=cluster_utils.base_env(), cwd=cwd, stderr=None) as process:
      self.assertIsInstance(process, subprocess.Popen)
      self.assertNotEqual(process.wait(60), 0, process.stdout.read())

  def test_the_key_is_what_start_up_reads(self):
    argv = [sys.executable, "a.py"]
    base = {"PYTHONPATH": "/a", "TF_CPP_MIN_LOG_LEVEL": "2", "HOME": "/h"}
    key = warm.startup_key(argv, base)
    for same in ({"TF_CONFIG": json.dumps({})}, {"TMPDIR": "/t"},
                 {"PYTHONFAULTHANDLER": "1"}, {"HOME": "/elsewhere"}):
      self.assertEqual(warm.startup_key(argv, {**base, **same}), key, same)
    for other in ({"PYTHONPATH": "/b"}, {"TF_CPP_MIN_LOG_LEVEL": "0"},
                  {"KERAS_BACKEND": "jax"}, {"PYTHONHASHSEED": "0"}):
      self.assertNotEqual(warm.startup_key(argv, {**base, **other}), key,
                          other)


if __name__ == "__main__":
  absltest.main()
