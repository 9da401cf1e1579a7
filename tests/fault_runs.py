"""Runs of tests/scripts/fault_job.py: the reference and the check against it.

The fault tests interrupt the job (signals, kills, SLURM requeues), resume it
and check that it ended as an uninterrupted single-process run does.
"""

from __future__ import annotations

import functools
import os
import tempfile

from absl.testing import absltest
import numpy as np

import cluster_utils

__all__ = ["JOB", "STEPS", "TOLERANCE", "assert_like", "reference"]

JOB = "fault_job.py"
STEPS = 18  # fault_job.py's steps in all: 3 epochs of 6, or --steps.
TOLERANCE = 1e-5


@functools.cache
def reference(loop: str = "fit", *args: str) -> dict:
  """The JSON result of an uninterrupted single-process run of ``loop``
  (with the job's further ``args``, e.g. ``--batch 12``), run once a session:
  the fault tests of several modules compare with the same run."""
  with tempfile.TemporaryDirectory(prefix="tfdist-reference-") as tmp:
    return cluster_utils.run_to_end(
        JOB, args=["default", loop, os.path.join(tmp, "backup"), "--sleep",
                   "0", *args])[0]


def assert_like(test: absltest.TestCase, out: dict, expected: dict) -> None:
  """``out`` applied every step once and ended with ``expected``'s weights."""
  test.assertEqual(out["iterations"], STEPS)
  np.testing.assert_allclose(out["weights"], expected["weights"],
                             atol=TOLERANCE)
