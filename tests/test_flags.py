"""Tests for tfdist.flags: Model Garden's strategy flags with validators."""

from __future__ import annotations

import contextlib
import io
import json
import os
from unittest import mock

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
import keras
import pytest
import tensorflow as tf

from tfdist import flags as tfdist_flags
from tfdist import ConfigError

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.


def _parsed(*args: str) -> flags.FlagValues:
  """A fresh FlagValues with tfdist's flags, parsed from ``args``."""
  fv = flags.FlagValues()
  tfdist_flags.define_flags(flag_values=fv)
  fv(["prog", *args])
  return fv


def _snapshot(fv: flags.FlagValues) -> dict:
  return {name: (fv[name].value, fv[name].present, fv[name].using_default_value)
          for name in fv}


_TWO_HOSTS = "w0.example.com:2222,w1.example.com:2222"


class DefineFlagsTest(absltest.TestCase):

  def test_defaults(self):
    fv = flags.FlagValues()
    holders = tfdist_flags.define_flags(flag_values=fv)
    fv(["prog"])
    self.assertEqual(holders.strategy.value, "auto")
    self.assertIsNone(holders.num_gpus.value)
    self.assertIsNone(holders.worker_hosts.value)
    self.assertEqual(holders.mixed_precision.value, "none")
    self.assertFalse(holders.jit_compile.value)
    self.assertEqual(holders.steps_per_execution.value, 1)
    config = tfdist_flags.strategy_config(fv)
    self.assertEqual((config.name, dict(config.options), config.cluster,
                      config.slurm_roles), ("auto", {}, None, None))

  def test_holders_are_bound_to_their_flag_values(self):
    fv = flags.FlagValues()
    holders = tfdist_flags.define_flags(flag_values=fv)
    fv(["prog", "--strategy=mirrored"])
    self.assertEqual(holders.strategy.value, "mirrored")
    self.assertNotIn("strategy", flags.FLAGS)  # The global FLAGS untouched.

  def test_defining_twice_is_an_error(self):
    fv = flags.FlagValues()
    tfdist_flags.define_flags(flag_values=fv)
    with self.assertRaises(flags.DuplicateFlagError):
      tfdist_flags.define_flags(flag_values=fv)

  def test_model_garden_aliases(self):
    fv = _parsed("--distribution_strategy=OFF", "--enable_xla")
    self.assertEqual(fv["strategy"].value, "off")
    self.assertTrue(fv["jit_compile"].value)
    self.assertEqual(tfdist_flags.strategy_config(fv).name, "default")


class StrategyConfigTest(parameterized.TestCase):
  """Valid combinations -> the make_strategy call they become."""

  @parameterized.named_parameters(
      ("auto", [], "auto", {}),
      ("off", ["--strategy=off"], "default", {}),
      ("off_one_gpu", ["--strategy=off", "--num_gpus=1"], "default", {}),
      ("default", ["--strategy=default"], "default", {}),
      ("one_device_cpu", ["--strategy=one_device", "--num_gpus=0"],
       "one_device", {"device": "/cpu:0"}),
      ("one_device_gpu", ["--strategy=one_device", "--num_gpus=1"],
       "one_device", {"device": "/gpu:0"}),
      ("mirrored_all", ["--strategy=mirrored"], "mirrored", {}),
      ("mirrored_4_nccl", ["--strategy=mirrored", "--num_gpus=4",
                           "--all_reduce_alg=nccl"], "mirrored",
       {"num_gpus": 4, "cross_device_ops": "nccl"}),
      ("mirrored_hierarchical", ["--strategy=mirrored",
                                 "--all_reduce_alg=hierarchical_copy"],
       "mirrored", {"cross_device_ops": "hierarchical_copy"}),
      ("mirrored_cpu_reduction", ["--strategy=mirrored", "--num_gpus=0",
                                  "--all_reduce_alg=reduction_to_one_device"],
       "mirrored", {"num_gpus": 0,
                    "cross_device_ops": "reduction_to_one_device"}),
      ("central_storage_2", ["--strategy=central_storage", "--num_gpus=2"],
       "central_storage", {"compute_devices": ("/gpu:0", "/gpu:1")}),
      ("central_storage_cpu", ["--strategy=central_storage", "--num_gpus=0"],
       "central_storage", {"compute_devices": ("/cpu:0",)}),
      ("mwms_ring", ["--strategy=multi_worker_mirrored",
                     "--all_reduce_alg=ring"], "multi_worker_mirrored",
       {"implementation": "ring"}),
      ("mwms_nccl", ["--strategy=multi_worker_mirrored",
                     "--all_reduce_alg=nccl"], "multi_worker_mirrored",
       {"implementation": "nccl"}),
      ("parameter_server", ["--strategy=parameter_server"],
       "parameter_server", {}),
      ("tpu_local", ["--strategy=tpu", "--tpu=local"], "tpu",
       {"tpu": "local"}),
      ("tpu_detected", ["--strategy=tpu"], "tpu", {}),
      ("auto_with_tpu_name", ["--tpu=my-tpu"], "tpu", {"tpu": "my-tpu"}),
      ("tpu_grpc", ["--strategy=tpu", "--tpu=grpc://10.0.0.2:8470"], "tpu",
       {"tpu": "grpc://10.0.0.2:8470"}),
      ("case_insensitive", ["--strategy=Mirrored"], "mirrored", {}),
      # Model Garden's flags, with Model Garden's meaning.
      ("all_gpus", ["--strategy=mirrored", "--num_gpus=-1"], "mirrored", {}),
      ("gpus_ignored_by_mwms", ["--strategy=multi_worker_mirrored",
                                "--num_gpus=2"], "multi_worker_mirrored", {}),
      ("gpus_ignored_by_tpu", ["--strategy=tpu", "--num_gpus=1"], "tpu", {}),
      ("gpus_ignored_by_ps", ["--distribution_strategy=parameter_server",
                              "--num_gpus=8"], "parameter_server", {}),
      ("num_packs", ["--strategy=mirrored", "--all_reduce_alg=nccl",
                     "--num_packs=4"], "mirrored",
       {"cross_device_ops": "nccl", "num_packs": 4}),
      ("tpu_zone_project", ["--tpu=my-tpu", "--tpu_zone=us-central1-b",
                            "--tpu_project=proj"], "tpu",
       {"tpu": "my-tpu", "zone": "us-central1-b", "project": "proj"}),
  )
  def test_options(self, args, name, options):
    fv = _parsed(*args)
    config = tfdist_flags.strategy_config(fv)
    self.assertEqual(config.name, name)
    self.assertEqual(dict(config.options), options)
    self.assertIsNone(config.cluster)

  @parameterized.named_parameters(
      ("two_hosts", ["--strategy=multi_worker_mirrored",
                     f"--worker_hosts={_TWO_HOSTS}", "--task_index=1"],
       ["w0.example.com:2222", "w1.example.com:2222"], 1),
      ("auto_spaces", ["--worker_hosts=a:1, b:2", "--task_index=0"],
       ["a:1", "b:2"], 0),
      ("one_host_no_index", ["--strategy=mirrored", "--worker_hosts=h:2222"],
       ["h:2222"], 0),
  )
  def test_worker_hosts_become_an_explicit_cluster(self, args, hosts, index):
    fv = _parsed(*args)
    cluster = json.loads(tfdist_flags.strategy_config(fv).cluster)
    self.assertEqual(cluster, {"cluster": {"worker": hosts},
                               "task": {"type": "worker", "index": index}})
    with mock.patch.dict(os.environ, {}, clear=False) as environ:
      environ.pop("TF_CONFIG", None)
      before = dict(os.environ)
      info = tfdist_flags.cluster_from_flags(fv)
      self.assertEqual(dict(os.environ), before)  # Never written.
    self.assertEqual((info.source, info.task_type, info.task_id),
                     ("explicit", "worker", index))
    self.assertEqual(list(info.cluster["worker"]), hosts)

  def test_slurm_roles(self):
    fv = _parsed("--strategy=parameter_server",
                 "--slurm_roles=chief=1,ps=1,worker=2")
    self.assertEqual(dict(tfdist_flags.strategy_config(fv).slurm_roles),
                     {"chief": 1, "ps": 1, "worker": 2})

  def test_slurm_roles_resolve_a_step(self):
    step = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
            "SLURM_LOCALID": "1", "SLURMD_NODENAME": "n9",
            "SLURM_STEP_NODELIST": "n[9-10]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    fv = _parsed("--slurm_roles=chief=1,ps=1,worker=2")
    with mock.patch.dict(os.environ, step, clear=True):
      info = tfdist_flags.cluster_from_flags(fv)
    self.assertEqual((info.task_type, info.task_id), ("ps", 0))
    self.assertEqual(sorted(info.cluster), ["chief", "ps", "worker"])


class IgnoredFlagsTest(parameterized.TestCase):
  """What Model Garden's get_distribution_strategy ignores is ignored, with
  one note line each; its defaults say nothing."""

  @parameterized.named_parameters(
      ("model_garden_defaults", ["--strategy=mirrored", "--num_packs=1",
                                 "--tpu=", "--task_index=-1", "--dtype=fp32"],
       "mirrored", {}, []),
      ("empty_tpu_is_the_local_tpu", ["--strategy=tpu", "--tpu="], "tpu",
       {"tpu": "local"}, []),
      ("packs_without_packing_alg", ["--strategy=mirrored", "--num_packs=2"],
       "mirrored", {}, ["--num_packs=2 is ignored by --strategy=mirrored"]),
      ("packs_with_mwms", ["--strategy=multi_worker_mirrored",
                           "--all_reduce_alg=ring", "--num_packs=2"],
       "multi_worker_mirrored", {"implementation": "ring"},
       ["--num_packs=2 is ignored by --strategy=multi_worker_mirrored"]),
      ("alg_with_one_device", ["--strategy=one_device",
                               "--all_reduce_alg=nccl"], "one_device", {},
       ["--all_reduce_alg=nccl is ignored by --strategy=one_device"]),
      ("tpu_with_mirrored", ["--strategy=mirrored", "--tpu=local"],
       "mirrored", {}, ["--tpu='local' is ignored by --strategy=mirrored"]),
      ("gpus_with_mwms", ["--strategy=multi_worker_mirrored", "--num_gpus=2"],
       "multi_worker_mirrored", {},
       ["--num_gpus=2 is ignored by --strategy=multi_worker_mirrored"]),
      ("loss_scale_with_bf16", ["--dtype=bf16", "--loss_scale=128"], "auto",
       {}, ["--loss_scale=128 is ignored by --strategy=auto (it applies to "
            "fp16 only)"]),
  )
  def test_ignored(self, args, name, options, notes):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
      config = tfdist_flags.strategy_config(_parsed(*args))
    self.assertEqual((config.name, dict(config.options)), (name, options))
    self.assertEqual(stderr.getvalue().splitlines(),
                     [f"tfdist: note: {n}, as in Model Garden" for n in notes])


class InvalidFlagsTest(parameterized.TestCase):
  """Combinations that cannot work fail at parse time, naming the flag."""

  @parameterized.named_parameters(
      ("unknown_strategy", ["--strategy=horovod"], "--strategy"),
      ("gpus_below_all", ["--strategy=mirrored", "--num_gpus=-2"],
       "--num_gpus"),
      ("one_device_two_gpus", ["--strategy=one_device", "--num_gpus=2"],
       "--num_gpus"),
      ("off_eight_gpus", ["--strategy=off", "--num_gpus=8"], "--num_gpus"),
      ("dtype_unknown", ["--dtype=fp8"], "--dtype"),
      ("dtype_and_mixed_precision_disagree", ["--dtype=fp16",
                                               "--mixed_precision=bfloat16"],
       "--dtype=fp16 and --mixed_precision=bfloat16 disagree"),
      ("loss_scale_not_a_number", ["--dtype=fp16", "--loss_scale=big"],
       "'dynamic' or a positive number"),
      ("loss_scale_zero", ["--dtype=fp16", "--loss_scale=0"],
       "'dynamic' or a positive number"),
      ("num_packs_zero", ["--strategy=mirrored", "--all_reduce_alg=nccl",
                          "--num_packs=0"], "--num_packs"),
      ("tpu_zone_without_tpu", ["--strategy=tpu", "--tpu_zone=us-central1-b"],
       "--tpu_zone"),
      ("ring_with_mirrored", ["--strategy=mirrored", "--all_reduce_alg=ring"],
       "--all_reduce_alg"),
      ("hierarchical_with_mwms", ["--strategy=multi_worker_mirrored",
                                  "--all_reduce_alg=hierarchical_copy"],
       "--all_reduce_alg"),
      ("alg_unknown", ["--all_reduce_alg=butterfly"], "--all_reduce_alg"),
      ("tpu_malformed", ["--strategy=tpu", "--tpu=grpc://no port"], "--tpu"),
      ("task_index_without_hosts", ["--task_index=0"], "--task_index"),
      ("task_index_out_of_range", [f"--worker_hosts={_TWO_HOSTS}",
                                   "--task_index=2"], "--task_index"),
      ("task_index_negative", [f"--worker_hosts={_TWO_HOSTS}",
                               "--task_index=-1"], "--task_index"),
      ("two_hosts_without_index", [f"--worker_hosts={_TWO_HOSTS}"],
       "--task_index"),
      ("hosts_duplicate", ["--worker_hosts=a:2222,a:2222", "--task_index=0"],
       "--worker_hosts"),
      ("hosts_no_port", ["--worker_hosts=a,b", "--task_index=0"],
       "--worker_hosts"),
      ("hosts_empty_entry", ["--worker_hosts=a:1,,b:2", "--task_index=0"],
       "--worker_hosts"),
      ("hosts_with_one_device", ["--strategy=one_device",
                                 f"--worker_hosts={_TWO_HOSTS}",
                                 "--task_index=0"], "--worker_hosts"),
      ("hosts_with_parameter_server", ["--strategy=parameter_server",
                                       "--worker_hosts=a:1", "--task_index=0"],
       "--worker_hosts"),
      ("roles_malformed", ["--slurm_roles=chief:1"], "--slurm_roles"),
      ("roles_with_mirrored", ["--strategy=mirrored",
                               "--slurm_roles=worker=2"], "--slurm_roles"),
      ("ps_roles_with_mwms", ["--strategy=multi_worker_mirrored",
                              "--slurm_roles=chief=1,ps=1,worker=1"],
       "--slurm_roles"),
      ("ps_strategy_without_ps_role", ["--strategy=parameter_server",
                                       "--slurm_roles=worker=3"],
       "--slurm_roles"),
      ("roles_and_hosts", ["--slurm_roles=worker=2", "--worker_hosts=a:1"],
       "--slurm_roles"),
      ("steps_per_execution_zero", ["--steps_per_execution=0"],
       "--steps_per_execution"),
      ("mixed_precision_unknown", ["--mixed_precision=float8"],
       "--mixed_precision"),
  )
  def test_rejected(self, args, flag):
    fv = flags.FlagValues()
    tfdist_flags.define_flags(flag_values=fv)
    with self.assertRaises(flags.IllegalFlagValueError) as e:
      fv(["prog", *args])
    self.assertIn(flag, str(e.exception))

  @parameterized.named_parameters(
      ("alg_valid", ["--strategy=mirrored", "--all_reduce_alg=ring"],
       "it takes hierarchical_copy, nccl, reduction_to_one_device"),
      ("gpu_most", ["--strategy=off", "--num_gpus=2"],
       "which uses at most 1; use --strategy=mirrored"),
      ("roles_takers", ["--strategy=mirrored", "--slurm_roles=worker=2"],
       "--slurm_roles is for auto, multi_worker_mirrored and "
       "parameter_server"),
      ("hosts_ps", ["--strategy=parameter_server", "--worker_hosts=a:1"],
       "it needs ps and chief tasks too; use TF_CONFIG, tfdist launch or "
       "--slurm_roles"),
      ("hosts_tpu", ["--strategy=tpu", "--worker_hosts=a:1"],
       "a TPU strategy has no worker hosts"),
      ("hosts_one_process", ["--strategy=default", f"--worker_hosts={_TWO_HOSTS}",
                             "--task_index=0"],
       "runs in one process; use --strategy=multi_worker_mirrored or auto"),
  )
  def test_messages_from_the_catalog(self, args, message):
    fv = flags.FlagValues()
    tfdist_flags.define_flags(flag_values=fv)
    with self.assertRaises(flags.IllegalFlagValueError) as e:
      fv(["prog", *args])
    self.assertIn(message, str(e.exception))

  def test_all_reduce_alg_help_lists_each_strategys_values(self):
    fv = flags.FlagValues()
    tfdist_flags.define_flags(flag_values=fv)
    self.assertIn("mirrored: nccl, hierarchical_copy, reduction_to_one_device;"
                  " multi_worker_mirrored: ring, nccl.",
                  fv["all_reduce_alg"].help)

  def test_parse_flags_prints_one_tfdist_line_and_exits_2(self):
    fv = flags.FlagValues()
    tfdist_flags.define_flags(flag_values=fv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
      tfdist_flags.parse_flags(["prog", "--task_index=3"], flag_values=fv)
    self.assertEqual(e.exception.code, 2)
    self.assertLen(err.getvalue().strip().splitlines(), 1)
    self.assertStartsWith(err.getvalue(), "tfdist: ")
    self.assertIn("--task_index", err.getvalue())

  def test_parse_flags_returns_the_other_arguments(self):
    fv = flags.FlagValues()
    tfdist_flags.define_flags(flag_values=fv)
    self.assertEqual(tfdist_flags.parse_flags(
        ["prog", "--strategy=off", "data.csv"], flag_values=fv),
        ["prog", "data.csv"])


class BuildTest(parameterized.TestCase):
  """Cheap strategies are really built in this process (2 logical CPUs)."""

  @parameterized.named_parameters(
      ("auto", [], tf.distribute.Strategy, 1),
      ("off", ["--distribution_strategy=off"], tf.distribute.Strategy, 1),
      ("one_device_cpu", ["--strategy=one_device", "--num_gpus=0"],
       tf.distribute.OneDeviceStrategy, 1),
      ("mirrored_cpu", ["--strategy=mirrored", "--num_gpus=0",
                        "--all_reduce_alg=reduction_to_one_device"],
       tf.distribute.MirroredStrategy, 1),
      ("central_storage_cpu", ["--strategy=central_storage", "--num_gpus=0"],
       tf.distribute.experimental.CentralStorageStrategy, 1),
      ("mirrored_both_cpus", ["--strategy=mirrored"],
       tf.distribute.MirroredStrategy, 2),
      ("explicit_one_host", ["--strategy=mirrored", "--worker_hosts=h:2222"],
       tf.distribute.MirroredStrategy, 2),
  )
  def test_build(self, args, cls, replicas):
    fv = _parsed(*args)
    before, environ = _snapshot(fv), dict(os.environ)
    with mock.patch.dict(os.environ):
      os.environ.pop("TF_CONFIG", None)
      strategy = tfdist_flags.strategy_from_flags(fv)
    self.assertIsInstance(strategy, cls)
    self.assertEqual(strategy.num_replicas_in_sync, replicas)
    self.assertEqual(_snapshot(fv), before)  # Flag values never change.
    self.assertEqual(dict(os.environ), environ)

  def test_mirrored_all_reduce_alg_reaches_the_strategy(self):
    fv = _parsed("--strategy=mirrored",
                 "--all_reduce_alg=reduction_to_one_device")
    strategy = tfdist_flags.strategy_from_flags(fv)
    self.assertEqual(strategy.num_replicas_in_sync, 2)
    self.assertIsInstance(strategy.extended._cross_device_ops,  # pylint: disable=protected-access
                          tf.distribute.ReductionToOneDevice)

  def test_build_time_errors_are_config_errors(self):
    fv = _parsed("--strategy=mirrored", "--num_gpus=3")  # No GPUs here.
    with self.assertRaises(ConfigError) as e:
      tfdist_flags.strategy_from_flags(fv)
    self.assertEqual(e.exception.field, "num_gpus")


class ModelGardenPrecisionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("fp16", ["--dtype=fp16"], "float16", None),
      ("bf16", ["--dtype=bf16"], "bfloat16", None),
      ("fp32", ["--dtype=fp32"], "none", None),
      ("fp16_dynamic", ["--dtype=fp16", "--loss_scale=dynamic"], "float16",
       "dynamic"),
      ("fp16_fixed", ["--dtype=fp16", "--loss_scale=128"], "float16", "128"),
      ("agreeing_flags", ["--dtype=fp16", "--mixed_precision=float16"],
       "float16", None),
  )
  def test_dtype_and_loss_scale(self, args, policy, scale):
    options = tfdist_flags.training_options(_parsed(*args))
    self.assertEqual((options.mixed_precision, options.loss_scale),
                     (policy, scale))

  def test_a_number_starts_the_loss_scale_there(self):
    import keras  # pylint: disable=g-import-not-at-top
    options = tfdist_flags.training_options(
        _parsed("--dtype=fp16", "--loss_scale=128"))
    wrapped = options.loss_scale_optimizer(keras.optimizers.SGD(0.1))
    self.assertIsInstance(wrapped, keras.optimizers.LossScaleOptimizer)
    self.assertEqual(float(wrapped.initial_scale), 128.0)
    plain = keras.optimizers.SGD(0.1)
    self.assertIs(tfdist_flags.training_options(
        _parsed("--dtype=fp16")).loss_scale_optimizer(plain), plain)


class TrainingOptionsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    policy = keras.mixed_precision.global_policy()
    self.addCleanup(keras.mixed_precision.set_global_policy, policy)
    keras.mixed_precision.set_global_policy("float32")

  def test_values_for_the_training_code(self):
    fv = _parsed("--mixed_precision=bfloat16", "--jit_compile",
                 "--steps_per_execution=50")
    options = tfdist_flags.training_options(fv)
    self.assertEqual(options.policy, "mixed_bfloat16")
    self.assertEqual(options.compile_kwargs(),
                     {"jit_compile": True, "steps_per_execution": 50})
    # Parsing alone changes no global state.
    self.assertEqual(keras.mixed_precision.global_policy().name, "float32")

  def test_apply_mixed_precision(self):
    for value, policy in (("float16", "mixed_float16"),
                          ("bfloat16", "mixed_bfloat16")):
      fv = _parsed(f"--mixed_precision={value}")
      before = _snapshot(fv)
      self.assertEqual(tfdist_flags.apply_mixed_precision(fv), policy)
      self.assertEqual(keras.mixed_precision.global_policy().name, policy)
      self.assertEqual(_snapshot(fv), before)

  def test_none_leaves_the_policy_alone(self):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    self.assertEqual(tfdist_flags.apply_mixed_precision(_parsed()),
                     "mixed_bfloat16")


if __name__ == "__main__":
  absltest.main()
