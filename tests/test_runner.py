"""The custom-loop Runner on real strategies and clusters.

N-replica training with global batch B must match one device with batch B
(fp32, within 1e-5) under Mirrored, CentralStorage, MultiWorkerMirrored
(2 processes) and ParameterServer (synchronous schedule).
"""

import functools
import glob
import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

import cluster_utils
import tfdist

STEPS = 6
TOLERANCE = 1e-5


#: runner_job.py's arguments for the one-device reference run.
REFERENCE = ["default", str(STEPS)]

#: name, runner_job.py's arguments, replicas. The rows without ``--ps-local``
#: share one process (`_shared_runs`), with the reference.
MATCHES = (
    ("mirrored_two_replicas", ["mirrored", "--devices", "/cpu:0,/cpu:1"], 2),
    ("central_storage_two_replicas",
     ["central_storage", "--devices", "/cpu:0,/cpu:1"], 2),
    ("parameter_server_synchronous", ["parameter_server", "--ps-local",
                                      "1"], 1),
    ("steps_per_loop_one", ["mirrored", "--devices", "/cpu:0,/cpu:1",
                            "--steps-per-loop", "1"], 2),
)


def _argv(args):
  return [args[0], str(STEPS), *args[1:]]


@functools.cache
def _shared_runs():
  """One runner_job.py process: the reference, then each row of `MATCHES`
  without ``--ps-local`` (a strategy and model of its own each); its JSON
  lines by row name, the reference's as "reference"."""
  names = ["reference"] + [n for n, args, _ in MATCHES
                           if "--ps-local" not in args]
  argv = list(REFERENCE)
  for name, args, _ in MATCHES:
    if name in names:
      argv += ["+", *_argv(args)]
  result = cluster_utils.run_script("runner_job.py", args=argv, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [json.loads(l) for l in result.stdout.splitlines()
           if l.startswith("{")]
  assert len(lines) == len(names), result.stdout
  return dict(zip(names, lines))


def _reference():
  return np.array(_shared_runs()["reference"]["weights"])


@pytest.mark.timeout(300)
class RunnerCorrectnessTest(parameterized.TestCase):

  @parameterized.named_parameters(*MATCHES)
  def test_matches_single_device(self, args, replicas):
    if "--ps-local" in args:
      result = cluster_utils.run_script("runner_job.py", args=_argv(args))
      self.assertEqual(result.returncode, 0, result.stderr[-3000:])
      out = result.json()
    else:
      out = _shared_runs()[self._testMethodName.split("_", 4)[-1]]
    self.assertEqual(out["replicas"], replicas)
    self.assertEqual(out["step"], STEPS)
    np.testing.assert_allclose(out["weights"], _reference(), atol=TOLERANCE)

  def test_multi_worker_mirrored_two_processes(self):
    with tempfile.TemporaryDirectory() as d:
      ckpt, summary = os.path.join(d, "ckpt"), os.path.join(d, "tb")
      results = cluster_utils.run_cluster(
          "runner_job.py", cluster_utils.worker_configs(2),
          args=["multi_worker_mirrored", str(STEPS), "--ckpt", ckpt,
                "--summary", summary], timeout=240,
          env={"TMPDIR": d})
      for r in results:
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
      outs = [r.json() for r in results]
      for out in outs:
        self.assertEqual(out["replicas"], 2)
        np.testing.assert_allclose(out["weights"], _reference(),
                                   atol=TOLERANCE)
      # Only the chief wrote: one event file, checkpoints at 3 and 6, and no
      # worker temp directory left behind.
      self.assertLen(glob.glob(os.path.join(summary, "events.*")), 1)
      self.assertEqual(tf.train.latest_checkpoint(ckpt),
                       os.path.join(ckpt, f"ckpt-{STEPS}"))
      self.assertEqual(sorted(os.listdir(d)), ["ckpt", "tb"])


@pytest.mark.beside
@pytest.mark.timeout(300)
class RunnerResumeTest(absltest.TestCase):

  def test_resume_continues_at_saved_step_and_position(self):
    with tempfile.TemporaryDirectory() as d:
      args = ["mirrored", "--devices", "/cpu:0,/cpu:1", "--ckpt", d]
      first = cluster_utils.run_script("runner_job.py", args=[args[0], "4", *args[1:]])
      self.assertEqual(first.returncode, 0, first.stderr[-3000:])
      second = cluster_utils.run_script("runner_job.py", args=_argv(args))
      self.assertEqual(second.returncode, 0, second.stderr[-3000:])
      self.assertEqual(second.json()["start_step"], 4)
      self.assertEqual(second.json()["step"], STEPS)
      # The uninterrupted run: the reference.
      np.testing.assert_allclose(second.json()["weights"], _reference(),
                                 atol=TOLERANCE)


@pytest.mark.beside
class RunnerInProcessTest(parameterized.TestCase):

  def _model_and_step(self, strategy, global_batch):
    with strategy.scope():
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      optimizer = keras.optimizers.SGD(0.1)
      metric = keras.metrics.Mean(name="seen")
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def eval_step(batch):
      x, y = batch
      loss = tfdist.scaled_loss(loss_fn(y, model(x)), global_batch)
      metric.update_state(tf.ones(tf.shape(x)[0]))
      return {"loss": loss}
    step = tfdist.supervised_step(model, optimizer, loss_fn,
                                  global_batch_size=global_batch)
    return model, optimizer, metric, step, eval_step

  def test_train_and_evaluate_under_mirrored(self):
    strategy = tfdist.make_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    model, optimizer, metric, step, eval_step = self._model_and_step(strategy, 4)

    def data(ctx):
      return tf.data.Dataset.from_tensors(
          (tf.ones((3,)), tf.ones((1,)))).repeat().batch(
              ctx.get_per_replica_batch_size(4))
    runner = tfdist.Runner(
        strategy=strategy, train_step=step, train_data=data,
        eval_step=eval_step, eval_data=data, metrics=[metric],
        options=tfdist.RunnerOptions(steps_per_loop=3))
    logs = runner.train(7)
    self.assertEqual(runner.step, 7)
    self.assertEqual(int(optimizer.iterations.numpy()), 7)
    self.assertIn("loss", logs)
    eval_logs = runner.evaluate(5)
    self.assertEqual(eval_logs["seen"], 1.0)
    self.assertGreaterEqual(eval_logs["loss"], 0.0)

  @parameterized.named_parameters(
      ("steps_per_loop_zero", {"steps_per_loop": 0}, "steps_per_loop"),
      ("checkpoint_every_negative", {"checkpoint_every": -1},
       "checkpoint_every"),
      ("max_to_keep_bool", {"max_to_keep": True}, "max_to_keep"),
  )
  def test_bad_options(self, kwargs, field):
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.RunnerOptions(**kwargs)
    self.assertEqual(caught.exception.field, field)

  def test_supervised_step_builds_the_optimizer_outside_the_step(self):
    strategy = tfdist.make_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
    _, optimizer, _, _, _ = self._model_and_step(strategy, 4)
    self.assertTrue(optimizer.built)

  def test_supervised_step_needs_a_built_model(self):
    model = keras.Sequential([keras.layers.Dense(1)])  # No Input: no weights.
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.supervised_step(model, keras.optimizers.SGD(), lambda y, p: y,
                             global_batch_size=2)
    self.assertEqual(caught.exception.field, "model")

  def test_plain_dataset_is_rejected_with_a_hint(self):
    strategy = tf.distribute.get_strategy()
    with self.assertRaisesRegex(tfdist.ConfigError, "input_context"):
      tfdist.Runner(strategy=strategy, train_step=lambda b: {},
                    train_data=tf.data.Dataset.range(3))

  @parameterized.named_parameters(
      ("numpy", lambda ctx: np.ones((4, 3))),
      ("none", lambda ctx: None),
  )
  def test_train_data_that_returns_no_dataset(self, train_data):
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.Runner(strategy=tf.distribute.get_strategy(),
                    train_step=lambda b: {}, train_data=train_data)
    self.assertEqual(caught.exception.field, "train_data")
    self.assertIn("returns a tf.data.Dataset", str(caught.exception))

  def test_evaluate_without_eval_step(self):
    strategy = tf.distribute.get_strategy()
    runner = tfdist.Runner(
        strategy=strategy, train_step=lambda b: {"x": tf.constant(1.0)},
        train_data=lambda ctx: tf.data.Dataset.range(3).repeat())
    with self.assertRaises(tfdist.ConfigError):
      runner.evaluate(1)


if __name__ == "__main__":
  absltest.main()
