"""SLURM across nodes: one slurmd per host of the network-namespace test bed.

slurmctld runs in host ``ctl``, a slurmd in each of ``node1`` and ``node2``;
each node in slurm.conf has its own ``NodeAddr`` on 198.18.0.0/24. The node
names do not resolve anywhere (as on many clusters): tasks reach each other
at the ``NodeAddr`` that ``scontrol show node`` gives (`tfdist.cluster.names`).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest
import pytest

import cluster_utils
import fault_runs
import netbed
import slurm_harness
from tfdist.launch import sbatch as sbatch_lib

ALLREDUCE = os.path.join(cluster_utils.SCRIPTS, "allreduce.py")
PAYLOAD = os.path.join(cluster_utils.SCRIPTS, "slurm_payload.py")
KERAS_FIT = os.path.join(cluster_utils.SCRIPTS, "keras_fit.py")
_REASON = netbed.netbed_unavailable_reason() or (
    slurm_harness.slurm_unavailable_reason())
FAULT_JOB = os.path.join(cluster_utils.SCRIPTS, fault_runs.JOB)
TEMPLATE = os.path.join(cluster_utils.REPO, "cluster_configs",
                        sbatch_lib.template_name("multi_worker_mirrored"))
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
_ENV = {"PYTHONPATH": cluster_utils.REPO, "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2"}


def _json_lines(text: str) -> list[dict]:
  return [json.loads(line[line.index("{"):]) for line in text.splitlines()
          if "{" in line and line.rstrip().endswith("}")]


@pytest.mark.timeout(600)
@absltest.skipIf(_REASON is not None, _REASON)
class TwoNodeSlurmTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.bed = netbed.NetBed(hosts=("ctl", "node1", "node2"),
                            resolvable=False)
    cls.bed.start()
    try:
      cls.slurm = slurm_harness.LocalSlurm(bed=cls.bed, cpus=2)
      cls.slurm.start()
    except BaseException:
      cls.bed.close()
      raise

  @classmethod
  def tearDownClass(cls):
    cls.slurm.stop()
    cls.bed.close()
    super().tearDownClass()

  def test_node_names_resolve_nowhere_but_node_addr_does(self):
    r = self.slurm.srun(["-N", "2", "getent", "hosts", "node1"], timeout=60)
    self.assertNotEqual(r.returncode, 0, r.stdout)  # node2 cannot.
    r = self.slurm.srun(["-N", "2", sys.executable, "-c",
                         "from tfdist.cluster import names, resolve\n"
                         "print(names.resolve_names(resolve.resolve_cluster())"
                         ".cluster['worker'])"], env=_ENV, timeout=60)
    self.assertEqual(r.returncode, 0, r.stderr[-2000:])
    for line in r.stdout.splitlines():
      hosts = {a.rsplit(":", 1)[0] for a in eval(line)}  # A tuple's repr.
      self.assertEqual(hosts, {self.bed.address("node1"),
                               self.bed.address("node2")})

  def test_multi_worker_mirrored_all_reduce_across_two_nodes(self):
    # The generated script's srun: one task on each node.
    job, out = self.generated_sbatch_allreduce()
    results = _json_lines(out)
    self.assertLen(results, 2, out)
    for result in results:
      self.assertEqual((result["replicas"], result["sum"]), (2, 3.0), out)
      # resolve_cluster reads SLURM's node names; the strategy dialled
      # their NodeAddr, since the names resolve nowhere.
      hosts = {a.rsplit(":", 1)[0] for a in result["cluster"]["worker"]}
      self.assertEqual(hosts, {"node1", "node2"}, job)

  def test_two_tasks_per_node_train_with_fit(self):
    r = self.slurm.srun(["-N", "2", "--ntasks-per-node=2", sys.executable,
                         KERAS_FIT, "--strategy", "multi_worker_mirrored",
                         "--epochs", "1", "--steps", "3"], env=_ENV,
                        timeout=300)
    self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    results = _json_lines(r.stdout)
    self.assertLen(results, 4, r.stdout)
    self.assertTrue(all(x["ok"] for x in results), results)
    self.assertLen({round(x["checksum"], 6) for x in results}, 1, results)
    self.assertEqual({x["iterations"] for x in results}, {3})

  def test_parameter_server_roles_spread_across_nodes(self):
    r = self.slurm.srun(
        ["-N", "2", "--ntasks-per-node=2", "-m", "cyclic", sys.executable,
         PAYLOAD, "--strategy=parameter_server", "--payload_mode=strategy"],
        env={**_ENV, "TFDIST_SLURM_ROLES": "chief=1,ps=1,worker=2"},
        timeout=300)
    self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    results = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", r.stdout)]
    self.assertLen(results, 1, r.stdout)  # The chief; the servers serve.
    chief = results[0]
    self.assertEqual((chief["task_type"], chief["node"], chief["workers"]),
                     ("chief", "node1", 2))
    # Cyclic placement: ranks 0 (chief) and 2 (worker) on node1, 1 (ps) and
    # 3 (worker) on node2; the chief reached the ps on the other node.

  _allreduce: tuple[str, str] | None = None

  def generated_sbatch_allreduce(self) -> tuple[str, str]:
    """The job id and output of a `tfdist slurm` script (2 nodes, one task
    each) running allreduce.py; submitted once for the class's tests."""
    cls = type(self)
    if cls._allreduce is not None:
      return cls._allreduce
    with tempfile.TemporaryDirectory() as d:
      script = os.path.join(d, "job.sbatch")
      subprocess.run(
          [sys.executable, "-m", "tfdist", "slurm", "--preset",
           "multi_worker_mirrored", "--nodes", "2", "--tasks-per-node", "1",
           "--gpus-per-node", "0", "--cpus-per-task", "1", "--time",
           "00:10:00", "-o", script, "--", sys.executable, ALLREDUCE,
           "multi_worker_mirrored"], check=True, timeout=60,
          env=cluster_utils.base_env(), cwd=cluster_utils.REPO)
      os.chmod(d, 0o755)
      cls._allreduce = self.slurm.sbatch(script, args=[
          f"--export=ALL,PYTHONPATH={cluster_utils.REPO},"
          "TF_CPP_MIN_LOG_LEVEL=2"], timeout=300)
    return cls._allreduce

  def test_generated_sbatch_script_on_two_nodes(self):
    job, out = self.generated_sbatch_allreduce()
    results = _json_lines(out)
    self.assertLen(results, 2, out)
    for result in results:
      self.assertEqual(result["sum"], 3.0, out)
      hosts = {a.rsplit(":", 1)[0] for a in result["cluster"]["worker"]}
      self.assertEqual(hosts, {"node1", "node2"}, job)

  def _scontrol(self, *args: str) -> str:
    return subprocess.run(
        self.slurm.command(["scontrol", *args]), env=self.slurm.env,
        capture_output=True, text=True, timeout=30, check=False).stdout

  def _job(self, job: str) -> tuple[str, int, str]:
    record = self._scontrol("-o", "show", "job", job)
    field = lambda name: re.search(rf"\b{name}=(\S*)", record).group(1)
    return field("JobState"), int(field("Restarts")), field("NodeList")

  def _fault_job_requeued(self, directory, sbatch_args, *, ranks, drain):
    """fault_job.py's fit, preempted at step 2 and requeued once.

    Submits ``sbatch_args`` with the fault job (backup in DIRECTORY/backup)
    as TFDIST_COMMAND, waits until ``ranks`` tasks train, drains the node
    ``drain(nodelist)`` names, sends USR1 as ``--signal=B:USR1@N`` does and
    starts the requeued job at once.

    Returns:
      The first run's NodeList, the job's state, restarts and NodeList at
      its end, and the output of the first and the second run.
    """
    backup = os.path.join(directory, "backup")
    # TMPDIR: a worker killed at the requeue leaves its temporary save
    # directory (tfdist.training.chief) in the test's own, removed after.
    env = {**self.slurm.env, **_ENV, "SLURM_LABELIO": "1", "TMPDIR": directory,
           "TFDIST_COMMAND": f"{sys.executable} {FAULT_JOB} auto fit {backup}"}
    submitted = subprocess.run(self.slurm.command(
        ["sbatch", "--parsable", f"--chdir={directory}", *sbatch_args]),
                               env=env, capture_output=True, text=True,
                               timeout=30, check=False)
    self.assertEqual(submitted.returncode, 0, submitted.stderr)
    job = submitted.stdout.strip().split(";")[0]
    self.addCleanup(subprocess.run, self.slurm.command(["scancel", job]),
                    env=self.slurm.env, timeout=30, capture_output=True)
    output = os.path.join(directory, f"tfdist-mwms-{job}.out")

    def text():
      try:
        with open(output, errors="replace") as f:
          return f.read()
      except FileNotFoundError:
        return ""

    def wait(condition, what):
      if not cluster_utils.wait_until(condition, 240, interval=0.3):
        self.fail(f"timed out waiting for {what}: {self._job(job)}\n{text()}")

    wait(lambda: all(re.search(rf"(?m)^{r}: step 2$", text())
                     for r in range(ranks)), "step 2")
    state, _, first_nodes = self._job(job)
    self.assertEqual(state, "RUNNING")
    node = drain(first_nodes)
    self._scontrol("update", f"nodename={node}", "state=drain",
                   "reason=tfdist-test")
    self.addCleanup(self._scontrol, "update", f"nodename={node}",
                    "state=resume")
    subprocess.run(self.slurm.command(
        ["scancel", "--batch", "--signal=USR1", job]), env=self.slurm.env,
                   check=True, timeout=30)
    wait(lambda: self._job(job)[:2] == ("PENDING", 1), "the requeue")
    self.slurm.release_requeued(job)
    wait(lambda: self._job(job)[0] in _ENDED, "the second run")
    first, _, second = text().partition(f"tfdist: requeueing job {job}\n")
    return (first_nodes, *self._job(job), first, second)

  def test_a_requeue_lands_on_the_other_node_and_resumes_exactly(self):
    directory = tempfile.mkdtemp(prefix="tfdist-requeue-")
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    os.chmod(directory, 0o755)
    reference = fault_runs.reference()
    # The first node goes away for new work: the requeued job must move.
    first_node, state, restarts, second_node, first, second = (
        self._fault_job_requeued(
            directory, ["--nodes=1", "--ntasks-per-node=1",
                        "--gpus-per-node=0", "--cpus-per-task=1", TEMPLATE],
            ranks=1, drain=lambda nodes: nodes))
    self.assertEqual((state, restarts), ("COMPLETED", 1), first + second)
    self.assertNotEqual(second_node, first_node)
    saved = re.search(r"checkpoint saved at step (\d+) in \S+; exiting with "
                      r"code 42", first)
    self.assertIsNotNone(saved, first)
    step = int(saved.group(1))
    steps = [int(s) for s in re.findall(r"(?m)^0: step (\d+)$", second)]
    self.assertEqual(steps, list(range(step + 1, fault_runs.STEPS + 1)),
                     second)
    result = json.loads(re.search(r"(?m)^0: (\{.*\})$", second).group(1))
    fault_runs.assert_like(self, result, reference)

  def test_a_preempted_two_node_run_resumes_on_the_node_left(self):
    # `tfdist slurm --nodes 1-2`: both nodes at first; node1 (the chief's) is
    # drained while the run saves and is requeued, so SLURM grants node2
    # alone, and training goes on there from the backup of two workers.
    directory = tempfile.mkdtemp(prefix="tfdist-resize-")
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    os.chmod(directory, 0o755)
    reference = fault_runs.reference()
    script = os.path.join(directory, "job.sbatch")
    subprocess.run(
        [sys.executable, "-m", "tfdist", "slurm", "--preset",
         "multi_worker_mirrored", "--nodes", "1-2", "--gpus-per-node", "0",
         "--cpus-per-task", "1", "--time", "00:10:00", "-o", script],
        check=True, timeout=60, env=cluster_utils.base_env(),
        cwd=cluster_utils.REPO)
    first_nodes, state, restarts, second_nodes, first, second = (
        self._fault_job_requeued(directory, [script], ranks=2,
                                 drain=lambda nodes: "node1"))
    print(f"second run on {second_nodes}:\n{second[-3000:]}")
    self.assertEqual(first_nodes, "node[1-2]")
    self.assertEqual((state, restarts, second_nodes),
                     ("COMPLETED", 1, "node2"), first + second)
    saved = dict(re.findall(
        r"(?m)^(\d+): .*checkpoint saved at step (\d+) in \S+; exiting with "
        r"code 42",
        first))
    self.assertEqual(sorted(saved), ["0", "1"], first)
    self.assertLen(set(saved.values()), 1, saved)  # One agreed step.
    self.assertNotRegex(second, r"(?m)^1: ")  # One task now.
    steps = [int(s) for s in re.findall(r"(?m)^0: step (\d+)$", second)]
    self.assertEqual(steps, list(range(int(saved["0"]) + 1,
                                       fault_runs.STEPS + 1)), second)
    result = json.loads(re.search(r"(?m)^0: (\{.*\})$", second).group(1))
    # As every fault test: 1e-5 absolute, on weights of order 1 (one weight
    # near zero was 7e-5 apart relatively, 6e-8 absolutely, once).
    fault_runs.assert_like(self, result, reference)

if __name__ == "__main__":
  absltest.main()
