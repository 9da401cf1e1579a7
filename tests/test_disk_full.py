"""A full disk: one line, the partial save removed, the last checkpoint kept.

A real small filesystem (a tmpfs this test mounts, as root) fills up under a
real save: `tfdist.fit` launched by ``tfdist launch`` and `tfdist.Runner` in
this process. The partial saves a killed run leaves are removed at the next
start, and only those.
"""

import importlib.util
import os
import shutil
import subprocess
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
from tfdist.launch import output
from tfdist.training import checkpoints
from tfdist.training import ownership

_spec = importlib.util.spec_from_file_location(
    "disk_job", os.path.join(cluster_utils.SCRIPTS, "disk_job.py"))
disk_job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(disk_job)

MB = 1 << 20


def _tmpfs(test: absltest.TestCase, size_mb: int = 8) -> str:
  """A fresh tmpfs of ``size_mb`` MiB, unmounted when ``test`` ends."""
  if os.geteuid() != 0:
    test.skipTest("mounting a small filesystem (tmpfs) needs root; CI runs "
                  "the suite as root")
  mount = tempfile.mkdtemp(prefix="tfdist-disk-")
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs",
                      mount], capture_output=True, text=True, check=False)
  if r.returncode:
    os.rmdir(mount)
    test.skipTest(f"mount -t tmpfs failed here: {r.stderr.strip()}")
  test.addCleanup(os.rmdir, mount)
  test.addCleanup(subprocess.run, ["umount", "-l", mount], check=True)
  return mount


def _resize(mount: str, size_mb: int) -> None:
  subprocess.run(["mount", "-o", f"remount,size={size_mb}m", mount],
                 check=True)


def _fill(mount: str, leave: int) -> None:
  """Writes a file of the user's that leaves ``leave`` bytes free."""
  with open(os.path.join(mount, "filler"), "wb") as f:
    f.write(b"\0" * (shutil.disk_usage(mount).free - leave))


class Seen(keras.callbacks.Callback):
  """What the backup directory held when training began; batches run."""

  def __init__(self, directory: str):
    super().__init__()
    self._directory, self.at_start, self.batches = directory, None, 0

  def on_train_begin(self, logs=None):
    if self.at_start is None:
      self.at_start = sorted(os.listdir(self._directory))

  def on_train_batch_end(self, batch, logs=None):
    self.batches += 1


@pytest.mark.timeout(240)
class LaunchedFitTest(absltest.TestCase):

  def test_one_line_then_the_same_job_resumes_without_stale_saves(self):
    """tfdist.fit under ``tfdist launch`` fills 8 MB at its third backup:
    one tfdist: line naming the directory, the space free and ckpt-4, and
    nothing partial left. A save TensorFlow's writer then leaves half-done
    goes at the next start, before training; the user's files stay, and the
    job resumes from ckpt-4."""
    mount = _tmpfs(self)
    backup = os.path.join(mount, "backup")
    env = cluster_utils.base_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # As a user has it.
    r = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "--workers", "1", "--",
         sys.executable, os.path.join(cluster_utils.SCRIPTS, "disk_job.py"),
         backup], env=env, capture_output=True, text=True, timeout=180,
        cwd=cluster_utils.REPO)
    out = r.stdout + r.stderr
    self.assertEqual(r.returncode, 1, out)
    said = [l for l in out.splitlines() if l.startswith("tfdist: ")]
    self.assertLen(said, 1, out)
    free = shutil.disk_usage(mount).free
    self.assertEqual(
        said[0], "tfdist: task worker:0 exited with code 1: saving a "
        f"checkpoint in {backup} failed: No space left on device "
        f"({free / 1e6:.1f} MB free there); the last whole checkpoint, "
        f"{backup}/ckpt-4, is intact: make room and run the same command to "
        "resume from it")
    self.assertNotIn("Traceback", out)
    self.assertEqual(sorted(os.listdir(backup)), [
        "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index",
        "ckpt-4.data-00000-of-00001", "ckpt-4.index", ownership.OWNER_FILE])

    # A save cut short, as TensorFlow's own writer leaves it; the user's.
    big = tf.train.Checkpoint(v=tf.Variable(tf.zeros([MB])))
    with self.assertRaises(tf.errors.ResourceExhaustedError):
      big.write(os.path.join(backup, "ckpt-6"))
    self.assertTrue(os.path.isdir(os.path.join(backup, "ckpt-6_temp")))
    os.mkdir(os.path.join(backup, "ckpt-9_temp"))
    for name in ("notes.txt", "ckpt-9_temp/notes.txt"):
      with open(os.path.join(backup, name), "w") as f:
        f.write("the user's")

    _resize(mount, 32)
    model = disk_job.model()
    seen = Seen(backup)
    disk_job.fit(model, backup, callbacks=[seen])
    self.assertNotIn("ckpt-6_temp", seen.at_start)
    self.assertIn("ckpt-4.index", seen.at_start)
    self.assertEqual(seen.batches, disk_job.EPOCHS * disk_job.STEPS - 4)
    self.assertEqual(int(model.optimizer.iterations.numpy()),
                     disk_job.EPOCHS * disk_job.STEPS)
    self.assertEqual(sorted(os.listdir(backup)), ["ckpt-9_temp", "notes.txt"])
    self.assertEqual(os.listdir(os.path.join(backup, "ckpt-9_temp")),
                     ["notes.txt"])


class RunnerDiskFullTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("first_save", 0, None),
      ("after_a_checkpoint", 2, "ckpt-2"),
  )
  def test_disk_full_error_keeps_the_last_checkpoint(self, trained, last):
    """A Runner's save into a filled tmpfs: DiskFullError with the
    directory, the space free and the last checkpoint, which restores."""
    mount = _tmpfs(self)
    directory = os.path.join(mount, "ckpt")
    weights = tf.Variable(tf.zeros([750_000]))  # 3 MB a checkpoint.

    def step(batch):
      weights.assign_add(tf.ones_like(weights))
      return {"batch": tf.reduce_sum(batch)}

    runner = tfdist.Runner(
        strategy=tf.distribute.get_strategy(), train_step=step,
        train_data=lambda ctx: tf.data.Dataset.from_tensors(1.0).repeat(),
        checkpoint_items={"weights": weights},
        options=tfdist.RunnerOptions(checkpoint_dir=directory,
                                     checkpoint_every=2))
    self.addCleanup(runner.close)
    if trained:  # train(0) would save at step 0.
      runner.train(trained)
    _fill(mount, leave=MB)
    before = sorted(os.listdir(directory))
    with self.assertRaises(tfdist.DiskFullError) as caught:
      runner.train(trained + 2)
    e = caught.exception
    self.assertIsInstance(e, tfdist.CheckpointError)
    self.assertEqual((e.directory, e.free, e.reason),
                     (directory, shutil.disk_usage(mount).free,
                      "No space left on device"))
    self.assertEqual(e.last, last and os.path.join(directory, last))
    self.assertIn(f"({e.free / 1e6:.1f} MB free there)", str(e))
    self.assertEqual(e.code, f"tfdist: {e}")  # What Python prints, uncaught.
    self.assertEqual(sorted(os.listdir(directory)), before)
    if last:
      restored = tf.Variable(tf.zeros([750_000]))
      self.assertEqual(checkpoints.restore_latest(
          tf.train.Checkpoint(weights=restored), directory, strict=False),
                       e.last)
      np.testing.assert_array_equal(restored.numpy(), float(trained))


class RemovePartialTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("killed_mid_shard", "ckpt-7_temp",
       ["part-00000-of-00001.data-00000-of-00001.tempstate6780449712"], True),
      ("failed_save", "ckpt-7_temp", [], True),
      ("state_file_temporary", "checkpoint.tmp0a1bff", None, True),
      ("a_users_dir_of_that_name", "ckpt-7_temp", ["notes.txt"], False),
      ("a_users_file_of_that_name", "ckpt-7_temp", None, False),
      ("not_tensorflows_temporary", "checkpoint.tmp-mine", None, False),
      ("a_whole_checkpoint", "ckpt-7.index", None, False),
      ("another_name", "my_temp", [], False),
  )
  def test_the_next_start_removes_partial_saves_only(self, name, inside,
                                                     removed):
    """What a killed run left, at the next start (claiming the directory)."""
    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory)
    strategy = tf.distribute.get_strategy()
    owner = ownership.owner_of([], strategy)

    def start():
      ownership.claim(directory, owner, strategy=strategy,
                      field="checkpoint_dir", source="test")
    start()
    path = os.path.join(directory, name)
    if inside is None:
      with open(path, "w") as f:
        f.write("x")
    else:
      os.mkdir(path)
      for n in inside:
        with open(os.path.join(path, n), "w") as f:
          f.write("x")
    start()
    self.assertEqual(os.path.exists(path), not removed)


class LauncherLineTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("its_own_line", ["step 3", "tfdist: no space"], 1,
       "tfdist: task worker:0 exited with code 1: no space\n"),
      ("killed_after_its_line", ["tfdist: no space"], -9,
       "tfdist: task worker:0 was killed by signal 9: no space\n"),
      ("a_traceback", ["Traceback (most recent call last):", "OSError: x"], 1,
       "tfdist: task worker:0 exited with code 1; last lines of its output:\n"
       "  | Traceback (most recent call last):\n  | OSError: x\n"),
      ("its_line_then_more", ["tfdist: note: x", "OSError: y"], 1,
       "tfdist: task worker:0 exited with code 1; last lines of its output:\n"
       "  | tfdist: note: x\n  | OSError: y\n"),
  )
  def test_a_failed_task(self, tail, code, said):
    with tempfile.TemporaryFile("w+") as out:
      output.Console(out).failure("worker:0", code, tail)
      out.seek(0)
      self.assertEqual(out.read(), said)


if __name__ == "__main__":
  absltest.main()
