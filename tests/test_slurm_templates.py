"""Tests for cluster_configs/*.sbatch, tfdist.launch.sbatch and `tfdist slurm`.

The templates are submitted with sbatch to a real local SLURM (two slurmd
nodes on this machine, see slurm_harness.py) with ``TFDIST_COMMAND`` set to
tests/scripts/slurm_payload.py, and the tasks' output is read back. The toy
cluster has no GPUs and 4 CPUs per node, so the tests override
``--gpus-per-node=0`` and ``--cpus-per-task=1`` on sbatch's command line
(which wins over #SBATCH lines); the test names say so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import slurm_harness
import stalls
from tfdist import launch
from tfdist.cli import main as cli_main
from tfdist.cluster import slurm as slurm_lib
from tfdist.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIGS = os.path.join(_REPO, "cluster_configs")
_PAYLOAD = os.path.join(_REPO, "tests", "scripts", "slurm_payload.py")


def _template(preset: str) -> str:
  return os.path.join(_CONFIGS, launch.template_name(preset))


class TemplatesInSyncTest(parameterized.TestCase):

  @parameterized.named_parameters((n, n) for n in sorted(launch.PRESETS))
  def test_file_is_what_render_gives(self, preset):
    with open(_template(preset)) as f:
      text = f.read()
    self.assertEqual(
        text, launch.render(launch.PRESETS[preset]),
        f"cluster_configs/{launch.template_name(preset)} is out of sync"
        " with tfdist.launch.sbatch.PRESETS; regenerate it with `tfdist slurm "
        f"--preset {preset} -o FILE`")

  @parameterized.named_parameters((n, n) for n in sorted(launch.PRESETS))
  def test_requeue_signal_and_output(self, preset):
    with open(_template(preset)) as f:
      text = f.read()
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --output=%x-%j.out", "trap on_usr1 USR1",
                 'scontrol requeue "${job}"',
                 'job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
                 "if (( requeue && status == 42 )); then"):
      self.assertIn(line, [l.strip() for l in text.splitlines()])
    self.assertRegex(text, r"(?m)^#SBATCH --signal=B:USR1@\d+$")
    self.assertRegex(
        text, r'(?m)^srun .*--ntasks-per-node=1 .*--kill-on-bad-exit=0 tfdist '
              r'launch .*-- "\$\{command\[@\]\}" &$')
    check = subprocess.run(["bash", "-n", _template(preset)],
                           capture_output=True, text=True, check=False)
    self.assertEqual(check.returncode, 0, check.stderr)

  @parameterized.named_parameters((n, n) for n in sorted(launch.PRESETS))
  def test_header_names_its_generator(self, preset):
    with open(_template(preset)) as f:
      generator = re.search(r"^# Written by `tfdist slurm` \((\S+)\.(\w+)\)",
                            f.read(), re.M)
    self.assertIsNotNone(generator)
    module = importlib.import_module(generator.group(1))
    self.assertIs(getattr(module, generator.group(2)), launch.render)

  def test_cluster_configs_has_only_the_presets_and_readme(self):
    self.assertCountEqual(
        os.listdir(_CONFIGS),
        ["README.md"] + [launch.template_name(p)
                         for p in launch.PRESETS])


class SbatchSpecTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("zero_nodes", {"nodes": 0}, "nodes"),
      ("bool_nodes", {"nodes": True}, "nodes"),
      ("negative_gpus", {"gpus_per_node": -1}, "gpus_per_node"),
      ("zero_cpus", {"cpus_per_task": 0}, "cpus_per_task"),
      ("zero_tasks", {"tasks_per_node": 0}, "tasks_per_node"),
      ("bad_time", {"time": "4h"}, "time"),
      ("zero_time", {"time": "0"}, "time"),
      ("signal_after_limit", {"time": "5", "signal_seconds": 300},
       "signal_seconds"),
      ("signal_zero", {"signal_seconds": 0}, "signal_seconds"),
      ("name_with_space", {"job_name": "my job"}, "job_name"),
      ("name_injection", {"job_name": "x\n#SBATCH --nodes=99"}, "job_name"),
      ("partition_with_semicolon", {"partition": "gpu;rm"}, "partition"),
      ("empty_command", {"command": ()}, "command"),
      ("command_string", {"command": "python train.py"}, "command"),
      ("roles_wrong_total", {"nodes": 2, "roles": "chief=1,ps=1,worker=1"},
       "roles"),
      ("roles_unknown_job", {"roles": "boss=1"}, "roles"),
      ("roles_two_chiefs", {"nodes": 2, "roles": "chief=2"}, "roles"),
      ("roles_repeated", {"nodes": 2, "roles": "worker=1,worker=1"}, "roles"),
      ("requeue_not_bool", {"requeue": "yes"}, "requeue"),
      ("nodes_beyond_slurm", {"nodes": 10**12}, "nodes"),
      ("cpus_beyond_slurm", {"cpus_per_task": 70000}, "cpus_per_task"),
      ("tasks_beyond_slurm", {"tasks_per_node": 65533, "nodes": 2**31},
       "tasks_per_node"),
      ("time_beyond_slurm", {"time": "99999999999"}, "time"),
      ("name_trailing_newline", {"job_name": "x\n"}, "job_name"),
      ("partition_trailing_newline", {"partition": "gpu\n"}, "partition"),
      ("command_with_nul", {"command": ("python", "t.py\0")}, "command"),
      ("sbatch_option_without_dash", {"sbatch_options": ("account=x",)},
       "sbatch_options"),
      ("sbatch_option_injection", {"sbatch_options": ("--a=1\nrm -rf x",)},
       "sbatch_options"),
      ("sbatch_options_string", {"sbatch_options": "--account=x"},
       "sbatch_options"),
      ("setup_empty_line", {"setup": ("",)}, "setup"),
      ("setup_two_lines", {"setup": ("module load a\nmodule load b",)},
       "setup"),
      ("max_requeues_negative", {"max_requeues": -1}, "max_requeues"),
      ("requeue_from_unknown", {"requeue_from": "shell"}, "requeue_from"),
      ("requeue_from_task_without_requeue",
       {"requeue_from": "task", "requeue": False}, "requeue_from"),
      ("node_range_reversed", {"nodes": "3-2"}, "nodes"),
      ("node_range_from_zero", {"nodes": "0-2"}, "nodes"),
      ("node_range_of_letters", {"nodes": "a-b"}, "nodes"),
      ("node_range_open", {"nodes": "2-"}, "nodes"),
      ("node_range_with_roles", {"nodes": "1-2", "roles": "worker=2"},
       "nodes"),
  )
  def test_invalid(self, changes, field):
    with self.assertRaises(ConfigError) as e:
      launch.SbatchSpec(**changes)
    self.assertEqual(e.exception.field, field)

  @parameterized.named_parameters(
      ("minutes", "30", 1800), ("minutes_seconds", "1:30", 90),
      ("hms", "04:00:00", 14400), ("days_hours", "1-2", 93600),
      ("days_hm", "1-02:30", 95400), ("days_hms", "0-00:00:10", 10))
  def test_parse_time(self, text, seconds):
    self.assertEqual(launch.parse_time(text), seconds)

  @parameterized.named_parameters(
      ("range", "1-4", 1, "--nodes=1-4\n#SBATCH --cpus-per-task=1",
       "--nnodes 1:4 "),
      ("range_two_tasks_a_node", "1-4", 2,
       "--nodes=1-4\n#SBATCH --mincpus=2\n", "--nnodes 1:4 "),
      ("one_size", "2-2", 2, "--nodes=2\n#SBATCH --ntasks-per-node=2\n", ""),
      ("count", 3, 1, "--nodes=3\n#SBATCH --ntasks-per-node=1\n", ""))
  def test_nodes_as_slurm_writes_them(self, nodes, per_node, sbatch, elastic):
    """One launcher a node, starting the node's tasks; a range is elastic
    and survives a lost node (--no-kill)."""
    text = launch.render(launch.SbatchSpec(nodes=nodes,
                                           tasks_per_node=per_node))
    self.assertIn(f"\n#SBATCH {sbatch}", text)
    self.assertIn(f"\ntasks=${{SLURM_NTASKS_PER_NODE:-{per_node}}}\n", text)
    self.assertIn(
        '\nsrun --ntasks="${SLURM_JOB_NUM_NODES}" --ntasks-per-node=1 '
        "--cpus-per-task=$(( "
        "${SLURM_CPUS_PER_TASK:-1} * tasks )) --kill-on-bad-exit=0 tfdist "
        f'launch --workers "${{tasks}}" {elastic}-- "${{command', text)
    self.assertEqual("#SBATCH --no-kill\n" in text, bool(elastic))

  def test_roles_are_normalized_and_exported(self):
    spec = launch.SbatchSpec(nodes=2, tasks_per_node=2,
                             roles=" chief=1, ps=1 ,worker=2")
    self.assertEqual(spec.roles, "chief=1,ps=1,worker=2")
    text = launch.render(spec)
    self.assertIn("export TFDIST_SLURM_ROLES=chief=1,ps=1,worker=2\n", text)
    self.assertIn(' tfdist launch --workers "${tasks}" -- ', text)

  def test_command_is_shell_quoted(self):
    spec = launch.SbatchSpec(command=("python", "t.py", "--x=a b", "$HOME"))
    self.assertIn("  command=(python t.py '--x=a b' '$HOME')\n",
                  launch.render(spec))

  def test_no_requeue_and_no_gpus(self):
    text = launch.render(launch.SbatchSpec(requeue=False))
    self.assertIn("#SBATCH --no-requeue\n", text)
    self.assertNotIn("#SBATCH --requeue", text)
    self.assertNotIn("--gpus-per-node", text)
    self.assertIn("  requeue=0\n", text)

  @parameterized.named_parameters(
      ("fresh", {}, None), ("kept_from_submit", {"TFDIST_JOB_SECRET": "mine"},
                            "mine"))
  def test_secret_is_exported_before_srun(self, env, kept):
    """The export line, run by bash: 64 hex digits, new each run."""
    text = launch.render(launch.SbatchSpec())
    lines = text.splitlines()
    export, = [l for l in lines if l.startswith("export TFDIST_JOB_SECRET=")]
    srun = next(i for i, l in enumerate(lines) if l.startswith("srun "))
    self.assertLess(lines.index(export), srun)
    self.assertNotIn("TFDIST_JOB_SECRET", lines[srun])  # Not in argv.
    script = f"set -uo pipefail\n{export}\nprintf %s \"$TFDIST_JOB_SECRET\""
    base = {k: v for k, v in os.environ.items() if k != "TFDIST_JOB_SECRET"}
    secrets = [subprocess.run(["bash", "-c", script], env={**base, **env},
                              capture_output=True, text=True, timeout=30,
                              check=True).stdout for _ in range(2)]
    if kept:
      self.assertEqual(secrets, [kept, kept])
    else:
      self.assertRegex(secrets[0], r"^[0-9a-f]{64}$")
      self.assertNotEqual(secrets[0], secrets[1])

  @parameterized.named_parameters(("capped", 2), ("uncapped", None))
  def test_requeue_from_task_signals_the_tasks_and_exports_the_rule(self, cap):
    path = os.path.join(_tempdir(self), "task.sbatch")
    with open(path, "w") as f:
      f.write(launch.render(launch.SbatchSpec(requeue_from="task",
                                              max_requeues=cap)))
    with open(path) as f:
      lines = f.read().splitlines()
    self.assertIn("#SBATCH --signal=USR1@300", lines)
    self.assertIn("#SBATCH --requeue", lines)
    self.assertIn("export TFDIST_SLURM_REQUEUE=1", lines)
    self.assertEqual("export TFDIST_SLURM_MAX_REQUEUES=2" in lines,
                     cap is not None)
    self.assertFalse([l for l in lines if "scontrol" in l and
                      not l.startswith("#")])  # The chief task requeues.
    self.assertEqual(lines[-1], 'exit "${status}"')
    check = subprocess.run(["bash", "-n", path], capture_output=True,
                           text=True, check=False)
    self.assertEqual(check.returncode, 0, check.stderr)

  @parameterized.named_parameters(("requeue", True), ("no_requeue", False))
  def test_requeue_from_script_keeps_the_tasks_from_requeueing(self, requeue):
    text = launch.render(launch.SbatchSpec(requeue=requeue))
    self.assertIn("\nexport TFDIST_SLURM_REQUEUE=0\n", text)
    self.assertIn("#SBATCH --signal=B:USR1@300\n", text)

  def test_spec_is_frozen(self):
    with self.assertRaises(dataclasses.FrozenInstanceError):
      launch.PRESETS["cpu_only"].nodes = 3  # type: ignore[misc]


def _tempdir(test: absltest.TestCase) -> str:
  """A temporary directory removed after ``test`` (pytest leaves absl's
  --test_tmpdir unparsed, so create_tempdir is not available)."""
  directory = tempfile.mkdtemp(prefix="tfdist-templates-")
  test.addCleanup(shutil.rmtree, directory, ignore_errors=True)
  return directory


class SlurmCliTest(parameterized.TestCase):
  """`tfdist slurm`, run in-process through tfdist.cli.main.main."""

  def run_cli(self, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        code = cli_main.main(["slurm", *argv])
      except SystemExit as e:
        code = e.code
    return code, out.getvalue(), err.getvalue()

  def test_prints_the_script(self):
    code, out, err = self.run_cli(
        ["--nodes", "3", "--gpus-per-node", "8", "--job-name", "big",
         "--time", "2-00:00:00", "--partition", "gpu", "--signal-seconds",
         "600", "--", "python", "-m", "my.train", "--epochs=9"])
    self.assertEqual((code, err), (0, ""))
    self.assertEqual(out, launch.render(launch.SbatchSpec(
        job_name="big", nodes=3, gpus_per_node=8, time="2-00:00:00",
        partition="gpu", signal_seconds=600,
        command=("python", "-m", "my.train", "--epochs=9"))))

  @parameterized.named_parameters((n, n) for n in sorted(launch.PRESETS))
  def test_preset_writes_the_template(self, preset):
    path = os.path.join(_tempdir(self), "job.sbatch")
    code, out, err = self.run_cli(["--preset", preset, "-o", path])
    self.assertEqual((code, out, err), (0, "", ""))
    with open(path) as f, open(_template(preset)) as g:
      self.assertEqual(f.read(), g.read())

  def test_extra_lines_cap_and_a_warning_for_srun_in_srun(self):
    code, out, err = self.run_cli(
        ["--sbatch-option=--account=abc", "--sbatch-option=--qos=low",
         "--setup", "module load cuda", "--setup", "source venv/bin/activate",
         "--max-requeues", "3", "--", "srun", "python", "t.py"])
    self.assertEqual(code, 0, err)
    self.assertIn("#SBATCH --signal=B:USR1@300\n#SBATCH --account=abc\n"
                  "#SBATCH --qos=low\n", out)
    self.assertIn("\nmodule load cuda\nsource venv/bin/activate\n", out)
    self.assertLess(out.index("source venv/bin/activate"), out.index("srun "))
    self.assertIn("${SLURM_RESTART_COUNT:-0} >= 3", out)
    self.assertEqual(err.count("\n"), 1)
    self.assertStartsWith(err, "tfdist: warning: the command runs srun")

  def test_node_range(self):
    code, out, err = self.run_cli(["--nodes", "1-4"])
    self.assertEqual((code, err), (0, ""))
    self.assertEqual(out, launch.render(launch.SbatchSpec(nodes="1-4")))
    self.assertIn("\n#SBATCH --nodes=1-4\n", out)

  def test_requeue_from_task(self):
    code, out, err = self.run_cli(["--requeue-from", "task",
                                   "--max-requeues", "2"])
    self.assertEqual((code, err), (0, ""))
    self.assertEqual(out, launch.render(launch.SbatchSpec(
        requeue_from="task", max_requeues=2)))

  def test_preset_with_overrides(self):
    code, out, _ = self.run_cli(["--preset", "parameter_server", "--nodes",
                                 "3", "--roles", "chief=1,ps=2,worker=3",
                                 "--no-requeue"])
    self.assertEqual(code, 0)
    self.assertIn("export TFDIST_SLURM_ROLES=chief=1,ps=2,worker=3\n", out)
    self.assertIn("#SBATCH --no-requeue\n", out)

  @parameterized.named_parameters(
      ("zero_nodes", ["--nodes", "0"], "nodes"),
      ("not_an_int", ["--nodes", "two"], "nodes"),
      ("node_range_reversed", ["--nodes", "3-2"], "3-2"),
      ("node_range_from_zero", ["--nodes", "0-2"], "0-2"),
      ("node_range_of_letters", ["--nodes", "a-b"], "a-b"),
      ("unknown_preset", ["--preset", "huge"], "--preset"),
      ("bad_time", ["--time", "soon"], "time"),
      ("roles_do_not_add_up", ["--roles", "chief=1,ps=1,worker=2"], "roles"),
      ("signal_longer_than_time", ["--time", "10", "--signal-seconds",
                                   "900"], "--signal-seconds"),
      ("unknown_option", ["--gpus", "2"], "--gpus"),
      ("program_without_dashes", ["python", "t.py"], "python t.py"),
      ("output_dir_missing", ["-o", "/nonexistent-dir/x.sbatch"], "--output"),
      ("requeue_from_unknown", ["--requeue-from", "shell"], "--requeue-from"),
      ("requeue_from_task_without_requeue",
       ["--requeue-from", "task", "--no-requeue"], "--requeue-from"),
  )
  def test_bad_flags_exit_2_with_one_line_and_write_nothing(self, argv, word):
    directory = _tempdir(self)
    path = os.path.join(directory, "job.sbatch")
    if "-o" not in argv:
      argv = [*argv, "-o", path]
    code, out, err = self.run_cli(argv)
    self.assertEqual(code, 2)
    self.assertEqual(out, "")
    self.assertLen(err.strip().splitlines(), 1, err)
    self.assertStartsWith(err, "tfdist: ")
    self.assertIn(word, err)
    self.assertEqual(os.listdir(directory), [])


# ------------------------------------------------------------ real SLURM.

_HOST = slurm_harness.local_node_name()
_NODES = (_HOST, "n9")


_SHARED = slurm_harness.SharedSlurm(nodes=_NODES, cpus=4)
_local_slurm = _SHARED.get
tearDownModule = _SHARED.stop  # pylint: disable=invalid-name


def _results(output: str) -> list[dict]:
  """Each task's RESULT line (after the launcher's ``[ROLE] ``), by round,
  node (the launcher's SLURM_PROCID) and task."""
  return sorted(
      (json.loads(line.partition("RESULT ")[2])
       for line in output.splitlines() if "RESULT {" in line),
      key=lambda r: (r["restart"], r["procid"],
                     ("chief", "ps", "worker").index(r.get("task_type",
                                                           "worker")),
                     r.get("task_id", 0), "usr1" in r))


def _payload(mode: str, *flags: str) -> str:
  return " ".join([sys.executable, _PAYLOAD, f"--payload_mode={mode}", *flags])


class TemplatesOnRealSlurmTest(parameterized.TestCase):
  """sbatch each template; the tasks report the cluster tfdist resolved."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.slurm = _local_slurm()

  def submit(self, preset, args, command, timeout=60):
    env = {"TFDIST_COMMAND": command, "PYTHONPATH": _REPO,
           "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    with mock.patch.dict(self.slurm.env, env):
      job_id, output = self.slurm.sbatch(_template(preset), args=args,
                                         timeout=timeout)
    return int(job_id), output

  def assert_workers(self, results, num_nodes):
    """One worker per node: node r's launcher (srun's rank r) started
    worker r, and every task has the same cluster of ``num_nodes``."""
    nodes = [r["node"] for r in results]
    self.assertLen(set(nodes), num_nodes)
    self.assertLen(nodes, num_nodes)
    self.assertContainsSubset(nodes, _NODES)
    for rank, r in enumerate(results):
      self.assertEqual((r["procid"], r["task_type"], r["task_id"]),
                       (rank, "worker", rank))
      self.assertLen(r["cluster"]["worker"], num_nodes)
      self.assertEqual(r["cluster"], results[0]["cluster"])

  @parameterized.named_parameters(
      ("fits", dict(cpus_per_task=2, tasks_per_node=2), None),
      ("too_many_cpus", dict(cpus_per_task=3, tasks_per_node=2),
       "cpus_per_task"),
      ("gpus_on_cpu_nodes", dict(gpus_per_node=1), "gpus_per_node"),
  )
  def test_requests_are_checked_against_the_partition(self, changes, field):
    spec = launch.SbatchSpec(partition="debug", **changes)
    problem = launch.sbatch.fits_problem(spec, environ=self.slurm.env)
    self.assertEqual(problem and problem[0], field, problem)
    if field:
      self.assertIn("partition debug", problem[1])

  def test_single_node_gpus_without_gres(self):
    job_id, output = self.submit(
        "single_node_gpus", ["--gpus-per-node=0", "--cpus-per-task=1"],
        _payload("resolve"))
    self.assert_workers(_results(output), 1)

  def test_multi_worker_mirrored_without_gres_resolves_two_nodes(self):
    job_id, output = self.submit(
        "multi_worker_mirrored", ["--gpus-per-node=0", "--cpus-per-task=1"],
        _payload("resolve", "--strategy=auto"))
    self.assert_workers(_results(output), 2)

  @parameterized.named_parameters(("both_free", False, 1, 2),
                                  ("one_drained", True, 1, 1),
                                  ("two_tasks_a_node", False, 2, 2))
  def test_a_node_range_runs_at_the_size_slurm_grants(self, drain, per_node,
                                                      granted):
    if drain:
      scontrol = lambda state: subprocess.run(
          ["scontrol", "update", f"nodename={_NODES[1]}", f"state={state}",
           "reason=tfdist-test"], env=self.slurm.env, check=True, timeout=30)
      scontrol("drain")
      self.addCleanup(scontrol, "resume")
    spec = dataclasses.replace(launch.PRESETS["multi_worker_mirrored"],
                               nodes="1-2", tasks_per_node=per_node,
                               gpus_per_node=0, cpus_per_task=1)
    env = {"TFDIST_COMMAND": _payload("resolve", "--strategy=auto"),
           "PYTHONPATH": _REPO, "PYTHONUNBUFFERED": "1"}
    # The controller schedules at its next tick: what it grants then is what
    # is idle then (a node just resumed or just freed may not be yet).
    self.slurm.wait_idle(_NODES[:granted])
    with mock.patch.dict(self.slurm.env, env):
      _, output = self.slurm.sbatch(launch.render(spec), timeout=60)
    results = _results(output)
    self.assertEqual([(r["procid"], r["task_id"]) for r in results],
                     [(i // per_node, i) for i in range(granted * per_node)],
                     output)
    self.assertLen({r["node"] for r in results}, granted)
    for r in results:  # Each task resolved the cluster SLURM granted.
      self.assertLen(r["cluster"]["worker"], granted * per_node)

  def test_parameter_server_roles_on_two_nodes(self):
    # Each node's launcher starts its share of the roles in rank order.
    _, output = self.submit("parameter_server", ["--cpus-per-task=1"],
                            _payload("resolve"))
    results = _results(output)
    self.assertLen(results, 4, output)
    first, second = results[0]["node"], results[2]["node"]  # SLURM's order.
    self.assertCountEqual([first, second], _NODES)
    self.assertEqual(
        [(r["procid"], r["node"], r["task_type"], r["task_id"])
         for r in results],
        [(0, first, "chief", 0), (0, first, "ps", 0),
         (1, second, "worker", 0), (1, second, "worker", 1)], output)
    for r in results:
      self.assertEqual(r["cluster"], results[0]["cluster"])
      self.assertEqual({k: len(v) for k, v in r["cluster"].items()},
                       {"chief": 1, "ps": 1, "worker": 2})

  # The two "nodes" share one machine and so the ports SLURM's rank layout
  # gives them; a real two-task TensorFlow cluster runs on one node here.
  def test_cpu_only_builds_multi_worker_mirrored_on_one_node(self):
    _, output = self.submit(
        "cpu_only",
        ["--nodes=1", f"--nodelist={_HOST}", "--ntasks-per-node=2",
         "--cpus-per-task=1"],
        _payload("strategy", "--strategy=multi_worker_mirrored",
                 "--all_reduce_alg=ring"), timeout=100)
    results = _results(output)
    self.assertLen(results, 2, output[-3000:])
    for rank, r in enumerate(results):
      self.assertTrue(r["mwms"], r)
      self.assertEqual((r["task_type"], r["task_id"]), ("worker", rank))
      self.assertEqual((r["replicas"], r["workers"], r["sum"]), (2, 2, 3.0))

  def test_usr1_reaches_every_task_and_the_job_is_requeued(self):
    """USR1 to the batch shell (as --signal=B: does) -> tasks, then requeue.

    ``scancel --batch --signal=USR1`` sends what SLURM sends at the
    ``--signal`` time, without waiting for a time limit. SLURM holds a
    requeued job for a while before it may start again; the test starts it
    at once (`slurm_harness.LocalSlurm.release_requeued`) to see the second
    run.
    """
    out_dir = _tempdir(self)
    output_path = os.path.join(out_dir, "job-%j.out")
    env = dict(self.slurm.env, TFDIST_COMMAND=_payload("signal"),
               PYTHONPATH=_REPO, PYTHONUNBUFFERED="1")
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={output_path}",
         f"--chdir={out_dir}", "--cpus-per-task=1",
         _template("cpu_only")], env=env, capture_output=True, text=True,
        timeout=30, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    output_path = output_path.replace("%j", job_id)
    self.addCleanup(subprocess.run, ["scancel", job_id], env=env,
                    capture_output=True, timeout=30, check=False)

    def scontrol(*args):
      return subprocess.run(["scontrol", *args], env=env, capture_output=True,
                            text=True, timeout=30, check=False).stdout

    def read_output():
      if not os.path.exists(output_path):
        return ""
      with open(output_path, errors="replace") as f:
        return f.read()

    signalled = released = False
    start = time.monotonic()
    while True:
      self.assertFalse(stalls.expired(start, 90),
                      f"job {job_id} not done\n{scontrol('show', 'job', job_id)}"
                      f"\n{read_output()}")
      job = scontrol("-o", "show", "job", job_id)
      state = re.search(r"JobState=(\S+)", job).group(1)
      restarts = int(re.search(r"Restarts=(\d+)", job).group(1))
      if state == "COMPLETED":
        break
      if (not signalled and state == "RUNNING"
          and read_output().count('"waiting": true') == 2):
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id],
                       env=env, check=True, timeout=30)
        signalled = True
      if not released and restarts and state == "PENDING":
        self.slurm.release_requeued(job_id)
        released = True
      time.sleep(0.3)

    output = read_output()
    first = [r for r in _results(output) if r["restart"] == 0]
    second = [r for r in _results(output) if r["restart"] == 1]
    self.assertEqual([(r["procid"], r["usr1"]) for r in first if "usr1" in r],
                     [(0, True), (1, True)], output)
    self.assertIn(f"tfdist: requeueing job {job_id}", output)
    self.assertEqual([(r["procid"], r["usr1"]) for r in second],
                     [(0, False), (1, False)], output)


if __name__ == "__main__":
  absltest.main()
