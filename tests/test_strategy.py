"""The strategy factory, with every strategy but TPU built for real."""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import pytest
import tensorflow as tf

import tfdist
from tfdist import ClusterInfo
import cluster_utils

LOCAL = ClusterInfo(source="local")
TWO_WORKERS = ClusterInfo(
    source="tf_config", origin="test",
    cluster={"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
    task_type="worker", task_id=0)
PS_CLUSTER = ClusterInfo(
    source="tf_config", origin="test",
    cluster={"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
             "ps": ["127.0.0.1:3"]},
    task_type="chief", task_id=0)
TPU = ClusterInfo(source="tpu", tpu="local", origin="TPU_NAME is set")


def _replica_sum(strategy):
  def value():
    ctx = tf.distribute.get_replica_context()
    return tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
  return float(strategy.reduce(tf.distribute.ReduceOp.SUM,
                               strategy.run(value), axis=None))


@pytest.mark.beside
class SingleProcessStrategyTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("mirrored_two_cpus", "mirrored", {"devices": ["/cpu:0", "/cpu:1"]},
       tf.distribute.MirroredStrategy, 2),
      ("mirrored_reduction_to_one_device", "mirrored",
       {"devices": ["/cpu:0", "/cpu:1"],
        "cross_device_ops": "reduction_to_one_device"},
       tf.distribute.MirroredStrategy, 2),
      ("mirrored_hierarchical_copy", "mirrored",
       {"devices": ["/cpu:0", "/cpu:1"], "cross_device_ops": "hierarchical_copy"},
       tf.distribute.MirroredStrategy, 2),
      ("central_storage_two_cpus", "central_storage",
       {"compute_devices": ["/cpu:0", "/cpu:1"], "parameter_device": "/cpu:0"},
       tf.distribute.experimental.CentralStorageStrategy, 2),
      ("one_device_cpu1", "one_device", {"device": "/cpu:1"},
       tf.distribute.OneDeviceStrategy, 1),
      ("one_device_default", "one_device", {}, tf.distribute.OneDeviceStrategy, 1),
      ("default", "default", {}, tf.distribute.Strategy, 1),
      ("auto_on_cpu_is_default", "auto", {}, tf.distribute.Strategy, 1),
  )
  def test_builds_and_reduces(self, name, options, cls, replicas):
    strategy = tfdist.make_strategy(name, cluster=LOCAL, **options)
    self.assertIsInstance(strategy, cls)
    self.assertEqual(strategy.num_replicas_in_sync, replicas)
    self.assertEqual(_replica_sum(strategy), replicas * (replicas + 1) / 2)

  def test_central_storage_keeps_variables_on_parameter_device(self):
    strategy = tfdist.make_strategy(
        "central_storage", cluster=LOCAL,
        compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:1")
    with strategy.scope():
      v = tf.Variable(1.0)
    self.assertIn("CPU:1", v.device)

  def test_auto_ignores_options_of_builders_it_did_not_choose(self):
    strategy = tfdist.make_strategy("auto", cluster=LOCAL, timeout_seconds=5)
    self.assertEqual(strategy.num_replicas_in_sync, 1)


@pytest.mark.beside
class ChooseStrategyTest(parameterized.TestCase):
  """The auto table, row by row."""

  @parameterized.named_parameters(
      ("tpu", TPU, {"CPU": 1}, "tpu"),
      ("ps_cluster", PS_CLUSTER, {"CPU": 1}, "parameter_server"),
      ("two_workers", TWO_WORKERS, {"CPU": 1}, "multi_worker_mirrored"),
      ("two_workers_with_gpus", TWO_WORKERS, {"GPU": 4},
       "multi_worker_mirrored"),
      ("local_two_gpus", LOCAL, {"CPU": 1, "GPU": 2}, "mirrored"),
      ("local_one_gpu", LOCAL, {"CPU": 1, "GPU": 1}, "one_device"),
      ("local_cpu", LOCAL, {"CPU": 1}, "default"),
      ("single_worker_cluster",
       ClusterInfo(source="tf_config", cluster={"worker": ["h:1"]},
                   task_type="worker", task_id=0), {"CPU": 1}, "default"),
      ("evaluator_task",
       ClusterInfo(source="tf_config", cluster={"worker": ["h:1", "h:2"]},
                   task_type="evaluator", task_id=0), {"CPU": 1}, "default"),
  )
  def test_table(self, info, devices, expected):
    name, why = tfdist.choose_strategy(info, devices)
    self.assertEqual(name, expected)
    self.assertTrue(why)


@pytest.mark.beside
class BadInputTest(parameterized.TestCase):
  """Every case raises ConfigError naming the field."""

  @parameterized.named_parameters(
      ("unknown_name", "mirored", LOCAL, {}, "strategy"),
      ("experimental_alias_rejected", "MultiWorkerMirroredStrategy", LOCAL, {},
       "strategy"),
      ("unknown_option", "mirrored", LOCAL, {"devise": ["/cpu:0"]}, "option"),
      ("option_of_other_builder", "mirrored", LOCAL, {"timeout_seconds": 5},
       "option"),
      ("auto_unknown_option", "auto", LOCAL, {"nope": 1}, "option"),
      ("default_takes_no_option", "default", LOCAL, {"devices": ["/cpu:0"]},
       "option"),
      ("bad_cross_device_ops", "mirrored", LOCAL, {"cross_device_ops": "mpi"},
       "cross_device_ops"),
      ("devices_is_a_string", "mirrored", LOCAL, {"devices": "/cpu:0"},
       "devices"),
      ("devices_empty", "mirrored", LOCAL, {"devices": []}, "devices"),
      ("missing_device", "mirrored", LOCAL, {"devices": ["/cpu:0", "/gpu:3"]},
       "devices"),
      ("not_a_device", "mirrored", LOCAL, {"devices": ["banana"]}, "devices"),
      ("num_gpus_beyond_machine", "mirrored", LOCAL, {"num_gpus": 2},
       "num_gpus"),
      ("num_gpus_negative", "mirrored", LOCAL, {"num_gpus": -1}, "num_gpus"),
      ("num_gpus_and_devices", "mirrored", LOCAL,
       {"num_gpus": 0, "devices": ["/cpu:0"]}, "num_gpus"),
      ("num_packs_zero", "mirrored", LOCAL, {"num_packs": 0}, "num_packs"),
      ("mirrored_inside_cluster", "mirrored", TWO_WORKERS, {}, "strategy"),
      ("central_storage_inside_cluster", "central_storage", TWO_WORKERS, {},
       "strategy"),
      ("central_storage_missing_device", "central_storage", LOCAL,
       {"compute_devices": ["/cpu:7"]}, "compute_devices"),
      ("mwms_expected_two_workers", "multi_worker_mirrored", LOCAL,
       {"num_workers": 2}, "num_workers"),
      ("mwms_with_ps", "multi_worker_mirrored", PS_CLUSTER, {}, "cluster.ps"),
      ("mwms_bad_implementation", "multi_worker_mirrored", LOCAL,
       {"implementation": "mpi"}, "implementation"),
      ("mwms_negative_timeout", "multi_worker_mirrored", LOCAL,
       {"timeout_seconds": -1}, "timeout_seconds"),
      ("mwms_bool_bytes_per_pack", "multi_worker_mirrored", LOCAL,
       {"bytes_per_pack": True}, "bytes_per_pack"),
      ("ps_without_ps_tasks", "parameter_server", TWO_WORKERS, {}, "cluster.ps"),
      ("ps_on_local_machine", "parameter_server", LOCAL, {}, "cluster.ps"),
      ("ps_on_evaluator_task", "parameter_server",
       dataclasses.replace(PS_CLUSTER, task_type="evaluator"), {}, "task.type"),
      ("ps_bad_partitioner", "parameter_server", PS_CLUSTER,
       {"variable_partitioner": "even"}, "variable_partitioner"),
      ("ps_zero_shards", "parameter_server", PS_CLUSTER,
       {"variable_partitioner": "fixed", "num_shards": 0}, "num_shards"),
      ("tpu_bad_address", "tpu", LOCAL, {"tpu": "grpc://"}, "tpu"),
      ("tpu_bad_timeout", "tpu", LOCAL, {"connect_timeout_seconds": 0},
       "connect_timeout_seconds"),
  )
  def test_config_error(self, name, cluster, options, field):
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.make_strategy(name, cluster=cluster, **options)
    self.assertEqual(caught.exception.field, field)
    self.assertIn("expected", str(caught.exception))

  def test_unknown_name_lists_valid_names_sorted(self):
    with self.assertRaisesRegex(tfdist.ConfigError, "central_storage"):
      tfdist.make_strategy("nope", cluster=LOCAL)

  def test_tpu_unreachable_address_stops_before_tpu_system_initialization(self):
    port, = cluster_utils.free_ports(1)
    with self.assertRaisesRegex(tfdist.TpuUnavailableError,
                                "did not accept a connection"):
      tfdist.make_strategy("tpu", cluster=LOCAL, tpu=f"grpc://127.0.0.1:{port}",
                           connect_timeout_seconds=2)


@pytest.mark.beside
class OptionsTest(parameterized.TestCase):

  @parameterized.parameters(tfdist.MirroredOptions,
                            tfdist.ParameterServerOptions,
                            tfdist.MultiWorkerMirroredOptions,
                            tfdist.TPUOptions, tfdist.CentralStorageOptions,
                            tfdist.OneDeviceOptions)
  def test_frozen_and_keyword_only(self, cls):
    instance = cls()
    field = dataclasses.fields(cls)[0].name
    with self.assertRaises(dataclasses.FrozenInstanceError):
      setattr(instance, field, None)
    with self.assertRaises(TypeError):
      cls(None)

  def test_devices_become_tuple(self):
    self.assertEqual(tfdist.MirroredOptions(devices=["/cpu:0"]).devices,
                     ("/cpu:0",))


@pytest.mark.timeout(240)
class MultiProcessStrategyTest(parameterized.TestCase):
  """Real clusters on localhost, one at a time."""

  # "auto" only: it builds what the name would (ChooseStrategyTest.test_table
  # shows the choice), and many clusters name multi_worker_mirrored (e.g.
  # test_keras_compat's MultiWorkerFitTest.test_fit_trains_identically_tutorial).
  @parameterized.named_parameters(("auto", "auto"))
  def test_multi_worker_mirrored_two_processes_all_reduce(self, name):
    configs = cluster_utils.worker_configs(2)
    results = cluster_utils.run_cluster("allreduce.py", configs, args=[name],
                                        timeout=180)
    for r in results:
      self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    outs = [r.json() for r in results]
    for i, out in enumerate(outs):
      self.assertTrue(out["is_mwms"])
      self.assertEqual(out["replicas"], 2)
      self.assertEqual(out["sum"], 3.0)  # (0 + 1) + (1 + 1)
      self.assertEqual((out["task_type"], out["task_id"]), ("worker", i))
    self.assertEqual(outs[0]["cluster"], outs[1]["cluster"])

  # "auto" only, as above; runner_job.py names parameter_server
  # (test_runner's test_matches_single_device_parameter_server_synchronous).
  @parameterized.named_parameters(("auto", "auto"))
  def test_parameter_server_local_cluster(self, name):
    result = cluster_utils.run_script("parameter_server.py", args=[name],
                                      timeout=180)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    out = result.json()
    self.assertTrue(out["is_pss"])
    self.assertEqual(out["counter"], 20.0)
    self.assertEqual(out["results"], 20.0)
    self.assertIn("/job:ps/", out["variable_device"])


@pytest.mark.timeout(240)
@pytest.mark.beside  # tests/conftest.py: one process at a time.
class OneProcessScriptTest(absltest.TestCase):
  """Scripts of one process each: what only a fresh process shows."""

  def test_two_mirrored_strategies_in_one_process(self):
    ours = cluster_utils.run_script("two_mirrored.py", args=["tfdist"])
    self.assertEqual(ours.returncode, 0, ours.stderr[-3000:])
    self.assertEqual(ours.json(), {"trained": [7, 3], "error": None})
    upstream = cluster_utils.run_script("two_mirrored.py", args=["raw"])
    self.assertEqual(upstream.returncode, 0, upstream.stderr[-3000:])
    self.assertEqual(
        upstream.json()["trained"], [7],
        "upstream MirroredStrategy no longer reuses collective keys across "
        f"instances (tensorflow {tf.__version__}): drop _MirroredStrategy")

  def test_tpu_local_stops_at_tpu_system_initialization(self):
    result = cluster_utils.run_script("tpu_local.py", timeout=120)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    out = result.json()
    self.assertEqual(out["error"], "TpuUnavailableError")
    self.assertIn("TPU system initialization failed", out["message"])
    self.assertIn("tpu='local'", out["message"])

  def test_multi_worker_mirrored_after_other_tf_ops_is_a_clear_error(self):
    result = cluster_utils.run_script("late_collectives.py", timeout=120)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    out = result.json()
    self.assertEqual(out["error"], "ConfigError")
    self.assertIn("before any other TensorFlow op", out["message"])


if __name__ == "__main__":
  absltest.main()
