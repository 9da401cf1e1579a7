"""The documented precedence: explicit > TF_CONFIG > SLURM > TPU > local."""

import json

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import tfdist
from tfdist.cluster import resolve
from tfdist.cluster import tpu

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.

TF_CONFIG = json.dumps({"cluster": {"worker": ["127.0.0.1:2000", "127.0.0.1:2001"]},
                        "task": {"type": "worker", "index": 1}})
SLURM_STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "n1",
    "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "n1",
    "SLURM_JOB_NODELIST": "n1", "SLURM_NODELIST": "n1",
    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
    "SLURM_DISTRIBUTION": "block", "SLURM_CPUS_ON_NODE": "2",
}
SLURM_BATCH = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n1",
               "SLURM_NODELIST": "n1", "SLURM_NNODES": "1"}
EXPLICIT = {"cluster": {"worker": ["127.0.0.1:3000"]},
            "task": {"type": "worker", "index": 0}}


class PrecedenceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("explicit_beats_everything", EXPLICIT,
       {"TF_CONFIG": TF_CONFIG, **SLURM_STEP, "TPU_NAME": "t"}, "explicit"),
      ("tf_config_beats_slurm_and_tpu", None,
       {"TF_CONFIG": TF_CONFIG, **SLURM_STEP, "TPU_NAME": "t"}, "tf_config"),
      ("slurm_beats_tpu", None, {**SLURM_STEP, "TPU_NAME": "t"}, "slurm"),
      ("tpu_beats_local", None, {"TPU_ACCELERATOR_TYPE": "v2-8"}, "tpu"),
      ("local_when_nothing", None, {}, "local"),
      ("batch_script_is_local", None, SLURM_BATCH, "local"),
      ("json_text_is_explicit", json.dumps(EXPLICIT), {}, "explicit"),
  )
  def test_source(self, cluster, environ, expected):
    info = tfdist.resolve_cluster(cluster, environ=environ)
    self.assertEqual(info.source, expected)

  def test_tf_config_fields(self):
    info = tfdist.resolve_cluster(environ={"TF_CONFIG": TF_CONFIG})
    self.assertEqual((info.task_type, info.task_id), ("worker", 1))
    self.assertEqual(info.address, "127.0.0.1:2001")
    self.assertFalse(info.is_chief)
    self.assertEqual(info.num_workers, 2)

  @parameterized.named_parameters(
      ("from_environment", {"TFDIST_SLURM_ROLES": "chief=1,worker=1"}, None,
       "worker", 0),
      ("argument_wins", {"TFDIST_SLURM_ROLES": "chief=1,worker=1"},
       {"worker": 2}, "worker", 1),
      ("default_all_workers", {}, None, "worker", 1),
  )
  def test_slurm_roles(self, extra, roles, task_type, task_id):
    info = tfdist.resolve_cluster(environ={**SLURM_STEP, **extra},
                                  slurm_roles=roles)
    self.assertEqual((info.task_type, info.task_id), (task_type, task_id))

  def test_bad_slurm_roles_variable(self):
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.resolve_cluster(environ={**SLURM_STEP,
                                      "TFDIST_SLURM_ROLES": "boss=2"})
    self.assertEqual(caught.exception.field, "TFDIST_SLURM_ROLES")

  def test_explicit_tpu_argument(self):
    info = tfdist.resolve_cluster(tpu="local", environ={"TF_CONFIG": TF_CONFIG})
    self.assertEqual((info.source, info.tpu), ("tpu", "local"))

  def test_cluster_info_passes_through(self):
    info = tfdist.ClusterInfo(source="local")
    self.assertIs(tfdist.resolve_cluster(info), info)

  @parameterized.named_parameters(
      ("forced_slurm_outside_step", "slurm", SLURM_BATCH),
      ("forced_slurm_no_slurm", "slurm", {}),
      ("forced_tf_config_missing", "tf_config", {}),
      ("forced_tpu_missing", "tpu", {}),
      ("unknown_source", "yarn", {}),
  )
  def test_forced_source_absent_is_an_error(self, source, environ):
    with self.assertRaises(tfdist.ConfigError):
      tfdist.resolve_cluster(source=source, environ=environ)

  @parameterized.named_parameters(
      ("empty_tf_config", {"TF_CONFIG": ""}),
      ("bad_json", {"TF_CONFIG": "{"}),
  )
  def test_bad_tf_config_is_never_skipped(self, environ):
    with self.assertRaises(tfdist.ConfigError):
      tfdist.resolve_cluster(environ=environ)

  def test_bad_cluster_argument_type(self):
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.resolve_cluster(42)
    self.assertEqual(caught.exception.field, "cluster")

  def test_environment_is_not_written(self):
    environ = dict(SLURM_STEP)
    before = dict(environ)
    tfdist.resolve_cluster(environ=environ)
    self.assertEqual(environ, before)


class TpuDetectionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("colab_tpu_node", {"COLAB_TPU_ADDR": "10.0.0.2:8470"}, (),
       "grpc://10.0.0.2:8470"),
      ("tpu_name", {"TPU_NAME": "my-tpu"}, (), "my-tpu"),
      ("tpu_name_local", {"TPU_NAME": "local"}, (), "local"),
      ("kaggle_or_cloud_vm", {"TPU_ACCELERATOR_TYPE": "v3-8"}, (), "local"),
      ("colab_vm", {"COLAB_TPU_1VM": "1"}, (), "local"),
      ("accel_device_file", {}, ("/dev/accel0",), "local"),
      ("vfio_device_file", {}, ("/dev/vfio/0",), "local"),
      ("nothing", {}, (), None),
  )
  def test_detect(self, environ, files, expected):
    found = tpu.detect_tpu(environ, exists=lambda p: p in files)
    self.assertEqual(found[0] if found else None, expected)

  @parameterized.named_parameters(
      ("local", "local", "local"),
      ("name", "my-tpu-1", "my-tpu-1"),
      ("grpc", "grpc://10.1.2.3:8470", "grpc://10.1.2.3:8470"),
      ("host_port", "10.1.2.3:8470", "grpc://10.1.2.3:8470"),
  )
  def test_normalize(self, value, expected):
    self.assertEqual(tpu.normalize_tpu(value), expected)

  @parameterized.named_parameters(
      ("empty", ""), ("spaces", "my tpu"), ("http", "http://h:1"),
      ("grpc_no_port", "grpc://host"), ("upper", "MyTPU"))
  def test_normalize_rejects(self, value):
    with self.assertRaises(tfdist.ConfigError) as caught:
      tpu.normalize_tpu(value)
    self.assertEqual(caught.exception.field, "tpu")


class ResolverTest(absltest.TestCase):

  def test_static_resolver_serves_tf(self):
    info = tfdist.resolve_cluster(environ={"TF_CONFIG": TF_CONFIG})
    resolver = tfdist.resolver_for(info)
    self.assertEqual(resolver.cluster_spec().as_dict(),
                     {"worker": ["127.0.0.1:2000", "127.0.0.1:2001"]})
    self.assertEqual(resolver.master(), "grpc://127.0.0.1:2001")
    self.assertEqual((resolver.task_type, resolver.task_id), ("worker", 1))
    self.assertEqual(resolver.num_accelerators(), {})

  def test_describe(self):
    info = tfdist.resolve_cluster(environ={"TF_CONFIG": TF_CONFIG})
    self.assertIn("2 worker", resolve.describe(info))


if __name__ == "__main__":
  absltest.main()
