"""Roles: who writes training state, and at most one evaluator.

The evaluator runs beside the training cluster and only reads its state:
`tfdist.is_chief` is False there, whatever strategy it builds, and a real
evaluator process training with a backup directory writes nothing into it.
A cluster with more than one evaluator is a ConfigError, however it comes.
"""

import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
import fault_runs
import tfdist
from tfdist import ClusterInfo
from tfdist.cluster import info as info_lib
from tfdist.cluster import slurm

_WORKERS = ("localhost:1", "localhost:2")
_EVALUATOR = ClusterInfo(source="explicit", cluster={"worker": _WORKERS},
                         task_type="evaluator", task_id=0)
_PS_EVALUATOR = ClusterInfo(
    source="explicit", cluster={"chief": ("localhost:3",), "worker": _WORKERS,
                                "ps": ("localhost:4",)},
    task_type="evaluator", task_id=0)
_LOCAL = ClusterInfo(source="local")


class WhoWritesTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # The default strategy is one object per process: give it back local.
    self.addCleanup(tfdist.make_strategy, "default", cluster=_LOCAL)

  @parameterized.named_parameters(
      ("auto", "auto", _EVALUATOR),
      ("default", "default", _EVALUATOR),
      # One process beside the cluster: a one-process strategy fits it.
      ("mirrored", "mirrored", _EVALUATOR),
      ("auto_beside_parameter_servers", "auto", _PS_EVALUATOR),
  )
  def test_evaluator_is_never_chief(self, name, cluster):
    strategy = tfdist.make_strategy(name, cluster=cluster)
    self.assertFalse(tfdist.is_chief(strategy))

  @parameterized.named_parameters(
      ("local", None, None, {}, True),
      ("chief", "chief", 0, {"chief": ["c:1"], "worker": ["w:1"]}, True),
      ("worker_0_without_chief", "worker", 0, {"worker": ["w:1"]}, True),
      ("worker_0_with_chief", "worker", 0, {"chief": ["c:1"],
                                            "worker": ["w:1"]}, False),
      ("worker_1", "worker", 1, {"worker": ["w:0", "w:1"]}, False),
      ("ps", "ps", 0, {"worker": ["w:1"], "ps": ["p:1"]}, False),
      ("evaluator", "evaluator", 0, {"worker": ["w:1"]}, False),
  )
  def test_the_one_rule(self, task_type, task_id, cluster, chief):
    self.assertEqual(info_lib.is_chief_task(task_type, task_id, cluster),
                     chief)
    if task_type is not None:
      self.assertEqual(ClusterInfo(source="explicit", cluster=cluster,
                                   task_type=task_type,
                                   task_id=task_id).is_chief, chief)

  def test_local_process_stays_chief(self):
    self.assertTrue(tfdist.is_chief(tfdist.make_strategy("default",
                                                         cluster=_LOCAL)))


class OneEvaluatorTest(parameterized.TestCase):
  """More than one evaluator is a ConfigError, whatever the source."""

  @parameterized.named_parameters(
      ("cluster_info_two", lambda: ClusterInfo(
          source="explicit", cluster={"worker": ["w:1"],
                                      "evaluator": ["e:1", "e:2"]}),
       "cluster.evaluator"),
      ("cluster_info_index_1", lambda: ClusterInfo(
          source="explicit", cluster={"worker": ["w:1"]},
          task_type="evaluator", task_id=1), "task_id"),
      ("slurm_roles_text", lambda: slurm.parse_roles(
          "worker=2,evaluator=2"), "roles"),
      ("slurm_roles_mapping", lambda: slurm.resolve_slurm(
          {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
           "SLURM_STEP_NODELIST": "n[1-4]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x4)"},
          roles={"worker": 2, "evaluator": 2}), "roles['evaluator']"),
      ("tf_config_evaluator_index_1", lambda: tfdist.resolve_cluster(
          {"cluster": {"worker": ["w:1"]},
           "task": {"type": "evaluator", "index": 1}}), "TF_CONFIG task.index"),
  )
  def test_config_error(self, make, field):
    with self.assertRaises(tfdist.ConfigError) as caught:
      make()
    self.assertEqual(caught.exception.field, field)
    self.assertIn("evaluator", str(caught.exception))


@pytest.mark.timeout(240)
class EvaluatorProcessTest(absltest.TestCase):

  def test_evaluator_writes_no_training_state(self):
    """An evaluator that runs the training script with a backup directory."""
    config = cluster_utils.worker_configs(2)[0]
    config["task"] = {"type": "evaluator", "index": 0}
    with tempfile.TemporaryDirectory() as d:
      backup = os.path.join(d, "b")
      with cluster_utils.Tasks.of_script(
          fault_runs.JOB, [config], args=["auto", "fit", backup]) as tasks:
        tasks.wait_for(0, "step 5", 180)  # Backups are due every 2 steps.
        written = os.listdir(backup) if os.path.exists(backup) else []
        code = tasks.wait(0, 120)
        err = tasks.stderr(0)
      self.assertEqual(code, 0, cluster_utils.tail(err))
      self.assertEqual(written, [], json.dumps(config))


if __name__ == "__main__":
  absltest.main()
