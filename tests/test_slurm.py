"""Tests for tfdist.cluster.slurm: SLURM variable tables and a real SLURM."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import textwrap

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import slurm_harness
import tfdist
from tfdist.cluster import slurm
from tfdist import ConfigError

pytestmark = pytest.mark.timeout(60)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JOB = 4242
_BASE = 10000 + (_JOB % 1423) * 16  # The documented default: 32336.


def _step_env(**overrides: str | None) -> dict[str, str]:
  """What srun sets for rank 0 of a 2-task step on n[9-10]; None drops a key."""
  env = {
      "SLURM_CLUSTER_NAME": "hpc", "SLURM_JOB_PARTITION": "gpu",
      "SLURM_SUBMIT_HOST": "login1", "SLURM_SUBMIT_DIR": "/home/u",
      "SLURM_JOB_ID": str(_JOB), "SLURM_JOBID": str(_JOB),
      "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
      "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
      "SLURMD_NODENAME": "n9", "SLURM_GTIDS": "0", "SLURM_TASK_PID": "81234",
      "SLURM_JOB_NODELIST": "n[9-10]", "SLURM_NODELIST": "n[9-10]",
      "SLURM_STEP_NODELIST": "n[9-10]",
      "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
      "SLURM_STEP_NUM_NODES": "2",
      "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
      "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_STEP_NUM_TASKS": "2",
      "SLURM_JOB_CPUS_PER_NODE": "4(x2)", "SLURM_CPUS_ON_NODE": "4",
      "SLURM_SRUN_COMM_HOST": "10.0.0.1", "SLURM_STEP_LAUNCHER_PORT": "41234",
  }
  for key, value in overrides.items():
    if value is None:
      env.pop(key, None)
    else:
      env[key] = value
  return env


def _layout(nodelist: str, tasks_per_node: str, num_tasks: int, num_nodes: int,
            **overrides: str | None) -> dict[str, str]:
  """`_step_env` for another layout; the step and job values agree."""
  return _step_env(
      SLURM_STEP_NODELIST=nodelist, SLURM_NODELIST=nodelist,
      SLURM_JOB_NODELIST=nodelist, SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
      SLURM_TASKS_PER_NODE=tasks_per_node,
      SLURM_STEP_NUM_TASKS=str(num_tasks), SLURM_NTASKS=str(num_tasks),
      SLURM_NPROCS=str(num_tasks), SLURM_STEP_NUM_NODES=str(num_nodes),
      SLURM_NNODES=str(num_nodes), SLURM_JOB_NUM_NODES=str(num_nodes),
      **overrides)


_BLOCK_5 = ("gpu01", "gpu01", "gpu02", "gpu02", "cpu7")
_CYCLIC_4 = ("n1", "n2", "n3", "n1")


class ResolveSlurmTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("rank0_gets_n9", _step_env(), {"worker": ("n9", "n10")}, "worker", 0,
       "n9", 0),
      ("rank1_gets_n10",
       _step_env(SLURM_PROCID="1", SLURMD_NODENAME="n10", SLURM_NODEID="1"),
       {"worker": ("n9", "n10")}, "worker", 1, "n10", 0),
      ("block_multi_node",
       _layout("gpu[01-02],cpu7", "2(x2),1", 5, 3, SLURM_PROCID="3",
               SLURM_LOCALID="1", SLURMD_NODENAME="gpu02",
               SLURM_DISTRIBUTION="block"),
       {"worker": _BLOCK_5}, "worker", 3, "gpu02", 1),
      ("block_is_default",
       _layout("gpu[01-02],cpu7", "2(x2),1", 5, 3, SLURM_PROCID="4",
               SLURM_LOCALID="0", SLURMD_NODENAME="cpu7"),
       {"worker": _BLOCK_5}, "worker", 4, "cpu7", 0),
      ("block_with_socket_level_and_pack",
       _layout("gpu[01-02],cpu7", "2(x2),1", 5, 3, SLURM_PROCID="1",
               SLURM_LOCALID="1", SLURMD_NODENAME="gpu01",
               SLURM_DISTRIBUTION="block:cyclic,pack"),
       {"worker": _BLOCK_5}, "worker", 1, "gpu01", 1),
      ("cyclic",
       _layout("n[1-3]", "2,1(x2)", 4, 3, SLURM_PROCID="3",
               SLURM_LOCALID="1", SLURMD_NODENAME="n1",
               SLURM_DISTRIBUTION="cyclic"),
       {"worker": _CYCLIC_4}, "worker", 3, "n1", 1),
      ("cyclic_block",
       _layout("n[1-3]", "2,1(x2)", 4, 3, SLURM_PROCID="1",
               SLURM_LOCALID="0", SLURMD_NODENAME="n2",
               SLURM_DISTRIBUTION="cyclic:block"),
       {"worker": _CYCLIC_4}, "worker", 1, "n2", 0),
      ("two_bracket_groups",
       _layout("r[1-2]n[3-4]", "1(x4)", 4, 4, SLURM_PROCID="1",
               SLURMD_NODENAME="r1n4"),
       {"worker": ("r1n3", "r1n4", "r2n3", "r2n4")}, "worker", 1, "r1n4", 0),
      ("job_level_fallback",
       _step_env(SLURM_STEP_ID=None, SLURM_JOB_ID=None,
                 SLURM_STEP_NODELIST=None, SLURM_STEP_TASKS_PER_NODE=None,
                 SLURM_STEP_NUM_TASKS=None, SLURM_STEP_NUM_NODES=None),
       {"worker": ("n9", "n10")}, "worker", 0, "n9", 0),
      ("parameter_server_roles",
       _layout("n[1-4]", "1(x4)", 4, 4, SLURM_PROCID="2",
               SLURMD_NODENAME="n3"),
       {"chief": ("n1",), "ps": ("n2",), "worker": ("n3", "n4")},
       "worker", 0, "n3", 0, {"chief": 1, "ps": 1, "worker": 2}),
      ("roles_chief_rank",
       _layout("n[1-4]", "1(x4)", 4, 4, SLURMD_NODENAME="n1"),
       {"chief": ("n1",), "ps": ("n2",), "worker": ("n3", "n4")},
       "chief", 0, "n1", 0, {"chief": 1, "ps": 1, "worker": 2}),
      ("roles_ps_rank_zero_sized_job_dropped",
       _layout("n[1-4]", "1(x4)", 4, 4, SLURM_PROCID="1",
               SLURMD_NODENAME="n2"),
       {"chief": ("n1",), "ps": ("n2",), "worker": ("n3", "n4")},
       "ps", 0, "n2", 0, {"chief": 1, "ps": 1, "evaluator": 0, "worker": 2}),
  )
  def test_layout(self, env, hosts, task_type, task_id, node, local_id,
                  roles=None):
    info = slurm.resolve_slurm(env, roles=roles)
    self.assertEqual(info.source, "slurm")
    self.assertEqual(info.task_type, task_type)
    self.assertEqual(info.task_id, task_id)
    local_ids = {}
    expected = {}
    for job, job_hosts in hosts.items():
      expected[job] = []
      for host in job_hosts:
        expected[job].append(f"{host}:{_BASE + local_ids.get(host, 0)}")
        local_ids[host] = local_ids.get(host, 0) + 1
    self.assertEqual({k: list(v) for k, v in info.cluster.items()}, expected)
    self.assertEqual(info.address, f"{node}:{_BASE + local_id}")
    self.assertEqual(info.slurm.node, node)
    self.assertEqual(info.slurm.local_id, local_id)
    self.assertEqual(info.slurm.proc_id, int(env["SLURM_PROCID"]))
    self.assertEqual(info.slurm.job_id, str(_JOB))
    self.assertEqual(info.origin, "SLURM variables passed as environ")

  def test_slurm_info(self):
    info = slurm.resolve_slurm(_layout(
        "gpu[01-02],cpu7", "2(x2),1", 5, 3, SLURM_ARRAY_JOB_ID="4240",
        SLURM_ARRAY_TASK_ID="2", SLURMD_NODENAME="gpu01"))
    self.assertEqual(info.slurm.nodes, ("gpu01", "gpu02", "cpu7"))
    self.assertEqual(info.slurm.tasks_per_node, (2, 2, 1))
    self.assertEqual(info.slurm.num_tasks, 5)
    self.assertEqual(info.slurm.step_id, "0")
    self.assertEqual(info.slurm.array_job_id, "4240")
    self.assertEqual(info.slurm.array_task_id, "2")
    self.assertTrue(info.is_chief)
    self.assertEqual(info.num_workers, 5)

  @parameterized.named_parameters(
      ("derived_from_job_id", {}, None, _BASE),
      ("env_override", {"TFDIST_PORT_BASE": "20000"}, None, 20000),
      ("argument_override", {}, 21000, 21000),
      ("argument_beats_env", {"TFDIST_PORT_BASE": "20000"}, 22000, 22000),
  )
  def test_ports(self, extra, port_base, base):
    info = slurm.resolve_slurm(_step_env(**extra), port_base=port_base)
    self.assertEqual(info.cluster["worker"], (f"n9:{base}", f"n10:{base}"))

  def test_two_jobs_on_one_node_do_not_collide(self):
    ports = []
    for job in ("1234", "1235"):
      env = _layout("n9", "4", 4, 1, SLURM_JOB_ID=job, SLURM_JOBID=job)
      ports.append({a.split(":")[1] for a in
                    slurm.resolve_slurm(env).cluster["worker"]})
    self.assertLen(ports[0], 4)
    self.assertEmpty(ports[0] & ports[1])

  def test_port_slots_are_disjoint_and_below_ephemeral_range(self):
    bases = [slurm.default_port_base(job) for job in range(1423)]
    self.assertLen(set(bases), 1423)
    self.assertGreaterEqual(min(bases), 10000)
    self.assertLessEqual(max(bases) + slurm.PORTS_PER_JOB - 1, 32767)
    self.assertEqual(slurm.default_port_base(1423), slurm.default_port_base(0))

  @parameterized.named_parameters(
      ("cpu_only", {}, {}),
      ("cuda_visible_devices", {"CUDA_VISIBLE_DEVICES": "0,1"}, {"GPU": 2}),
      ("cuda_uuid", {"CUDA_VISIBLE_DEVICES": "GPU-8f2e"}, {"GPU": 1}),
      ("cuda_empty", {"CUDA_VISIBLE_DEVICES": ""}, {}),
      ("cuda_hidden", {"CUDA_VISIBLE_DEVICES": "-1"}, {}),
      ("cuda_no_dev_files", {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, {}),
      ("cuda_stops_at_invalid", {"CUDA_VISIBLE_DEVICES": "3,-1,4"},
       {"GPU": 1}),
      ("cuda_beats_slurm", {"CUDA_VISIBLE_DEVICES": "1",
                            "SLURM_GPUS_ON_NODE": "4"}, {"GPU": 1}),
      ("slurm_step_gpus", {"SLURM_STEP_GPUS": "2,3"}, {"GPU": 2}),
      ("slurm_gpus_on_node", {"SLURM_GPUS_ON_NODE": "4"}, {"GPU": 4}),
      ("slurm_zero_gpus", {"SLURM_GPUS_ON_NODE": "0"}, {}),
  )
  def test_accelerators(self, extra, expected):
    before = dict(os.environ)
    info = slurm.resolve_slurm(_step_env(**extra))
    self.assertEqual(dict(info.accelerators), expected)
    self.assertEqual(dict(os.environ), before)  # Never writes the environment.


_BATCH_SCRIPT_ENV = {  # What sbatch gives the batch script (SLURM 22.05).
    "SLURM_JOB_ID": "77", "SLURM_JOBID": "77", "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURMD_NODENAME": "n9",
    "SLURM_NODELIST": "n[9-10]", "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_NTASKS": "2", "SLURM_GTIDS": "0",
}
_SALLOC_ENV = {  # What salloc gives its shell on the submit host.
    "SLURM_JOB_ID": "78", "SLURM_JOBID": "78", "SLURM_NODELIST": "n[9-10]",
    "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NTASKS": "2",
}


class StepDetectionTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("srun_step", _step_env(), True, True),
      ("old_variable_names", _step_env(SLURM_JOB_ID=None, SLURM_STEP_ID=None),
       True, True),
      ("sbatch_batch_script", _BATCH_SCRIPT_ENV, False, True),
      ("salloc_shell", _SALLOC_ENV, False, True),
      ("no_slurm", {"HOME": "/root"}, False, False),
  )
  def test_detection(self, env, step, job):
    self.assertEqual(slurm.is_slurm_step(env), step)
    self.assertEqual(slurm.in_slurm_job(env), job)

  @parameterized.named_parameters(
      ("no_slurm", {}, "SLURM_JOB_ID", "not part of a SLURM job"),
      ("batch_script", _BATCH_SCRIPT_ENV, "SLURM_STEP_ID", "sbatch"),
      ("salloc", _SALLOC_ENV, "SLURM_STEP_ID", "salloc"),
      ("no_procid", _step_env(SLURM_PROCID=None), "SLURM_PROCID", "srun"),
  )
  def test_outside_a_step(self, env, field, words):
    with self.assertRaises(ConfigError) as ctx:
      slurm.resolve_slurm(env)
    self.assertEqual(ctx.exception.field, field)
    self.assertIsNone(ctx.exception.value)
    self.assertIn("srun", str(ctx.exception))
    self.assertIn(words, str(ctx.exception))


class LaunchFieldsTest(parameterized.TestCase):
  """What `tfdist launch` takes from a step of one task per node."""

  _ALIASES = {"SLURM_NODE_ALIASES": "n9:10.0.0.9:n9,n10:10.0.0.10:n10"}

  @parameterized.named_parameters(
      ("node_0_workers", "0", None, 2, {}),
      ("node_1_roles", "1", "chief=1,ps=1,worker=2", 2,
       dict(chief=False, num_ps=0, num_workers=2, evaluator=False)),
      ("node_0_roles", "0", "chief=1,ps=1,worker=2", 2,
       dict(chief=True, num_ps=1, num_workers=0, evaluator=False)))
  def test_members_from_the_step(self, rank, roles, tasks, jobs):
    env = _step_env(SLURM_PROCID=rank, SLURM_NODEID=rank,
                    SLURMD_NODENAME=("n9", "n10")[int(rank)],
                    TFDIST_SLURM_ROLES=roles, **self._ALIASES)
    fields, line, job = slurm.launch_fields(env, tasks=tasks, min_nodes=1)
    self.assertEqual(fields, {"nnodes": 2, "min_nodes": 1,
                              "node_rank": int(rank),
                              "master_addr": "10.0.0.9",
                              "master_port": _BASE, **jobs})
    self.assertEqual(job, str(_JOB))
    self.assertTrue(line.startswith(
        f"from SLURM job {_JOB}: --nnodes 2 (the step's nodes), --node-rank "
        f"{rank} ("), line)
    self.assertIn("--master-addr 10.0.0.9 (the first, n9, its NodeAddr)",
                  line)

  def test_more_than_one_task_a_node_is_refused(self):
    env = _layout("n[9-10]", "2(x2)", 4, 2, **self._ALIASES)
    with self.assertRaises(ConfigError) as raised:
      slurm.launch_fields(env, tasks=1)
    self.assertEqual((raised.exception.field, raised.exception.value),
                     ("--ntasks-per-node", 2))


class MalformedSlurmTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("procid_word", {"SLURM_PROCID": "abc"}, "SLURM_PROCID"),
      ("procid_negative", {"SLURM_PROCID": "-1"}, "SLURM_PROCID"),
      ("procid_too_big", {"SLURM_PROCID": "2"}, "SLURM_PROCID"),
      ("job_id_empty", {"SLURM_JOB_ID": ""}, "SLURM_JOB_ID"),
      ("job_id_word", {"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID"),
      ("step_id_word", {"SLURM_STEP_ID": "batch"}, "SLURM_STEP_ID"),
      ("nodelist_backwards", {"SLURM_STEP_NODELIST": "n[10-9]"},
       "SLURM_STEP_NODELIST"),
      ("nodelist_unclosed", {"SLURM_STEP_NODELIST": "n[9-10"},
       "SLURM_STEP_NODELIST"),
      ("nodelist_letters", {"SLURM_STEP_NODELIST": "n[9-x]"},
       "SLURM_STEP_NODELIST"),
      ("nodelist_empty", {"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST"),
      ("nodelist_duplicate", {"SLURM_STEP_NODELIST": "n9,n9"},
       "SLURM_STEP_NODELIST"),
      ("nodelist_missing", {"SLURM_STEP_NODELIST": None,
                            "SLURM_NODELIST": None,
                            "SLURM_JOB_NODELIST": None},
       "SLURM_STEP_NODELIST"),
      ("tasks_per_node_word", {"SLURM_STEP_TASKS_PER_NODE": "two"},
       "SLURM_STEP_TASKS_PER_NODE"),
      ("tasks_per_node_wrong_length", {"SLURM_STEP_TASKS_PER_NODE": "1(x3)"},
       "SLURM_STEP_TASKS_PER_NODE"),
      ("tasks_per_node_zero", {"SLURM_STEP_TASKS_PER_NODE": "0,2"},
       "SLURM_STEP_TASKS_PER_NODE"),
      ("tasks_per_node_missing", {"SLURM_STEP_TASKS_PER_NODE": None,
                                  "SLURM_TASKS_PER_NODE": None},
       "SLURM_STEP_TASKS_PER_NODE"),
      ("num_tasks_mismatch", {"SLURM_STEP_NUM_TASKS": "3"},
       "SLURM_STEP_NUM_TASKS"),
      ("num_nodes_mismatch", {"SLURM_STEP_NUM_NODES": "3"},
       "SLURM_STEP_NUM_NODES"),
      ("distribution_plane", {"SLURM_DISTRIBUTION": "plane",
                              "SLURM_DIST_PLANESIZE": "2"},
       "SLURM_DISTRIBUTION"),
      ("distribution_arbitrary", {"SLURM_DISTRIBUTION": "arbitrary"},
       "SLURM_DISTRIBUTION"),
      ("distribution_unknown", {"SLURM_DISTRIBUTION": "diagonal"},
       "SLURM_DISTRIBUTION"),
      ("nodename_disagrees", {"SLURMD_NODENAME": "n10"}, "SLURMD_NODENAME"),
      ("localid_disagrees", {"SLURM_LOCALID": "1"}, "SLURM_LOCALID"),
      ("localid_word", {"SLURM_LOCALID": "first"}, "SLURM_LOCALID"),
      ("port_base_word", {"TFDIST_PORT_BASE": "http"}, "TFDIST_PORT_BASE"),
      ("port_base_too_big", {"TFDIST_PORT_BASE": "70000"},
       "TFDIST_PORT_BASE"),
      ("port_base_zero", {"TFDIST_PORT_BASE": "0"}, "TFDIST_PORT_BASE"),
      ("gpus_on_node_word", {"SLURM_GPUS_ON_NODE": "two"},
       "SLURM_GPUS_ON_NODE"),
      ("step_gpus_word", {"SLURM_STEP_GPUS": "0,a"}, "SLURM_STEP_GPUS"),
      # Past Python's limit on int() of long digit strings.
      ("job_id_huge", {"SLURM_JOB_ID": "9" * 5000}, "SLURM_JOB_ID"),
      ("procid_huge", {"SLURM_PROCID": "1" * 5000}, "SLURM_PROCID"),
      ("port_base_huge", {"TFDIST_PORT_BASE": "9" * 5000},
       "TFDIST_PORT_BASE"),
  )
  def test_bad_variable(self, overrides, field):
    env = _step_env(**overrides)
    with self.assertRaises(ConfigError) as ctx:
      slurm.resolve_slurm(env)
    error = ctx.exception
    self.assertEqual(error.field, field)
    if env.get(field) is not None:
      self.assertEqual(error.value, env[field])
    self.assertIn("SLURM variables passed as environ", error.source)
    self.assertTrue(error.expected)

  @parameterized.named_parameters(
      ("env", {"TFDIST_PORT_BASE": "65535"}, None, "TFDIST_PORT_BASE"),
      ("argument", {}, 65535, "port_base"),
  )
  def test_no_room_for_ports(self, extra, port_base, field):
    env = _layout("n9", "2", 2, 1, **extra)
    with self.assertRaisesRegex(ConfigError, "room for 2 ports") as ctx:
      slurm.resolve_slurm(env, port_base=port_base)
    self.assertEqual(ctx.exception.field, field)

  @parameterized.named_parameters(
      ("sum_too_small", {"worker": 1}, None, "roles"),
      ("sum_too_big", {"chief": 1, "worker": 2}, None, "roles"),
      ("unknown_job", {"boss": 2}, None, "roles"),
      ("negative", {"worker": 3, "ps": -1}, None, "roles['ps']"),
      ("not_int", {"worker": 2.0}, None, "roles['worker']"),
      ("bool", {"worker": True, "ps": True}, None, "roles['worker']"),
      ("two_chiefs", {"chief": 2}, None, "roles['chief']"),
      ("two_evaluators", {"evaluator": 2}, None, "roles['evaluator']"),
      ("not_mapping", [("worker", 2)], None, "roles"),
      ("port_base_zero", None, 0, "port_base"),
      ("port_base_too_big", None, 70000, "port_base"),
      ("port_base_string", None, "8000", "port_base"),
      ("port_base_bool", None, True, "port_base"),
  )
  def test_bad_argument(self, roles, port_base, field):
    with self.assertRaises(ConfigError) as ctx:
      slurm.resolve_slurm(_step_env(), roles=roles, port_base=port_base)
    self.assertEqual(ctx.exception.field, field)
    self.assertIn("argument", ctx.exception.source)


class SlurmClusterResolverTest(absltest.TestCase):

  @pytest.mark.timeout(120)  # Imports TensorFlow.
  def test_resolver(self):
    resolver = tfdist.SlurmClusterResolver(
        environ=_layout("n[1-4]", "1(x4)", 4, 4, SLURM_PROCID="1",
                        SLURMD_NODENAME="n2"),
        roles={"chief": 1, "ps": 1, "worker": 2}, port_base=30000)
    self.assertEqual(resolver.cluster_spec().as_dict(), {
        "chief": ["n1:30000"], "ps": ["n2:30000"],
        "worker": ["n3:30000", "n4:30000"]})
    self.assertEqual((resolver.task_type, resolver.task_id), ("ps", 0))
    self.assertEqual(resolver.master(), "grpc://n2:30000")
    self.assertEqual(resolver.num_accelerators(), {})
    self.assertEqual(resolver.info.slurm.proc_id, 1)
    with self.assertRaises(TypeError):
      tfdist.SlurmClusterResolver(_step_env())  # pylint: disable=too-many-function-args
    with self.assertRaises(ConfigError):
      tfdist.SlurmClusterResolver(environ={})


# ------------------------------------------------------------ real SLURM.


# This machine's own name resolves, so TensorFlow can use it; n9 and n10 are
# extra slurmds on this machine for multi-node layouts.
_HOST = slurm_harness.local_node_name()
_NODES = (_HOST, "n9", "n10")


_SHARED = slurm_harness.SharedSlurm(nodes=_NODES, cpus=4)
_local_slurm = _SHARED.get
tearDownModule = _SHARED.stop  # pylint: disable=invalid-name


# Each task writes its SLURM variables to a file of its own: srun relays
# stdout in 1024-byte chunks, so long lines of two tasks can interleave.
_DUMP_ENV = ("import json, os, sys; json.dump({k: v for k, v in "
             "os.environ.items() if k.startswith(('SLURM', 'TFDIST'))}, "
             "open(os.path.join(sys.argv[1], os.environ['SLURM_PROCID']), 'w'))")

# Run by each srun task: tfdist resolves the step and builds the strategy
# ("auto" must pick MultiWorkerMirrored) before any other TF op.
_STRATEGY_SCRIPT = textwrap.dedent("""\
    import json, os
    import tfdist
    info = tfdist.resolve_cluster()
    strategy = tfdist.make_strategy("auto")
    import tensorflow as tf
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)

    @tf.function
    def replica_value():
      ctx = tf.distribute.get_replica_context()
      return tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)

    total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                            strategy.run(replica_value), axis=None)
    print("RESULT " + json.dumps({
        "procid": int(os.environ["SLURM_PROCID"]),
        "task_type": info.task_type, "task_id": info.task_id,
        "cluster": {k: list(v) for k, v in info.cluster.items()},
        "replicas": strategy.num_replicas_in_sync,
        "sum": float(total.numpy()),
    }), flush=True)
    """)


class RealSlurmTest(parameterized.TestCase):
  """srun on a real slurmctld/slurmd; tasks report what SLURM gave them."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.slurm = _local_slurm()

  def srun_envs(self, args):
    """Runs ``srun ARGS`` and returns each task's variables, by rank."""
    out = tempfile.mkdtemp(prefix="tfdist-srun-")
    self.addCleanup(shutil.rmtree, out, ignore_errors=True)
    result = self.slurm.srun([*args, sys.executable, "-c", _DUMP_ENV, out],
                             timeout=45)
    self.assertEqual(result.returncode, 0, result.stderr)
    envs = []
    for name in sorted(os.listdir(out), key=int):
      with open(os.path.join(out, name)) as f:
        envs.append(json.load(f))
    return envs

  @parameterized.named_parameters(
      ("block", ["-w", "n[9-10]", "-n", "5"]),
      ("block_explicit", ["-w", "n[9-10]", "-n", "6", "-m", "block"]),
      ("cyclic", ["-w", "n[9-10]", "-n", "5", "-m", "cyclic"]),
      ("cyclic_even", ["-w", "n[9-10]", "-n", "7", "-m", "cyclic:block"]),
      ("one_per_node", ["-w", f"{_HOST},n[9-10]", "-n", "3"]),
  )
  def test_layout_matches_slurm(self, args):
    envs = self.srun_envs(args)
    infos = [slurm.resolve_slurm(env) for env in envs]
    self.assertLen(infos, int(args[args.index("-n") + 1]))
    clusters = {json.dumps(dict(i.cluster), sort_keys=True) for i in infos}
    self.assertLen(clusters, 1)  # Every task sees the same cluster.
    for env, info in zip(envs, infos):
      host, port = info.address.rsplit(":", 1)
      self.assertEqual(host, env["SLURMD_NODENAME"])
      self.assertEqual(int(port), slurm.default_port_base(
          int(env["SLURM_JOB_ID"])) + int(env["SLURM_LOCALID"]))
      self.assertEqual(info.task_id, int(env["SLURM_PROCID"]))

  def test_batch_script_is_not_a_step(self):
    probe = ("import json, sys; from tfdist.cluster import slurm; "
             "print(json.dumps([slurm.in_slurm_job(), slurm.is_slurm_step()]))")
    script = textwrap.dedent(f"""\
        #!/bin/sh
        export PYTHONPATH={_REPO_ROOT}
        {sys.executable} -c "{probe}"
        srun -n 1 {sys.executable} -c "{probe}"
        """)
    _, output = self.slurm.sbatch(script, args=["-n", "1"], timeout=45)
    lines = [json.loads(l) for l in output.splitlines() if l.startswith("[")]
    self.assertEqual(lines, [[True, False], [True, True]], output)

  @pytest.mark.timeout(300)
  def test_multi_worker_mirrored_strategy(self):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
      f.write(_STRATEGY_SCRIPT)
    self.addCleanup(os.remove, f.name)
    env = {"PYTHONPATH": _REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = self.slurm.srun(["-w", _HOST, "-n", "2", sys.executable,
                              f.name], env=env, timeout=240)
    self.assertEqual(result.returncode, 0, result.stderr[-4000:])
    results = sorted((json.loads(line[len("RESULT "):])
                      for line in result.stdout.splitlines()
                      if line.startswith("RESULT ")),
                     key=lambda r: r["procid"])
    self.assertLen(results, 2, result.stdout)
    self.assertEqual(results[0]["cluster"], results[1]["cluster"])
    self.assertLen(results[0]["cluster"]["worker"], 2)
    for procid, r in enumerate(results):
      self.assertEqual(r["procid"], procid)
      self.assertEqual((r["task_type"], r["task_id"]), ("worker", procid))
      self.assertEqual(r["replicas"], 2)
      self.assertEqual(r["sum"], 3.0)  # (0 + 1) + (1 + 1).


if __name__ == "__main__":
  absltest.main()
