"""What a launched command runs, found without running it, and whether two
nodes run the same (`tfdist.launch.fingerprint`)."""

import hashlib
import importlib.metadata
import os
import platform
import shutil
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist.launch import fingerprint

import cluster_utils

TASK = os.path.join(cluster_utils.SCRIPTS, "launch_task.py")


def _sha256(*files, folder=None):
  """The digest of files as one script with its local modules: each file's
  name relative to the script's folder, then its bytes."""
  digest = hashlib.sha256()
  for path in files:
    with open(path, "rb") as f:
      digest.update(os.path.relpath(path, folder or os.path.dirname(path))
                    .encode()
                    + b"\0" + f.read() + b"\0")
  return digest.hexdigest()


def _write(folder, name, text):
  path = os.path.join(folder, name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  return path


@pytest.mark.beside
class FingerprintTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)

  @parameterized.named_parameters(
      ("a_script", [sys.executable, TASK, "ok"], "launch_task.py", TASK),
      ("python_options_first", [sys.executable, "-u", "-X", "dev", TASK],
       "launch_task.py", TASK),
      ("a_module", [sys.executable, "-m", "tfdist", "info"], "module tfdist",
       os.path.join(cluster_utils.REPO, "tfdist", "__main__.py")),
      ("a_program", ["env", "true"], "env", shutil.which("env")),
  )
  def test_the_script_and_its_hash(self, command, name, path):
    node = fingerprint.take(command, cwd=cluster_utils.REPO)
    self.assertEqual(node["script"],
                     {"name": name, "sha256": _sha256(path), "files": 1})
    self.assertEqual(node["argv"], command)
    self.assertEqual(node["Keras"], importlib.metadata.version("keras"))

  @parameterized.named_parameters(
      ("bash", ["bash", "run.sh", "x"]),
      ("bash_with_options", ["/bin/bash", "-e", "-o", "pipefail", "run.sh"]),
      ("sh", ["sh", "-x", "run.sh"]),
  )
  def test_a_shell_script_not_the_shell(self, command):
    script = _write(self.dir, "run.sh", "echo hi\n")
    node = fingerprint.take(command, cwd=self.dir)
    self.assertEqual(node["script"],
                     {"name": "run.sh", "sha256": _sha256(script), "files": 1})

  @parameterized.named_parameters(
      ("python", [sys.executable, "-c", "print(1)"], b"print(1)"),
      ("bash", ["bash", "-c", "echo 1"], b"echo 1"),
  )
  def test_code_is_hashed_as_given(self, command, code):
    node = fingerprint.take(command)
    self.assertEqual(node["script"], {
        "name": "-c code", "sha256": hashlib.sha256(code).hexdigest()})

  def test_local_modules_are_hashed_with_the_script(self):
    script = _write(self.dir, "train.py",
                    "import os, model\nfrom data.feed import load\n")
    model = _write(self.dir, "model.py", "import layers\n")
    layers = _write(self.dir, "layers.py", "import numpy\n")
    feed = _write(self.dir, "data/feed.py", "x = 1\n")
    _write(self.dir, "unused.py", "y = 2\n")
    node = fingerprint.take([sys.executable, "train.py"], cwd=self.dir)
    self.assertEqual(node["script"], {
        "name": "train.py", "files": 4,
        "sha256": _sha256(*sorted([script, model, layers, feed]),
                          folder=self.dir)})
    _write(self.dir, "layers.py", "import numpy as np\n")
    changed = fingerprint.take([sys.executable, "train.py"], cwd=self.dir)
    why, _ = fingerprint.compare(node, changed, rank=1)
    self.assertRegex(why, r"^script train\.py \(sha256 \w{12}, with 3 local "
                     r"modules\) on node 1, train\.py \(sha256 \w{12}, with "
                     r"3 local modules\) on node 0")

  @parameterized.named_parameters(
      ("missing_script", [sys.executable, "gone.py"],
       "No such file or directory: "),
      ("missing_module", [sys.executable, "-m", "no_such_module_here"],
       "module no_such_module_here was not found"),
      ("standard_input", [sys.executable, "-u"],
       "standard input was not found"),
  )
  def test_an_unread_script_is_refused_never_a_match(self, command, why):
    ours = fingerprint.take(command, cwd=self.dir)
    self.assertEqual(ours["script"]["sha256"], "")
    refused, warning = fingerprint.compare(ours, ours, rank=1)
    self.assertIsNone(warning)
    self.assertIn("node 1 cannot read what it runs: ", refused)
    self.assertIn("node 0 cannot read what it runs: ", refused)
    self.assertIn(why, refused)
    self.assertTrue(refused.endswith("(an unread script matches nothing)"))

  @parameterized.named_parameters(
      ("the_same", {}, (None, None)),
      ("another_python", {"Python": "3.9.0"}, (
          f"Python 3.9.0 on node 2, {platform.python_version()} on node 0 "
          "(every node must run the same tfdist, TensorFlow, Keras, Python "
          "and script)", None)),
      ("a_longer_command", {"argv": [sys.executable, TASK, "ok", "x"]}, (
          None, "node 2 runs the same script with other arguments: argv[3] "
          "is 'x' on node 2, missing on node 0 (fine for per-node paths)")),
  )
  def test_compare(self, changed, expected):
    ours = fingerprint.take([sys.executable, TASK, "ok"])
    self.assertEqual(fingerprint.compare(ours, {**ours, **changed}, rank=2),
                     expected)

  def test_a_node_that_says_nothing_is_refused(self):
    ours = fingerprint.take([sys.executable, TASK, "ok"])
    why, warning = fingerprint.compare(ours, {}, rank=1)
    self.assertIsNone(warning)
    self.assertIn(f"node 0 runs tfdist {ours['tfdist']}", why)


if __name__ == "__main__":
  absltest.main()
