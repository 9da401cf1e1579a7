"""Bucketed gradients that cross while the backward pass runs: same weights.

`tests/scripts/overlap_job.py` trains each case under
MultiWorkerMirroredStrategy twice, with TensorFlow's collectives and with the
socket ring in buckets (`tfdist.strategy.transport.buckets`), in one
cluster of three workers for every case. Three, not two: the ring's
schedules at other sizes are simulated in tests/test_ring.py and run between
two real processes in tests/test_transport.py and the bench's schedules.
"""

import json

from absl.testing import absltest
import pytest

import cluster_utils

#: The weights' largest relative difference from the reference, per case:
#: float32 sums are the same bits; 16-bit wires differ at their precision.
TOLERANCE = {"bf16": 2e-2, "fp16": 4e-3}
CASES = ("keras_fit", "tfdist_fit", "runner", "apply_loop", "own_train_step",
         "bf16", "fp16", "accumulation", "clipnorm", "global_clipnorm",
         "sparse", "mixed_precision")
STEPS = 3


@pytest.mark.timeout(900)
class OverlapEquivalenceTest(absltest.TestCase):

  def test_every_case_matches_and_crosses_in_buckets(self):
    results = cluster_utils.run_cluster(
        "overlap_job.py", cluster_utils.worker_configs(3),
        timeout=600, env={"TFDIST_JOB_SECRET": "overlap-test"})
    outs = []
    for r in results:
      self.assertEqual(r.returncode, 0, cluster_utils.tail(r.stderr))
      outs.append(r.json())
    self.assertEqual(sorted(outs[0]), sorted(CASES))
    for name, out in outs[0].items():
      with self.subTest(case=name):
        self.assertLessEqual(out["max_rel_diff"], TOLERANCE.get(name, 1e-5))
        # Several buckets, each one ring call per update.
        self.assertGreater(out["buckets"], 1)
        self.assertEqual(out["ring_calls"], out["buckets"] * STEPS)
    # Every worker ends with the same weights, to the bit, case by case.
    for out in outs[1:]:
      self.assertEqual(json.dumps(out, sort_keys=True),
                       json.dumps(outs[0], sort_keys=True))


if __name__ == "__main__":
  absltest.main()
