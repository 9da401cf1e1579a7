"""The docs tell the truth about the tree: every file they name exists."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

from absl.testing import absltest
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CHANGELOG.md is left out: it names files that are gone on purpose.
DOCS = ["README.md", "cluster_configs/README.md",
        *sorted(os.path.relpath(p, ROOT)
                for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]

# A repository path: a top-level folder, then a file with an extension.
_PATH = re.compile(
    r"(?<![\w/.-])((?:tfdist|tests|docs|examples|cluster_configs|\.ci)"
    r"/[\w./-]*\w\.(?:py|md|sbatch|png|cfg|toml|json))\b")


def named_paths(text: str) -> set[str]:
  return set(_PATH.findall(text))


@pytest.mark.beside
class DocsTest(absltest.TestCase):

  def test_the_pattern_finds_paths(self):
    self.assertEqual(
        named_paths("see `tfdist/cluster/slurm.py` and docs/benchmarks.md, "
                    "not tfdist/raw steps"),
        {"tfdist/cluster/slurm.py", "docs/benchmarks.md"})

  def test_every_named_file_exists(self):
    missing = []
    for doc in DOCS:
      with open(os.path.join(ROOT, doc)) as f:
        for path in sorted(named_paths(f.read())):
          if not os.path.exists(os.path.join(ROOT, path)):
            missing.append(f"{doc}: {path}")
    self.assertEqual(missing, [])

  def test_no_doc_cites_a_file_outside_the_repo(self):
    cited = []
    for folder in ("tfdist", "tests", "docs", "examples"):
      for path in glob.glob(os.path.join(ROOT, folder, "**", "*.*"),
                            recursive=True):
        if path.endswith((".py", ".md")):
          with open(path) as f:
            if "UPSTREAM" + ".md" in f.read():
              cited.append(os.path.relpath(path, ROOT))
    self.assertEqual(cited, [])



@pytest.mark.beside
class ReadmeCellTest(absltest.TestCase):

  def test_the_colab_tpu_cell_runs_on_cpu(self):
    with open(os.path.join(ROOT, "README.md")) as f:
      text = f.read()
    cell = re.search(r"<!-- colab-tpu-cell -->\n```python\n(.*?)```", text,
                     re.S)
    self.assertIsNotNone(cell, "README.md lost its Colab TPU cell")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}
    env.pop("TF_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", cell.group(1)], cwd=ROOT,
                          env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    self.assertIn("_DefaultDistributionStrategy with 1 replicas", done.stdout)
    self.assertRegex(done.stdout, re.compile(r"Epoch 2/2.*32/32.*accuracy: ",
                                             re.S))


@pytest.mark.beside
class LicenseTest(absltest.TestCase):

  def test_apache_2_license_is_shipped_and_named(self):
    with open(os.path.join(ROOT, "LICENSE")) as f:
      text = f.read()
    self.assertEqual(text.split()[:4], ["Apache", "License", "Version", "2.0,"])
    for section in range(1, 10):
      self.assertIn(f"\n   {section}. ", text)
    self.assertIn("END OF TERMS AND CONDITIONS", text)
    with open(os.path.join(ROOT, "setup.cfg")) as f:
      setup = f.read()
    self.assertIn("license = Apache-2.0\n", setup)
    self.assertIn("license_files = LICENSE\n", setup)

if __name__ == "__main__":
  absltest.main()
