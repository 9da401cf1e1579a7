"""A TFDS dataset is prepared once per cluster, by the chief, behind a lock.

Real processes with their own TF_CONFIG (chief and worker; no strategy is
needed to know the chief) prepare a real local TFDS builder, offline
(tests/scripts/tfds_counted.py).
"""

import os
import shutil
import tempfile

from absl.testing import absltest
import pytest

import cluster_utils

SCRIPT = "tfds_counted.py"


def _configs():
  return cluster_utils.worker_configs(1, chief=True)  # chief, then worker.


@pytest.mark.timeout(300)
class ChiefPreparesTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.root = tempfile.mkdtemp(prefix="tfdist-tfds-")
    self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
    self.data_dir = os.path.join(self.root, "data")
    self.count = os.path.join(self.root, "count")

  def _preparations(self):
    if not os.path.exists(self.count):
      return []
    with open(self.count) as f:
      return f.read().split()

  def test_a_worker_alone_writes_nothing_and_gives_up_at_its_bound(self):
    worker = _configs()[1]
    [result] = cluster_utils.run_cluster(
        SCRIPT, [worker], args=[self.data_dir, "3"], timeout=120,
        env={"COUNT_FILE": self.count})
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("prepared under", result.stderr)
    self.assertIn("by the chief within 3 s", result.stderr)
    self.assertFalse(os.path.exists(self.data_dir))  # Never written.
    self.assertEqual(self._preparations(), [])

  def test_the_chief_prepares_once_and_the_worker_reads_it(self):
    results = cluster_utils.run_cluster(
        SCRIPT, _configs(), args=[self.data_dir, "120"], timeout=180,
        env={"COUNT_FILE": self.count})
    for r in results:
      self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    chief, worker = (r.json() for r in results)
    self.assertEqual(chief["xs"], list(range(20)))
    self.assertEqual(worker["xs"], chief["xs"])
    self.assertEqual(self._preparations(), [str(chief["pid"])])

  def test_a_failed_chief_fails_the_worker_at_once(self):
    results = cluster_utils.run_cluster(
        SCRIPT, _configs(), args=[self.data_dir, "600"], timeout=180,
        env={"COUNT_FILE": self.count, "FAIL": "1"})
    self.assertNotEqual(results[0].returncode, 0)
    self.assertNotEqual(results[1].returncode, 0)
    self.assertIn("The chief failed", results[1].stderr)
    self.assertIn("the source is broken", results[1].stderr)


if __name__ == "__main__":
  absltest.main()
