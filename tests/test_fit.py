"""tfdist.fit on real strategies and clusters: correctness, resume, chief."""

import functools
import glob
import os
import shutil
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

import cluster_utils
import tfdist

TWO_CPUS = ["--devices", "/cpu:0,/cpu:1"]
TOLERANCE = 1e-5
STEPS = 18  # 3 epochs of 6 steps.


def _run(args, **kwargs):
  result = cluster_utils.run_script("fit_job.py", args=args, timeout=240,
                                    **kwargs)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.json()


def _in_pairs(arg_lists):
  """Runs fit_job.py once per list of ``arg_lists``, two processes at a time
  (the load of one 2-worker cluster); their results, in order."""
  results = []
  for i in range(0, len(arg_lists), 2):
    pair = arg_lists[i:i + 2]
    results += cluster_utils.run_processes(
        [[sys.executable, os.path.join(cluster_utils.SCRIPTS, "fit_job.py"),
          *args] for args in pair],
        [cluster_utils.base_env()] * len(pair), timeout=240)
  return results


#: Uninterrupted single-process runs by their args, each run once per module:
#: FitResumeTest compares with the runs FitCorrectnessTest checks.
_UNINTERRUPTED = {}


def _missing(arg_lists):
  """The args of ``arg_lists`` not run uninterrupted yet, each once."""
  return list(dict.fromkeys(tuple(a) for a in arg_lists
                            if tuple(a) not in _UNINTERRUPTED))


def _uninterrupted(args):
  """The JSON result of the uninterrupted run with ``args``, which ended."""
  result = _UNINTERRUPTED[tuple(args)]
  assert result.returncode == 0, result.stderr[-3000:]
  return result.json()


_SINGLE_PROCESS = (
    ("mirrored_arrays", ["mirrored", *TWO_CPUS]),
    ("mirrored_dataset", ["mirrored", *TWO_CPUS, "--input", "dataset"]),
    ("mirrored_dataset_fn", ["mirrored", *TWO_CPUS, "--input", "dataset_fn"]),
    ("mirrored_steps_per_execution", ["mirrored", *TWO_CPUS, "--spe", "2"]),
    ("central_storage_arrays", ["central_storage", *TWO_CPUS]),
)


@functools.cache
def _chief_writes():
  """A 2-worker run on arrays with a TensorBoard dir, a ModelCheckpoint and
  an export, once per module: FitCorrectnessTest checks how it trained,
  FitChiefWritesTest what it wrote.

  Returns:
    The export path, the tasks' results, and what the run left in its temp
    dir (removed here): TensorBoard event files, whether the checkpoint is a
    file, the names (TF's autograph files aside), the reloaded export's
    parameter count.
  """
  d = tempfile.mkdtemp()
  try:
    tb, ckpt = os.path.join(d, "tb"), os.path.join(d, "w.weights.h5")
    export = os.path.join(d, "model.keras")
    results = cluster_utils.run_cluster(
        "fit_job.py", cluster_utils.worker_configs(2),
        args=["multi_worker_mirrored", "--tensorboard", tb,
              "--checkpoint", ckpt, "--export", export], timeout=240,
        env={"TMPDIR": d})
    written = {
        "events": len(glob.glob(os.path.join(tb, "train", "events.*"))),
        "checkpoint": os.path.isfile(ckpt),
        "files": sorted(f for f in os.listdir(d)
                        if not f.startswith("__autograph_generated")),
        "params": (keras.saving.load_model(export).count_params()
                   if os.path.isfile(export) else None)}
  finally:
    shutil.rmtree(d, ignore_errors=True)
  return export, results, written


@pytest.mark.timeout(600)
class FitCorrectnessTest(parameterized.TestCase):
  """N replicas with global batch B match one device with batch B."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    runs = _missing([["default"], *(args for _, args in _SINGLE_PROCESS)])
    _UNINTERRUPTED.update(zip(runs, _in_pairs(runs)))
    cls.reference = np.array(_uninterrupted(["default"])["weights"])

  @parameterized.named_parameters(*_SINGLE_PROCESS)
  def test_single_process(self, args):
    out = _uninterrupted(args)
    self.assertEqual(out["iterations"], STEPS)
    self.assertEqual(out["epochs"], [0, 1, 2])
    np.testing.assert_allclose(out["weights"], self.reference, atol=TOLERANCE)

  @parameterized.named_parameters(("arrays", "arrays"),
                                  ("dataset_fn", "dataset_fn"))
  def test_multi_worker_mirrored_two_processes(self, data):
    # On arrays, the run that also writes (the callbacks leave training as
    # it is).
    results = _chief_writes()[1] if data == "arrays" else (
        cluster_utils.run_cluster(
            "fit_job.py", cluster_utils.worker_configs(2),
            args=["multi_worker_mirrored", "--input", data], timeout=240))
    for r in results:
      self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    for r in results:
      out = r.json()
      self.assertEqual(out["replicas"], 2)
      self.assertEqual(out["iterations"], STEPS)
      np.testing.assert_allclose(out["weights"], self.reference,
                                 atol=TOLERANCE)
    # The progress bar and logs are the chief's alone.
    self.assertIn("Epoch 1/3", results[0].stdout)
    self.assertNotIn("Epoch 1/3", results[1].stdout)


_RESUMES = (
    ("mid_epoch", ["mirrored", *TWO_CPUS], "2", "9"),
    ("epoch_boundary", ["mirrored", *TWO_CPUS], "4", "10"),
    ("shuffled_arrays", ["mirrored", *TWO_CPUS, "--input", "shuffled"], "2",
     "9"),
    ("dataset_fn", ["mirrored", *TWO_CPUS, "--input", "dataset_fn"], "2",
     "13"),
)


def _key(args, every, die_at):
  return (tuple(args), every, die_at)


@pytest.mark.timeout(600)
class FitResumeTest(parameterized.TestCase):
  """A run killed mid-epoch resumes exactly: no step lost or applied twice."""

  @classmethod
  def setUpClass(cls):
    """Every row's killed run, then its resumed run, two processes at a time
    (the uninterrupted runs no earlier test ran go with the killed ones)."""
    super().setUpClass()
    d = tempfile.mkdtemp()
    cls.addClassCleanup(shutil.rmtree, d, ignore_errors=True)
    backups = []
    for name, *_ in _RESUMES:
      os.makedirs(os.path.join(d, name))
      backups.append(os.path.join(d, name, "backup"))
    resume = [[*args, "--backup", backup, "--every", every]
              for backup, (_, args, every, _) in zip(backups, _RESUMES)]
    missing = _missing([row[1] for row in _RESUMES] + [["default"]])
    runs = _in_pairs([[*r, "--die-at", row[3]]
                      for r, row in zip(resume, _RESUMES)] + missing)
    killed = runs[:len(_RESUMES)]
    _UNINTERRUPTED.update(zip(missing, runs[len(_RESUMES):]))
    checkpoints = [tf.train.latest_checkpoint(b) for b in backups]
    resumed = _in_pairs(resume)
    cls.runs = {_key(*row): (k, c, r, os.path.exists(b))
                for (_, *row), k, c, r, b in zip(_RESUMES, killed, checkpoints,
                                                 resumed, backups)}

  @parameterized.named_parameters(*_RESUMES)
  def test_kill_and_resume_matches_uninterrupted(self, args, every, die_at):
    killed, checkpoint, resumed, backup_kept = self.runs[
        _key(args, every, die_at)]
    self.assertEqual(killed.returncode, 3, killed.stderr[-3000:])
    self.assertIsNotNone(checkpoint)
    self.assertEqual(resumed.returncode, 0, resumed.stderr[-3000:])
    self.assertFalse(backup_kept, "backup kept after success")
    self.assertEqual(resumed.json()["iterations"], STEPS)
    np.testing.assert_allclose(resumed.json()["weights"],
                               _uninterrupted(args)["weights"],
                               atol=TOLERANCE)

  def test_multi_worker_mirrored_resume(self):
    with tempfile.TemporaryDirectory() as d:
      backup = os.path.join(d, "backup")
      args = ["multi_worker_mirrored", "--backup", backup, "--every", "2"]
      killed = cluster_utils.run_cluster(
          "fit_job.py", cluster_utils.worker_configs(2),
          args=[*args, "--die-at", "9"], timeout=240, env={"TMPDIR": d})
      self.assertEqual([r.returncode for r in killed], [3, 3])
      resumed = cluster_utils.run_cluster(
          "fit_job.py", cluster_utils.worker_configs(2), args=args,
          timeout=240, env={"TMPDIR": d})
      for r in resumed:
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        self.assertEqual(r.json()["iterations"], STEPS)
      # No worker temp dirs and no backup (TF's autograph files aside).
      self.assertEqual([f for f in os.listdir(d)
                        if not f.startswith("__autograph_generated")], [])
    np.testing.assert_allclose(resumed[0].json()["weights"],
                               _uninterrupted(["default"])["weights"],
                               atol=TOLERANCE)


@pytest.mark.beside
@pytest.mark.timeout(300)
class FitChiefWritesTest(absltest.TestCase):

  def test_only_the_chief_writes_checkpoints_tensorboard_and_exports(self):
    export, results, written = _chief_writes()
    for r in results:
      self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    self.assertEqual([r.json()["exported"] for r in results], [export, None])
    self.assertEqual(written["events"], 1)
    self.assertTrue(written["checkpoint"])
    self.assertEqual(written["files"], ["model.keras", "tb", "w.weights.h5"])
    self.assertEqual(written["params"], 33)


@pytest.mark.timeout(300)
class FitParameterServerTest(absltest.TestCase):

  def test_trains_through_cluster_coordinator(self):
    out = _run(["parameter_server", "--ps-local", "2", "--input",
                "dataset_fn"])
    self.assertEqual(out["epochs"], [0, 1, 2])
    self.assertLen(out["loss"], 3)
    self.assertLess(out["loss"][-1], out["loss"][0])
    # Two workers run steps at once; every increment of the optimizer's
    # iterations counts (keras_compat's atomic_assign_add).
    self.assertEqual(out["iterations"], STEPS)


@pytest.mark.beside
@pytest.mark.timeout(300)  # Before tfdist checked them, some hung forever.
class FitBadInputTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.strategy = tfdist.make_strategy("mirrored",
                                         devices=["/cpu:0", "/cpu:1"])
    with self.strategy.scope():
      self.model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      self.model.compile(optimizer="sgd", loss="mse")

  @parameterized.named_parameters(
      ("unbatched_dataset",
       dict(x=tf.data.Dataset.from_tensor_slices((np.ones((4, 2)),
                                                  np.ones((4, 1)))))),
      ("dataset_fn_without_steps",
       dict(x=lambda ctx: tf.data.Dataset.range(2))),
      ("infinite_dataset_without_steps",
       dict(x=tf.data.Dataset.from_tensors((np.ones((2, 2)),
                                            np.ones((2, 1)))).repeat())),
      ("batch_not_divisible", dict(x=np.ones((8, 2)), y=np.ones((8, 1)),
                                   batch_size=3)),
      ("no_input", dict()),
      ("zero_epochs", dict(x=np.ones((8, 2)), y=np.ones((8, 1)), epochs=0)),
      ("bad_backup_every", dict(x=np.ones((8, 2)), y=np.ones((8, 1)),
                                backup_every_steps=0)),
      ("keras_backup_and_restore",
       dict(x=np.ones((8, 2)), y=np.ones((8, 1)),
            callbacks=[keras.callbacks.BackupAndRestore("/nonexistent")])),
      ("y_with_dataset",
       dict(x=tf.data.Dataset.from_tensors(np.ones((2, 2))), y=np.ones(2))),
      # Counts that never end an epoch: Keras loops forever on them.
      ("negative_steps_per_epoch", dict(x=np.ones((8, 2)), y=np.ones((8, 1)),
                                        steps_per_epoch=-1)),
      ("zero_steps_per_epoch", dict(x=np.ones((8, 2)), y=np.ones((8, 1)),
                                    steps_per_epoch=0)),
      ("negative_steps_with_backup",
       dict(x=np.ones((8, 2)), y=np.ones((8, 1)), steps_per_epoch=-1,
            backup_dir="/nonexistent/tfdist-never-written")),
      ("negative_initial_epoch", dict(x=np.ones((8, 2)), y=np.ones((8, 1)),
                                      initial_epoch=-1)),
      ("bool_epochs", dict(x=np.ones((8, 2)), y=np.ones((8, 1)), epochs=True)),
      # A dataset_fn that returns no dataset: one line, not a TF traceback.
      ("dataset_fn_returns_numpy",
       dict(x=lambda ctx: np.ones((4, 2)), steps_per_epoch=2)),
      ("dataset_fn_returns_none", dict(x=lambda ctx: None,
                                       steps_per_epoch=2)),
  )
  def test_config_error(self, kwargs):
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.fit(self.model, verbose=0, **kwargs)
    self.assertIn("tfdist.fit", str(caught.exception))


if __name__ == "__main__":
  absltest.main()
