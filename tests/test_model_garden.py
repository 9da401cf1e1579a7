"""A Model Garden-style script runs on tfdist with Model Garden's flags."""

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils


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
      ("loss_scale_without_fp16", ["--loss_scale=dynamic"], "--loss_scale"),
      ("dtype_unknown", ["--dtype=fp64"], "--dtype"),
      ("packs_without_alg", ["--distribution_strategy=mirrored",
                             "--num_packs=2"], "--num_packs"),
  )
  def test_bad_model_garden_flags_exit_2_with_one_line(self, args, flag):
    result = cluster_utils.run_script("model_garden_style.py", args=args,
                                      timeout=120)
    self.assertEqual(result.returncode, 2, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    self.assertLen(lines, 1, result.stderr)
    self.assertTrue(lines[0].startswith("tfdist: "), lines[0])
    self.assertIn(flag, lines[0])


if __name__ == "__main__":
  absltest.main()
