""".ci/run runs the README's test command, which installs the TensorFlow
and Keras that README's "Tested versions" names (constraints.txt)."""

import os
import re

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


if __name__ == "__main__":
  absltest.main()
