""".ci/run runs the README's test command, which installs the TensorFlow
and Keras that README's "Tested versions" names (constraints.txt)."""

import configparser
import os
import re
import subprocess
import sys

from absl.testing import absltest
import pytest

import root_skips

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
  with open(os.path.join(ROOT, path)) as f:
    return f.read()


def _readme_test_command():
  """The command of README's first shell block that runs pytest."""
  blocks = re.findall(r"```sh\n(.*?)```", _read("README.md"), re.S)
  return next(line for block in blocks for line in block.splitlines()
              if "pytest" in line)


@pytest.mark.beside
class CiTest(absltest.TestCase):

  def test_ci_runs_the_readme_test_command(self):
    lines = [l for l in _read(".ci/run").splitlines()
             if l and not l.startswith("#")]
    self.assertEqual(lines[-1], _readme_test_command())
    self.assertIn(f"export {root_skips.VARIABLE}=1", lines)

  def test_the_command_pins_the_tested_versions_and_names_skips(self):
    command = _readme_test_command()
    self.assertIn('pip install -e ".[test]" -c constraints.txt', command)
    self.assertIn("pytest -q -rfEs", command)
    pins = dict(re.findall(r"^([\w-]+)==(\S+)$", _read("constraints.txt"),
                           re.M))
    self.assertEqual(sorted(pins), ["keras", "tensorflow"])
    tested = _read("README.md").split("## Tested versions", 1)[1]
    first = tested.split("\n\n")[1]  # "Python 3.11, tensorflow 2.21.0, ..."
    for name, version in pins.items():
      self.assertIn(f"{name} {version},", first)
      self.assertIn(f"| {version} |", tested)  # The whole suite's row.


  def test_the_pythons_claimed_are_the_pythons_tested(self):
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    floor = setup["options"]["python_requires"]
    self.assertRegex(floor, r"^>=3\.\d+$")
    floor = floor[2:]
    tested = _read("README.md").split("## Tested versions", 1)[1]
    self.assertTrue(tested.split("\n\n")[1].startswith(f"Python {floor},"))
    self.assertIn(f"Python {floor} or newer", _read("README.md"))
    self.assertEqual(re.findall(r"Python :: (3\.\d+)",
                                setup["metadata"]["classifiers"]), [floor])
    self.assertGreaterEqual(sys.version_info[:2],
                            tuple(map(int, floor.split("."))))
    # vermin reads every file for the first Python each feature needs.
    run = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "vermin"), "--no-tips", "--violations",
         "--no-parse-comments", f"-t={floor}-", "tfdist", "tests",
         "examples"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
    self.assertIn("Analyzing", run.stdout)


if __name__ == "__main__":
  absltest.main()
