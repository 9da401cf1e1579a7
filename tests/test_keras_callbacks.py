"""Keras's own writing callbacks in plain `model.fit` under tfdist strategies.

ModelCheckpoint, BackupAndRestore, TensorBoard and CSVLogger are created as a
Keras user writes them, with the same paths on every worker. Under a tfdist
strategy only the chief writes those paths, its checkpoints renamed into
place whole; other workers write temporary directories that are removed
(`tfdist.strategy.keras_callbacks`). MultiWorkerMirroredStrategy runs as 2
real processes (tests/scripts/keras_fit.py); Mirrored runs in this process.
"""

import glob
import json
import os
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

import tfdist
from tfdist._compat import keras as keras_compat
from tfdist.strategy import keras_callbacks
import cluster_utils

DEVICES = ["/cpu:0", "/cpu:1"]
# The Keras corrections MultiWorkerMirroredStrategy needs besides this one.
_OTHER_FIXES = "symbolic_build_reduce,multi_worker_scalar_mean"


def _event_pids(log_dir: str) -> set[int]:
  """PIDs of the processes that wrote TensorBoard event files under log_dir."""
  pids = set()
  for path in glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"),
                        recursive=True):
    # events.out.tfevents.<time>.<host>.<pid>.<n>.v2
    pids.add(int(os.path.basename(path).split(".")[-3]))
  return pids


def _tempdir(test: absltest.TestCase) -> str:
  path = tempfile.mkdtemp(prefix="tfdist-test-")
  test.addCleanup(shutil.rmtree, path, True)
  return path


def _tree(root: str) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, files in os.walk(root) for f in files)


@pytest.mark.beside
@pytest.mark.timeout(120)
class ChiefInProcessTest(parameterized.TestCase):
  """One process, 2 replicas: the chief's files land whole, nothing else."""

  def setUp(self):
    super().setUp()
    keras_compat.apply()
    self.root = _tempdir(self)

  def _fit(self, callbacks, epochs=2):
    strategy = tfdist.make_strategy("mirrored", devices=DEVICES)
    with strategy.scope():
      keras.utils.set_random_seed(0)
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
      model.compile(optimizer="sgd", loss="mse")
    x = np.ones((32, 4), np.float32)
    model.fit(x, np.zeros((32, 2), np.float32), batch_size=8, epochs=epochs,
              verbose=0, callbacks=callbacks)
    return model

  def test_checkpoints_land_in_place_and_staging_is_gone(self):
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(self.root, "ckpt", "e{epoch}.weights.h5"),
            save_weights_only=True),
        keras.callbacks.BackupAndRestore(os.path.join(self.root, "backup"),
                                         delete_checkpoint=False,
                                         double_checkpoint=True),
    ]
    self._fit(callbacks)
    self.assertEqual(_tree(self.root), [
        "backup/latest.weights.h5", "backup/latest.weights.h5.bkp",
        "backup/training_metadata.json", "backup/training_metadata.json.bkp",
        "ckpt/e1.weights.h5", "ckpt/e2.weights.h5"])
    with open(os.path.join(self.root, "backup", "training_metadata.json")) as f:
      self.assertEqual(json.load(f)["epoch"], 2)
    with open(os.path.join(self.root, "backup",
                           "training_metadata.json.bkp")) as f:
      self.assertEqual(json.load(f)["epoch"], 1)
    # The callbacks have their own paths back, and nothing is left on them.
    self.assertEqual(callbacks[0].filepath,
                     os.path.join(self.root, "ckpt", "e{epoch}.weights.h5"))
    self.assertEqual(callbacks[1].backup_dir,
                     os.path.join(self.root, "backup"))
    for cb in callbacks:
      self.assertNotIn("on_epoch_end", vars(cb))
      self.assertEqual([name for name in dir(cb) if "tfdist" in name], [])

  def test_a_formatted_directory_is_written_as_keras_formats_it(self):
    checkpoint = keras.callbacks.ModelCheckpoint(
        os.path.join(self.root, "e{epoch}", "m.keras"))
    self._fit([checkpoint])
    self.assertEqual(_tree(self.root), ["e1/m.keras", "e2/m.keras"])

  def test_backup_resumes_at_the_saved_epoch(self):
    backup = os.path.join(self.root, "backup")
    self._fit([keras.callbacks.BackupAndRestore(
        backup, delete_checkpoint=False, double_checkpoint=True)], epochs=2)
    os.mkdir(os.path.join(backup, ".tfdist-staging-1"))  # A killed save's.
    history = self._fit([keras.callbacks.BackupAndRestore(backup)],
                        epochs=3).history.history
    self.assertLen(history["loss"], 1)  # Epochs 1 and 2 were restored.
    self.assertFalse(os.path.exists(backup))  # delete_checkpoint, by the chief.

  @parameterized.named_parameters(
      ("keras", keras.callbacks.BackupAndRestore,
       "keras.callbacks.BackupAndRestore", "Keras's BackupAndRestore"),
      ("tfdist", tfdist.BackupAndRestore, "tfdist.BackupAndRestore",
       "tfdist (there is no tfdist-owner.json)"),
  )
  def test_a_directory_of_user_files_is_refused_untouched(
      self, callback, source, writer):
    # Keras's own deletes its whole backup_dir when training ends.
    backup = os.path.join(self.root, "backup")
    os.makedirs(os.path.join(backup, "mine"))
    for name in ("notes.txt", "mine/data.csv"):
      with open(os.path.join(backup, name), "w") as f:
        f.write(name)
    with self.assertRaises(tfdist.ConfigError) as caught:
      self._fit([callback(backup)])
    e = caught.exception
    self.assertEqual((e.field, e.value, e.source),
                     ("backup_dir", backup, source))
    self.assertEqual(e.expected, (
        "a new or empty directory, or one this job's backups were written to "
        f"(it holds mine, notes.txt, which {writer} did not write)"))
    self.assertEqual(e.hint, (
        f"To start fresh, pass a new backup_dir, or delete {backup} yourself; "
        "tfdist never removes what it did not write"))
    self.assertEqual(_tree(self.root),  # Nothing written, nothing removed.
                     ["backup/mine/data.csv", "backup/notes.txt"])
    with open(os.path.join(backup, "mine", "data.csv")) as f:
      self.assertEqual(f.read(), "mine/data.csv")

  def test_a_failing_fit_leaves_no_staging_directory(self):
    class Boom(keras.callbacks.Callback):

      def on_epoch_end(self, epoch, logs=None):
        raise RuntimeError("boom")

    checkpoint = keras.callbacks.ModelCheckpoint(
        os.path.join(self.root, "m.keras"))
    with self.assertRaisesRegex(RuntimeError, "boom"):
      self._fit([checkpoint, Boom()])
    # ModelCheckpoint ran before Boom: its file is in place, staging removed.
    self.assertEqual(_tree(self.root), ["m.keras"])
    self.assertEqual(checkpoint.filepath, os.path.join(self.root, "m.keras"))

  def test_a_held_callback_is_left_to_the_outer_one_writer_until_it_ends(self):
    real = os.path.join(self.root, "log.csv")
    logger = keras.callbacks.CSVLogger(real)
    point = lambda: keras_callbacks.one_writer(
        [logger], chief=False, refusal=tfdist.ConfigError)
    with point():
      outer = logger.filename
      with point():  # fit's own evaluate, inside fit: left to fit's.
        self.assertEqual(logger.filename, outer)
      self.assertEqual(logger.filename, outer)
    self.assertEqual(logger.filename, real)
    with point():  # Given back: held and pointed again.
      self.assertNotIn(logger.filename, (real, outer))
    self.assertEqual(logger.filename, real)


@pytest.mark.timeout(400)
class MultiWorkerCallbacksTest(absltest.TestCase):
  """2 worker processes, every callback on one shared path."""

  @staticmethod
  def _run(root, *args):
    tmp = tempfile.mkdtemp(dir=root, prefix="tmp-")
    results = cluster_utils.run_cluster(
        "keras_fit.py", cluster_utils.worker_configs(2),
        args=("--write_dir", os.path.join(root, "out"), "--steps", "3", *args),
        env={"TMPDIR": tmp}, timeout=180)
    outs = [r.json() for r in results]
    return outs, results, tmp

  @classmethod
  def _chief_runs(cls):
    """Two runs on one root, shared by the tests that read them: 2 epochs
    (verbose="auto"), what they left; then the resume to epoch 3 (verbose
    0), which then evaluates and predicts with TensorBoard under root/eval."""
    if not hasattr(cls, "_chief"):
      root = tempfile.mkdtemp()
      cls.addClassCleanup(shutil.rmtree, root)
      first = cls._run(root, "--epochs", "2", "--verbose", "auto")
      out_dir = os.path.join(root, "out")
      with open(os.path.join(out_dir, "log.csv")) as f:
        log = f.read()
      left = {"files": _tree(out_dir), "log.csv": log,
              "tb_pids": _event_pids(os.path.join(out_dir, "tb")),
              "tmp": os.listdir(first[2])}
      second = cls._run(root, "--epochs", "3", "--evaluate_dir",
                        os.path.join(root, "eval"))
      cls._chief = root, first, left, second
    return cls._chief

  def test_only_the_chief_writes_and_workers_clean_up(self):
    root, (outs, results, _), left, second = self._chief_runs()
    for out, result in zip(outs, results):
      self.assertTrue(out["ok"], f"{out}\n{cluster_utils.tail(result.stderr)}")
      self.assertIn("chief_aware_callbacks", out["applied"])
    # verbose="auto": one progress bar, the chief's.
    self.assertIn("Epoch 2/2", results[0].stdout)
    self.assertNotIn("Epoch", results[1].stdout)
    out_dir = os.path.join(root, "out")
    files = left["files"]
    for expected in ("backup/latest.weights.h5", "backup/latest.weights.h5.bkp",
                     "backup/training_metadata.json", "best.keras",
                     "ckpt/epoch-1.weights.h5", "ckpt/epoch-2.weights.h5",
                     "log.csv"):
      self.assertIn(expected, files)
    self.assertEmpty([f for f in files if ".tfdist-staging-" in f])
    # TensorBoard: only worker 0 (the chief) wrote event files.
    self.assertEqual(left["tb_pids"], {outs[0]["pid"]})
    self.assertLen(left["log.csv"].splitlines(), 3)  # Header + 2 epochs, once.
    # Worker 1's temporary directories are gone.
    self.assertEqual(left["tmp"], [])
    # Resume: both workers restore the chief's epoch 2 and train epoch 3.
    outs, results, _ = second
    for out, result in zip(outs, results):
      self.assertTrue(out["ok"], f"{out}\n{cluster_utils.tail(result.stderr)}")
      self.assertLen(out["history"]["loss"], 1)
    self.assertEqual(outs[0]["checksum"], outs[1]["checksum"])
    with open(os.path.join(out_dir, "backup", "training_metadata.json")) as f:
      self.assertEqual(json.load(f)["epoch"], 3)

  def test_a_directory_of_user_files_is_refused_on_every_worker(self):
    root = _tempdir(self)
    backup = os.path.join(root, "out", "backup")
    os.makedirs(backup)
    with open(os.path.join(backup, "notes.txt"), "w") as f:
      f.write("mine")
    outs, results, tmp = self._run(root, "--epochs", "1")
    for out, result in zip(outs, results):
      self.assertFalse(out["ok"], cluster_utils.tail(result.stderr))
      self.assertEqual(out["error_type"], "ConfigError")
      self.assertIn(
          f"backup_dir: received '{backup}'; expected a new or empty "
          "directory, or one this job's backups were written to (it holds "
          "notes.txt, which Keras's BackupAndRestore did not write) "
          "(keras.callbacks.BackupAndRestore). To start fresh", out["error"])
    # Refused before anything was written, on either worker.
    self.assertEqual(_tree(os.path.join(root, "out")), ["backup/notes.txt"])
    with open(os.path.join(backup, "notes.txt")) as f:
      self.assertEqual(f.read(), "mine")
    self.assertEqual(os.listdir(tmp), [])

  def test_evaluate_and_predict_write_and_draw_from_the_chief(self):
    # The resume's run (fit with verbose 0) then evaluates and predicts.
    root, _, _, (outs, results, tmp) = self._chief_runs()
    for out, result in zip(outs, results):
      self.assertTrue(out["ok"], f"{out}\n{cluster_utils.tail(result.stderr)}")
    self.assertEqual(_event_pids(os.path.join(root, "eval", "tb")),
                     {outs[0]["pid"]})
    # verbose="auto": evaluate's and predict's bars on the chief only.
    self.assertGreaterEqual(results[0].stdout.count("/step"), 2)
    self.assertNotIn("/step", results[1].stdout)
    self.assertEqual(os.listdir(tmp), [])

  def test_upstream_every_worker_writes(self):
    # Keras without the correction: both workers write the one TensorBoard
    # directory (here, too, worker 0 then died on the shared HDF5 file:
    # "unable to lock file", and worker 1 lost its peer). Fails once
    # upstream writes from the chief only.
    root = _tempdir(self)
    outs, _, _ = self._run(root, "--epochs", "1", "--upstream", "--fixes",
                           _OTHER_FIXES)
    self.assertEqual(_event_pids(os.path.join(root, "out", "tb")),
                     {out["pid"] for out in outs},
                     f"upstream Keras {keras.__version__} no longer writes "
                     f"from every worker: drop chief_aware_callbacks? {outs}")


if __name__ == "__main__":
  absltest.main()
