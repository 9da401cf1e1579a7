"""``tfdist --config FILE``: subcommand defaults from a TOML or JSON file."""

import contextlib
import io
import json
import os
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist.cli import config_file
from tfdist.cli import main as cli_main

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.


class ConfigFileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(prefix="tfdist-config-")
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

  def write(self, name, text):
    path = os.path.join(self.dir, name)
    with open(path, "w") as f:
      f.write(text)
    return path

  def run_cli(self, argv, environ=None):
    out, err = io.StringIO(), io.StringIO()
    old = dict(os.environ)
    os.environ.pop(config_file.VARIABLE, None)
    os.environ.update(environ or {})
    try:
      with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
          code = cli_main.main(argv)
        except SystemExit as e:
          code = e.code
    finally:
      os.environ.clear()
      os.environ.update(old)
    return code, out.getvalue(), err.getvalue()

  @parameterized.named_parameters(
      ("toml", "c.toml", '[slurm]\nnodes = 3\njob-name = "cfg"\n'
                         'sbatch-option = ["--account=abc"]\n'
                         "requeue = false\n"),
      ("json", "c.json", json.dumps({"slurm": {
          "nodes": 3, "job-name": "cfg", "sbatch-option": ["--account=abc"],
          "requeue": False}})),
  )
  def test_values_become_flags(self, name, text):
    path = self.write(name, text)
    code, out, err = self.run_cli(["--config", path, "slurm", "--", "python",
                                   "t.py"])
    self.assertEqual(code, 0, err)
    for line in ("#SBATCH --nodes=3", "#SBATCH --job-name=cfg",
                 "#SBATCH --account=abc", "#SBATCH --no-requeue"):
      self.assertIn(line + "\n", out)

  def test_command_line_flags_win_and_the_variable_names_the_file(self):
    path = self.write("c.toml", "[slurm]\nnodes = 3\n")
    code, out, err = self.run_cli(["slurm", "--nodes", "5", "--", "python",
                                   "t.py"],
                                  environ={config_file.VARIABLE: path})
    self.assertEqual(code, 0, err)
    self.assertIn("#SBATCH --nodes=5\n", out)

  @parameterized.named_parameters(
      ("unknown_key", "[slurm]\nnodez = 3\n", "slurm.nodez"),
      ("wrong_type", '[slurm]\nnodes = "many"\n', "slurm.nodes"),
      ("list_for_one_value", "[slurm]\nnodes = [1, 2]\n", "one value"),
      ("switch_not_bool", '[slurm]\nrequeue = "yes"\n', "true or false"),
      ("unknown_table", "[slurmm]\nnodes = 3\n", "a table named after"),
      ("bad_choice", '[slurm]\npreset = "huge"\n', "slurm.preset"),
      ("not_toml", "[slurm\nnodes = 3\n", "valid TOML"),
  )
  def test_bad_files_exit_2_with_one_line_naming_file_and_key(self, text,
                                                              needle):
    path = self.write("bad.toml", text)
    code, out, err = self.run_cli(["--config", path, "slurm", "--", "python",
                                   "t.py"])
    self.assertEqual(code, 2)
    self.assertEqual(out, "")
    self.assertLen(err.strip().splitlines(), 1, err)
    self.assertStartsWith(err, "tfdist: ")
    self.assertIn(needle, err)
    if needle != "valid TOML":
      self.assertIn(f"config file {path}", err)

  def test_a_missing_file_is_named(self):
    code, _, err = self.run_cli(["--config", os.path.join(self.dir, "no.toml"),
                                 "info"])
    self.assertEqual(code, 2)
    self.assertIn("--config", err)
    self.assertIn("no.toml", err)


if __name__ == "__main__":
  absltest.main()
