"""A Model Garden-style script runs on tfdist with Model Garden's flags."""

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.


@pytest.mark.timeout(300)
class ModelGardenScriptTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("mirrored_all_gpus_packs_bf16",
       ["--distribution_strategy=mirrored", "--num_gpus=-1",
        "--all_reduce_alg=hierarchical_copy", "--num_packs=2", "--dtype=bf16",
        "--batch_size=16", "--train_epochs=2"],
       {"mirrored": True, "policy": "mixed_bfloat16",
        "epochs": 2, "batch_size": 16}),
      ("off_fp16_fixed_loss_scale",
       ["--distribution_strategy=off", "--dtype=fp16", "--loss_scale=256",
        "--batch_size=32", "--train_epochs=1"],
       {"mirrored": False, "policy": "mixed_float16", "epochs": 1, "batch_size": 32,
        "optimizer": "LossScaleOptimizer"}),
  )
  def test_model_garden_flags_train(self, args, expected):
    result = cluster_utils.run_script("model_garden_style.py", args=args,
                                      timeout=240)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertDictContainsSubset(expected, result.json())

  @parameterized.named_parameters(
      ("dtype_unknown", ["--dtype=fp64"], "--dtype"),
      ("loss_scale_not_a_number", ["--dtype=fp16", "--loss_scale=big"],
       "--loss_scale"),
      ("mirrored_all_reduce_of_multi_worker",
       ["--distribution_strategy=mirrored", "--num_gpus=0",
        "--all_reduce_alg=ring"], "--all_reduce_alg=ring does not apply"),
      ("task_index_unset_with_two_hosts",
       ["--worker_hosts=127.0.0.1:1,127.0.0.1:2", "--task_index=-1"],
       "--task_index"),
  )
  def test_bad_model_garden_flags_exit_2_with_one_line(self, args, flag):
    result = cluster_utils.run_script("model_garden_style.py", args=args,
                                      timeout=120)
    self.assertEqual(result.returncode, 2, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    self.assertLen(lines, 1, result.stderr)
    self.assertTrue(lines[0].startswith("tfdist: "), lines[0])
    self.assertIn(flag, lines[0])


#: Model Garden's defaults (official/utils/flags), with no GPU: what its
#: scripts pass when nothing else is said.
_DEFAULTS = ["--num_packs=1", "--tpu=", "--task_index=-1", "--dtype=fp32",
             "--num_gpus=0"]


@pytest.mark.timeout(600)
class ModelGardenDefaultsTest(parameterized.TestCase):
  """Every strategy name of Model Garden's ``get_distribution_strategy``,
  with Model Garden's flag defaults: it trains, or (a cluster or a TPU that
  is not here) ends in one ``tfdist: `` line, exit 2. What Model Garden
  ignores is ignored too, in one ``tfdist: note:`` line each."""

  def _run(self, args):
    result = cluster_utils.run_script("model_garden_style.py", args=args,
                                      timeout=240)
    said = [l for l in result.stderr.splitlines() if l.startswith("tfdist: ")]
    return result, said

  def test_no_flags_at_all(self):
    result, said = self._run([])
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertEqual(said, [])
    self.assertEqual(result.json()["epochs"], 3)

  @parameterized.named_parameters(
      ("off", "off", 0, [], "mirrored", False),
      ("one_device", "one_device", 0, [], "mirrored", False),
      ("mirrored", "mirrored", 0, [], "mirrored", True),
      ("multi_worker_mirrored", "multi_worker_mirrored", 0,
       ["--num_gpus=0 is ignored by --strategy=multi_worker_mirrored"],
       "mirrored", False),
      ("parameter_server", "parameter_server", 2,
       ["--num_gpus=0 is ignored by --strategy=parameter_server"],
       "cluster.ps", None),
      ("tpu", "tpu", 2, ["--num_gpus=0 is ignored by --strategy=tpu"],
       "tpu='local'", None),
  )
  def test_each_strategy_name_at_the_defaults(self, name, code, notes, key,
                                              value):
    result, said = self._run([f"--distribution_strategy={name}", *_DEFAULTS])
    self.assertEqual(result.returncode, code, result.stderr[-3000:])
    self.assertEqual([l for l in said if l.startswith("tfdist: note: ")],
                     [f"tfdist: note: {n}, as in Model Garden" for n in notes])
    if code == 0:
      self.assertEqual(result.json()[key], value)
    else:
      errors = [l for l in said if not l.startswith("tfdist: note: ")]
      self.assertLen(errors, 1, result.stderr)
      self.assertIn(key, errors[0])

  def test_values_model_garden_ignores_are_ignored_with_a_note(self):
    result, said = self._run([
        "--distribution_strategy=off", "--num_packs=2",
        "--all_reduce_alg=nccl", "--tpu=my-tpu", "--loss_scale=dynamic"])
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertEqual(said, [
        f"tfdist: note: {flag} is ignored by --strategy=off{why}, as in "
        "Model Garden" for flag, why in (
            ("--all_reduce_alg=nccl", ""), ("--num_packs=2", ""),
            ("--tpu='my-tpu'", ""),
            ("--loss_scale=dynamic", " (it applies to fp16 only)"))])


if __name__ == "__main__":
  absltest.main()
