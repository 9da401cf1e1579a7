"""A backup directory belongs to one job, and resume never silently fails.

Real files and real signals, in this process (a preemption is a real SIGTERM
sent to it mid-fit) and on a real 2-worker cluster: relative directories
resume, another job's directory or a directory of other files is refused
before anything is written, what tfdist did not write is never removed, the
workers agree on the restored position, and counts that would never end an
epoch fail at once.
"""

import json
import os
import shutil
import signal
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
from tfdist.training import ownership

X, Y = np.ones((16, 2), "float32"), np.ones((16, 1), "float32")
STEPS = 4  # Steps per epoch with batches of 4.


def _model(width: int = 1, *, activation: str | None = None,
           rate: float | None = None, optimizer: str = "SGD",
           layer: type[keras.layers.Layer] | None = None) -> keras.Model:
  """A Dense model; ``rate`` adds Dropout, ``layer`` one more layer."""
  layers = [keras.Input((2,)), keras.layers.Dense(
      width, activation=activation, kernel_initializer="ones")]
  if rate is not None:
    layers.append(keras.layers.Dropout(rate))
  if layer is not None:
    layers.append(layer())
  model = keras.Sequential(layers)
  model.compile(optimizer=getattr(keras.optimizers, optimizer)(0.01),
                loss="mse")
  return model


class Scale(keras.layers.Layer):
  """A custom layer that cannot give its configuration: Keras cannot
  serialize its argument, and it has no get_config of its own."""

  def __init__(self, fn=lambda x: 2 * x, **kwargs):
    super().__init__(**kwargs)
    self.fn = fn

  def call(self, x):
    return self.fn(x)


class SignalAt(keras.callbacks.Callback):
  """Sends this process a real SIGTERM once ``step`` steps are applied."""

  def __init__(self, step: int):
    super().__init__()
    self._step = step

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) == self._step:
      os.kill(os.getpid(), signal.SIGTERM)


class WriteAt(keras.callbacks.Callback):
  """Writes a file of the user's at a step, as another program might."""

  def __init__(self, step: int, path: str):
    super().__init__()
    self._step, self._path = step, path

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) == self._step:
      with open(self._path, "w") as f:
        f.write("the user's")


def _fit(model, **kwargs):
  kwargs = {"batch_size": 4, "epochs": 2, "verbose": 0, **kwargs}
  return tfdist.fit(model, X, Y, **kwargs)


def _preempt(backup_dir, at=3, **model):
  """A run of ``_model(**model)`` SIGTERMed after ``at`` steps; it backs up
  every step."""
  with pytest.raises(tfdist.PreemptedError):
    _fit(_model(**model), backup_dir=backup_dir, backup_every_steps=1,
         callbacks=[SignalAt(at)])


def _tree(root):
  """Every file under ``root`` with its bytes."""
  out = {}
  for parent, _, files in os.walk(root):
    for name in files:
      path = os.path.join(parent, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


@pytest.mark.beside  # In this process.
@pytest.mark.timeout(300)
class BackupDirTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)
    cwd = os.getcwd()
    os.chdir(self.dir)
    self.addCleanup(os.chdir, cwd)

  def test_relative_backup_dir_resumes(self):
    _preempt("bk")
    self.assertIn("ckpt-3.index", os.listdir("bk"))
    model = _model()
    _fit(model, backup_dir="bk")
    self.assertEqual(int(model.optimizer.iterations.numpy()), 2 * STEPS)
    self.assertFalse(os.path.exists("bk"), "backup kept after success")

  def test_relative_runner_checkpoint_dir_resumes(self):
    def runner():
      model = _model()
      optimizer = keras.optimizers.SGD(0.01)
      optimizer.build(model.trainable_variables)
      step = tfdist.supervised_step(model, optimizer,
                                    keras.losses.MeanSquaredError(
                                        reduction=None),
                                    global_batch_size=4)
      return tfdist.Runner(
          strategy=tf.distribute.get_strategy(), train_step=step,
          train_data=lambda ctx: tf.data.Dataset.from_tensor_slices(
              (X, Y)).repeat().batch(4),
          checkpoint_items={"model": model, "optimizer": optimizer},
          options=tfdist.RunnerOptions(checkpoint_dir="ck"))
    first = runner()
    first.train(3)
    first.close()
    second = runner()
    second.close()
    self.assertEqual(second.step, 3)

  def test_another_jobs_backup_is_refused_untouched(self):
    _preempt("bk", width=1)
    before = _tree(self.dir)
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(_model(width=3), backup_dir="bk")
    self.assertEqual(caught.exception.field, "backup_dir")
    self.assertIn("another job", str(caught.exception))
    self.assertIn("delete", str(caught.exception))
    self.assertEqual(_tree(self.dir), before)

  @parameterized.named_parameters(
      # Same variables, another model: each was resumed as this job's before.
      ("activation", {"activation": "relu"}, {"activation": "tanh"},
       "layer `dense",
       "activation `tanh` here, `relu` in the backup"),
      ("dropout_rate", {"rate": 0.1}, {"rate": 0.5}, "layer `dropout",
       "rate `0.5` here, `0.1` in the backup"),
      ("optimizer", {}, {"optimizer": "Adam"}, "optimizer",
       "Adam here, SGD in the backup"),
      ("a_layer_more", {}, {"rate": 0.1}, "layers",
       "3 layers here, 2 in the backup"),
      ("another_class", {"layer": keras.layers.ReLU},
       {"layer": keras.layers.Softmax}, "(3 of 3)",
       "a Softmax here, a ReLU in the backup"),
  )
  def test_another_architecture_is_refused_naming_the_difference(
      self, saved, here, where, difference):
    """Two jobs, one backup_dir: job B resumed job A's step and removed it."""
    _preempt("bk", **saved)
    before = _tree(self.dir)
    model = _model(**here)
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(model, backup_dir="bk")
    self.assertEqual(caught.exception.field, "backup_dir")
    self.assertIn(where, str(caught.exception))
    self.assertIn(difference, str(caught.exception))
    self.assertIn("another job", str(caught.exception))
    self.assertEqual(int(model.optimizer.iterations.numpy()), 0)
    self.assertEqual(_tree(self.dir), before)
    # Job A's own relaunch still resumes at its step, and trains the rest.
    model = _model(**saved)
    _fit(model, backup_dir="bk")
    self.assertEqual(int(model.optimizer.iterations.numpy()), 2 * STEPS)

  def test_a_layer_without_configuration_is_known_by_its_class(self):
    with self.assertLogs(level="WARNING") as logs:
      _preempt("bk", layer=Scale)
    said = [r.getMessage() for r in logs.records if "`scale" in
            r.getMessage()]
    self.assertLen(said, 1, logs.output)
    self.assertIn("no configuration", said[0])
    model = _model(layer=Scale)
    _fit(model, backup_dir="bk")
    self.assertEqual(int(model.optimizer.iterations.numpy()), 2 * STEPS)
    _preempt("other", layer=Scale)
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(_model(layer=keras.layers.ReLU), backup_dir="other")
    self.assertIn("a ReLU here, a Scale in the backup",
                  str(caught.exception))

  def test_an_older_record_of_variables_only_still_resumes(self):
    _preempt("bk")
    path = os.path.join("bk", ownership.OWNER_FILE)
    with open(path) as f:
      record = json.load(f)
    for key in ("layers", "optimizers"):  # As tfdist 0.x wrote it.
      del record[key]
    with open(path, "w") as f:
      json.dump(record, f)
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(_model(width=3), backup_dir="bk")
    self.assertIn("variables", str(caught.exception))
    model = _model(activation="tanh")  # Not recorded: not compared.
    _fit(model, backup_dir="bk")
    self.assertEqual(int(model.optimizer.iterations.numpy()), 2 * STEPS)

  def test_directory_of_other_files_is_refused_untouched(self):
    os.mkdir("results")
    with open(os.path.join("results", "notes.txt"), "w") as f:
      f.write("mine")
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(_model(), backup_dir="results")
    self.assertIn(ownership.OWNER_FILE, str(caught.exception))
    self.assertEqual(_tree(self.dir), {"results/notes.txt": b"mine"})

  def test_what_others_write_there_is_kept(self):
    os.mkdir("bk")  # The user's directory: it stays, and so does their file.
    model = _model()
    _fit(model, backup_dir="bk", backup_every_steps=1,
         callbacks=[WriteAt(2, os.path.join("bk", "user.txt"))])
    self.assertEqual(int(model.optimizer.iterations.numpy()), 2 * STEPS)
    self.assertEqual(_tree(self.dir), {"bk/user.txt": b"the user's"})

  def test_unwritable_backup_dir_fails_before_training(self):
    with open("a_file", "w") as f:
      f.write("x")
    model = _model()
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(model, backup_dir=os.path.join("a_file", "bk"))
    self.assertIn("chief can create and write", str(caught.exception))
    self.assertEqual(int(model.optimizer.iterations.numpy()), 0)
    self.assertEqual(_tree(self.dir), {"a_file": b"x"})

  @parameterized.named_parameters(("fewer", 2), ("as_many", 3))
  def test_resume_with_steps_per_epoch_not_above_saved_step(self, steps):
    _preempt("bk", at=3)  # Saved 3 steps into epoch 0.
    before = _tree(self.dir)
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(_model(), backup_dir="bk", steps_per_epoch=steps)
    self.assertEqual(caught.exception.field, "steps_per_epoch")
    self.assertEqual(caught.exception.value, steps)
    self.assertIn("more than 3", str(caught.exception))
    self.assertEqual(_tree(self.dir), before)

  def test_endless_epoch_fails_before_a_signal_could_save_it(self):
    """steps_per_epoch=-1 trained forever; SIGTERM then saved step -1."""
    with self.assertRaises(tfdist.ConfigError) as caught:
      _fit(_model(), backup_dir="bk", steps_per_epoch=-1,
           callbacks=[SignalAt(5)])
    self.assertEqual(caught.exception.field, "steps_per_epoch")
    self.assertEqual(os.listdir(self.dir), [])


def _dead_pid() -> int:
  process = subprocess.Popen([sys.executable, "-c", "pass"])
  process.wait()
  return process.pid


@pytest.mark.timeout(600)
class BackupDirClusterTest(absltest.TestCase):
  """Two real MultiWorkerMirrored workers."""

  def test_workers_agree_on_the_restored_step_and_spare_others_dirs(self):
    with tempfile.TemporaryDirectory() as d:
      # Looks like a killed worker's directory; tfdist did not make it.
      stranger = os.path.join(d, f"tfdist-worker-1-{_dead_pid()}-abc")
      os.mkdir(stranger)
      with open(os.path.join(stranger, "keep"), "w") as f:
        f.write("keep")
      args = ["multi_worker_mirrored", "--every", "2"]
      killed = cluster_utils.run_cluster(
          "fit_job.py", cluster_utils.worker_configs(2),
          args=[*args, "--backup", os.path.join(d, "bk"), "--die-at", "9"],
          timeout=240, env={"TMPDIR": d})
      self.assertEqual([r.returncode for r in killed], [3, 3],
                       "\n".join(r.stderr[-2000:] for r in killed))
      self.assertTrue(os.path.isfile(os.path.join(stranger, "keep")))
      # Worker 0 finds the backup (bk0), worker 1 an empty directory (bk1):
      # training on would run different steps; both stop at once instead.
      os.rename(os.path.join(d, "bk"), os.path.join(d, "bk0"))
      before = _tree(os.path.join(d, "bk0"))
      split = cluster_utils.run_cluster(
          "fit_job.py", cluster_utils.worker_configs(2),
          args=[*args, "--backup", os.path.join(d, "bk{task}")],
          timeout=240, env={"TMPDIR": d})
      for r in split:
        self.assertEqual(r.returncode, 1, r.stderr[-3000:])
        self.assertIn("same saved position on every worker", r.stderr)
        self.assertIn("restored nothing, position [1, 2]", r.stderr)
      self.assertEqual(_tree(os.path.join(d, "bk0")), before)
      self.assertFalse(os.path.exists(os.path.join(d, "bk1")))


if __name__ == "__main__":
  absltest.main()
