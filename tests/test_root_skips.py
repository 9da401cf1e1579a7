"""A run as root with `root_skips.VARIABLE` set fails on each skip of a test
that needs root, naming it (tests/root_skips.py, tests/conftest.py)."""

import os
import subprocess
import sys
import tempfile

from absl.testing import parameterized
import pytest

import cluster_utils
import root_skips

TESTS = os.path.join(cluster_utils.REPO, "tests")

# Two test modules for a session of their own: one of the network bed (it
# imports tests/netbed.py), one that needs no root.
_MODULES = {
    "test_bed_skips.py": """
import unittest

import netbed  # A test of the network bed.


class BedTest(unittest.TestCase):

  def test_bed(self):
    self.skipTest("no bed here")
""",
    "test_plain_skips.py": """
import unittest


class PlainTest(unittest.TestCase):

  def test_runs(self):
    self.assertEqual(1 + 1, 2)

  def test_skips(self):
    self.skipTest("not wanted here")
""",
}


@pytest.mark.beside
class RulesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("bed", "test_elastic.py", "the network bed"),
      ("slurm", "test_slurm.py", "SLURM"),
      ("bed_and_slurm", "test_multinode_slurm.py", "the network bed"),
      ("disk", "test_disk_full.py", "a full disk"),
      ("neither", "test_cli.py", None),
      ("no_such_file", "test_gone.py", None),
  )
  def test_needs_root_for(self, name, what):
    self.assertEqual(root_skips.needs_root_for(os.path.join(TESTS, name)),
                     what)

  @parameterized.named_parameters(
      ("set_as_root", "1", 0, True),
      ("set_not_root", "1", 1000, False),
      ("unset_as_root", None, 0, False),
      ("empty_as_root", "", 0, False),
  )
  def test_enforced(self, value, euid, enforced):
    environ = {} if value is None else {root_skips.VARIABLE: value}
    self.assertEqual(root_skips.enforced(environ, euid), enforced)

  def test_hidden_names_each_root_skip_and_its_reason(self):
    self.assertEqual(
        root_skips.hidden(
            [("tests/test_elastic.py::TwoHostsTest::test_x", "not root"),
             ("tests/test_cli.py::InfoTest::test_y", "no unshare"),
             ("tests/test_disk_full.py::DiskFullTest::test_z", "no mount")],
            cluster_utils.REPO),
        ["tests/test_elastic.py::TwoHostsTest::test_x (the network bed): "
         "not root",
         "tests/test_disk_full.py::DiskFullTest::test_z (a full disk): "
         "no mount"])


class _Session(parameterized.TestCase):
  """Real pytest sessions with tests/conftest.py."""

  def _session(self, options, variable):
    env = cluster_utils.base_env(
        {"PYTHONPATH": os.pathsep.join([TESTS, cluster_utils.REPO])})
    env.pop(root_skips.VARIABLE, None)
    if variable:
      env[root_skips.VARIABLE] = "1"
    with tempfile.TemporaryDirectory() as d:
      for name, text in _MODULES.items():
        with open(os.path.join(d, name), "w") as f:
          f.write(text)
      r = subprocess.run(
          [sys.executable, "-m", "pytest", "-p", "conftest", "-p",
           "no:cacheprovider", "-q", "-rs", *options, *sorted(_MODULES)],
          cwd=d, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    fails = variable and os.geteuid() == 0
    self.assertEqual(r.returncode, 1 if fails else 0, out)
    self.assertIn("1 passed, 2 skipped", out)
    for reason in ("no bed here", "not wanted here"):  # -rs: every skip.
      self.assertRegex(out, rf"SKIPPED \[1\] \S+: {reason}")
    section = f"skipped as root: these fail the run ({root_skips.VARIABLE})"
    self.assertEqual(section in out, fails, out)
    if fails:
      named = out[out.index(section):].splitlines()[1:]
      self.assertEqual(named[0], "test_bed_skips.py::BedTest::test_bed (the "
                                 "network bed): no bed here")
      self.assertNotIn("PlainTest", "\n".join(named))


@pytest.mark.timeout(300)
@pytest.mark.beside  # tests/conftest.py: one short pytest process a test.
class OneProcessSessionTest(_Session):

  @parameterized.named_parameters(("variable_set", True),
                                  ("variable_unset", False))
  def test_session(self, variable):
    self._session(["-n", "0"], variable)


@pytest.mark.beside  # Three pytest processes that start no cluster.
@pytest.mark.timeout(300)
class TwoStreamsSessionTest(_Session):
  """xdist's controller gathers the skips of both streams."""

  def test_session(self):
    self._session(["-n", "2", "--dist", "loadgroup"], True)
