"""A backup written by N workers resumes on M workers, through each entry point.

One chain of real clusters (tests/scripts/resize_job.py) on 1, 2, 3, 2 and
then 1 worker: each run resumes the backups the run before stopped in and
stops again further on, the last one trains to the end. Every run goes
through ``tfdist.fit`` (arrays, a dataset of global batches, and a
``dataset_fn`` of per-replica batches), ``tfdist.BackupAndRestore`` and
Keras's own ``BackupAndRestore`` in plain ``model.fit``, and
``tfdist.Runner``. The tests check each change of size: with the same global
batch every step, the restored one first, ends with the weights of an
uninterrupted single-process run (1e-5 relative; the first run's process
trains it after its own entry points); with another global batch
the run resumes at the saved sample and the chief says so.
"""

import json
import os
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

import cluster_utils
from tfdist.training import ownership

JOB = "resize_job.py"
STEPS = 20  # resize_job.py: 5 epochs of 4 steps of global batch 12.
STEPS_PER_EPOCH = 4
SAMPLES = 48  # Per epoch.
PER_REPLICA = 4  # fit_per_replica's batch: its global batch is 4 per worker.
PER_REPLICA_STEPS = 3  # fit_per_replica trains this many steps per run.
SAME_BATCH = ("fit_arrays", "fit_dataset", "keras_tfdist", "keras_own",
              "runner")
# (workers, the step the backups stop at, keras_own's epoch): the last run
# trains to the end.
CHAIN = ((1, 2, 1), (2, 7, 2), (3, 13, 3), (2, 18, 4), (1, None, None))


def _relative(test, got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  error = np.linalg.norm(got - want) / np.linalg.norm(want)
  test.assertLess(error, 1e-5, f"{what}: relative error {error}")


def _stops(run, entry):
  """The step ``entry`` stops at in ``run`` (a `CHAIN` entry), if any."""
  _, stop, epoch = run
  if entry == "keras_own":  # It backs up at epoch ends only.
    return epoch and epoch * STEPS_PER_EPOCH
  return stop


def _per_replica_positions():
  """fit_per_replica's saved (epoch, step, global batch) after each run."""
  positions, epoch, step, batch = [], 0, 0, None
  for workers, _, _ in CHAIN[:-1]:
    here = PER_REPLICA * workers
    if batch:
      step = step * batch // here
    step, batch = step + PER_REPLICA_STEPS, here
    if step >= SAMPLES // here:
      epoch, step = epoch + 1, step - SAMPLES // here
    positions.append((epoch, step, batch))
  return positions


@pytest.mark.timeout(900)
class ResizeTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root = tempfile.mkdtemp(prefix="tfdist-resize-")
    backups = os.path.join(cls.root, "backups")
    cls.runs, cls.owners = [], []
    try:
      for workers, stop, epoch in CHAIN:
        args = [backups]
        if stop is not None:
          args += ["--stop", str(stop), "--stop-epoch", str(epoch),
                   "--per-replica-steps", str(PER_REPLICA_STEPS)]
        if not cls.runs:  # One process: the uninterrupted run after it.
          args += ["--reference", os.path.join(cls.root, "reference")]
        configs = ([None] if workers == 1
                   else cluster_utils.worker_configs(workers))
        results = cluster_utils.run_cluster(JOB, configs, args=args,
                                            timeout=300,
                                            env={"TMPDIR": cls.root})
        for i, r in enumerate(results):
          assert r.returncode == 0, (f"{workers} workers, task {i}:\n"
                                     f"{cluster_utils.tail(r.stderr)}")
        cls.runs.append(results)
        if len(cls.runs) == 1:
          cls.reference = results[0].json()["reference"]
        owner = os.path.join(backups, "fit_arrays", ownership.OWNER_FILE)
        if os.path.exists(owner):
          with open(owner) as f:
            cls.owners.append(json.load(f))
    finally:
      cls.left = sorted(os.path.relpath(os.path.join(parent, name), cls.root)
                        for parent, dirs, files in os.walk(cls.root)
                        for name in dirs + files)
      shutil.rmtree(cls.root, ignore_errors=True)

  @parameterized.named_parameters(
      ("1_to_2", 1), ("2_to_3", 2), ("3_to_2", 3), ("2_to_1", 4))
  def test_same_global_batch_resumes_exactly(self, run):
    previous = CHAIN[run - 1]
    for task, result in enumerate(self.runs[run]):
      out = result.json()
      for entry in SAME_BATCH:
        saved, stop = _stops(previous, entry), _stops(CHAIN[run], entry)
        self.assertEqual(out[entry]["start"], saved, f"{entry} task {task}")
        steps = sorted(int(s) for s in out[entry]["weights"])
        self.assertEqual((steps[0], steps[-1]), (saved, stop or STEPS), entry)
        for step in steps:
          _relative(self, out[entry]["weights"][str(step)],
                    self.reference[entry]["weights"][str(step)],
                    f"{entry} at step {step} on task {task} of "
                    f"{CHAIN[run][0]}")

  @parameterized.named_parameters(
      ("1_to_2", 1), ("2_to_3", 2), ("3_to_2", 3), ("2_to_1", 4))
  def test_another_global_batch_resumes_at_the_sample(self, run):
    epoch, step, batch = _per_replica_positions()[run - 1]
    workers, here = CHAIN[run - 1][0], PER_REPLICA * CHAIN[run][0]
    line = (f"tfdist: resuming a backup of {workers} worker"
            f"{'s' * (workers != 1)} (global batch {batch}) on "
            f"{CHAIN[run][0]} worker{'s' * (CHAIN[run][0] != 1)} (global "
            f"batch {here}) at epoch {epoch}, sample {step * batch} of "
            f"{SAMPLES}")
    if step * batch % here:
      line += f" (from step {step * batch // here}: sample " \
              f"{step * batch // here * here})"
    chief, *others = self.runs[run]
    self.assertIn(line + "\n", chief.stderr)
    for other in others:
      self.assertNotIn("resuming a backup", other.stderr)
    # Every step applied before is kept: the optimizer goes on counting.
    before = max(int(s) for s in
                 self.runs[run - 1][0].json()["fit_per_replica"]["weights"])
    self.assertEqual(chief.json()["fit_per_replica"]["start"], before)

  def test_the_owner_record_keeps_every_size_and_the_end_cleans_up(self):
    shapes = [{} if workers == 1 else {"worker": workers}
              for workers, _, _ in CHAIN]
    self.assertEqual([ownership.clusters(o) for o in self.owners],
                     [shapes[:1], shapes[:2], shapes[:3], shapes[:3]])
    last = self.runs[-1][0].json()
    for entry in SAME_BATCH:
      self.assertEqual(max(int(s) for s in last[entry]["weights"]), STEPS)
    # Finished: every backup is gone (the parents stay; a Runner keeps its
    # checkpoints), and no worker left a temporary directory.
    self.assertEqual([p for p in self.left if "/runner/" not in p],
                     ["backups", "backups/runner", "reference",
                      "reference/runner"])


@pytest.mark.timeout(600)
class ParameterServerResizeTest(absltest.TestCase):
  """ParameterServerStrategy: 1 worker and 3 ps tasks, then 2 and 2.

  ``ps_fit`` (tfdist.fit) and ``ps_runner`` train Keras models;
  ``ps_embedding`` is a Runner over an embedding table that the variable
  partitioner puts in one shard per ps task: 3 shards, restored onto 2.
  """

  ENTRIES = ("ps_fit", "ps_runner", "ps_embedding")
  STOP = 3  # The first run stops once step 3 is backed up, the second at 6.
  END = 6

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with tempfile.TemporaryDirectory(prefix="tfdist-resize-ps-") as d:
      backups = os.path.join(d, "backups")
      cls.first, cls.second = (
          cluster_utils.run_cluster(JOB, [None], args=args, timeout=300,
                                    env={"TMPDIR": d})[0]
          for args in ([backups, "--ps", "1", "3", "--stop", str(cls.STOP)],
                       [backups, "--ps", "2", "2", "--stop", str(cls.END)]))
    for r in (cls.first, cls.second):
      assert r.returncode == 0, cluster_utils.tail(r.stderr)

  def test_resumes_at_the_saved_step_with_the_saved_variables(self):
    first, second = self.first.json(), self.second.json()
    for entry in self.ENTRIES:
      self.assertEqual(max(int(s) for s in first[entry]["weights"]),
                       self.STOP, entry)
      self.assertEqual(second[entry]["start"], self.STOP, entry)
      _relative(self, second[entry]["weights"][str(self.STOP)],
                first[entry]["weights"][str(self.STOP)], entry)
      self.assertEqual(max(int(s) for s in second[entry]["weights"]),
                       self.END, entry)
    self.assertEqual((first["ps_embedding"]["shards"],
                      second["ps_embedding"]["shards"]), (3, 2))
    self.assertIn("tfdist: resuming a backup of 1 worker (global batch 12) "
                  "on 2 workers (global batch 12) at epoch 0, sample 36 of "
                  f"{SAMPLES}\n", self.second.stderr)


if __name__ == "__main__":
  absltest.main()
