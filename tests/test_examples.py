"""Every example, a few steps, in every launch mode that runs here.

Modes: this machine alone, `tfdist launch` with 2 workers (and with a ps for
the parameter-server example), `srun` on the real local SLURM, and a TPU VM
command line, which stops at TPU system initialization (no TPU here).
"""

import functools
import os
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
import slurm_harness

EXAMPLES = os.path.join(cluster_utils.REPO, "examples")
FEW_STEPS = ["--epochs=1", "--steps_per_epoch=3", "--eval_steps=2",
             "--global_batch_size=16"]


def setUpModule():
  global DATA_DIR, _TMP
  _TMP = tempfile.TemporaryDirectory()
  DATA_DIR = os.path.join(_TMP.name, "tfds")


def tearDownModule():
  _SLURM.stop()
  _TMP.cleanup()


_SLURM = slurm_harness.SharedSlurm()


def _command(example, *flags):
  return [sys.executable, os.path.join(EXAMPLES, example), *FEW_STEPS,
          f"--data_dir={DATA_DIR}", *flags]


def _run(argv, timeout=300):
  result, _ = cluster_utils.run_alone(argv, env=cluster_utils.base_env(),
                                      cwd=cluster_utils.REPO, timeout=timeout)
  return result


@functools.cache
def _keras_fit_launch_with_model_dir():
  """keras_fit.py under `tfdist launch` with 2 workers and --model_dir: the
  result and what the model directory holds afterwards."""
  with tempfile.TemporaryDirectory() as model_dir:
    r = _run([sys.executable, "-m", "tfdist", "launch", "--workers", "2",
              "--", *_command("keras_fit.py", f"--model_dir={model_dir}")])
    return r, os.listdir(model_dir)


@pytest.mark.timeout(900)
class ExamplesTest(parameterized.TestCase):
  """Each example across processes, under `tfdist launch`."""

  @parameterized.named_parameters(
      ("keras_fit", "keras_fit.py", ["--workers", "2"]),
      ("custom_loop", "custom_loop.py", ["--workers", "2"]),
      ("parameter_server", "parameter_server.py", ["--workers", "2", "--ps",
                                                   "1"]),
  )
  def test_under_tfdist_launch(self, example, cluster):
    if example == "keras_fit.py":  # The run with --model_dir serves both.
      r, _ = _keras_fit_launch_with_model_dir()
    else:
      r = _run([sys.executable, "-m", "tfdist", "launch", *cluster, "--",
                *_command(example)])
    self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
    chief = "chief:0" if "--ps" in cluster else "worker:0"
    self.assertIn(f"[{chief}] final metrics:", r.stdout)
    self.assertEqual(r.stdout.count("final metrics:"), 1)  # Chief only.

  def test_keras_fit_with_model_dir_writes_tensorboard_on_the_chief(self):
    r, written = _keras_fit_launch_with_model_dir()
    self.assertEqual(r.returncode, 0, r.stdout[-3000:])
    self.assertEqual(written, ["tensorboard"])  # Backup gone.


@pytest.mark.timeout(300)
@pytest.mark.beside  # tests/conftest.py: one process a test.
class OnThisMachineTest(parameterized.TestCase):
  """Each example as one process (MirroredStrategy), as on Colab."""

  @parameterized.named_parameters(
      ("keras_fit", "keras_fit.py"),
      ("custom_loop", "custom_loop.py"),
  )
  def test_on_this_machine(self, example):
    r = _run(_command(example))
    self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    self.assertIn("final metrics:", r.stdout)
    self.assertIn("val_accuracy", r.stdout)

  def test_tpu_vm_command_stops_at_tpu_system_initialization(self):
    r = _run(_command("keras_fit.py", "--strategy=tpu", "--tpu=local"))
    self.assertEqual(r.returncode, 2, r.stderr[-3000:])
    last = r.stderr.strip().splitlines()[-1]
    self.assertStartsWith(last, "tfdist: ")
    self.assertIn("TPU system initialization failed", last)

  def test_bad_flag_is_one_line_exit_two(self):
    r = _run(_command("keras_fit.py", "--strategy=mirorred"))
    self.assertEqual(r.returncode, 2)
    self.assertTrue(r.stderr.strip().splitlines()[-1].startswith("tfdist: "))


@pytest.mark.timeout(600)
class ExamplesUnderSrunTest(parameterized.TestCase):

  def test_keras_fit_srun_two_tasks(self):
    r = _SLURM.get().srun(["-n", "2", *_command("keras_fit.py")],
                        env=cluster_utils.base_env(), timeout=400)
    self.assertEqual(r.returncode, 0, r.stdout[-2000:] + r.stderr[-3000:])
    self.assertEqual(r.stdout.count("final metrics:"), 1)


if __name__ == "__main__":
  absltest.main()
