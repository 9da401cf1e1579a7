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

ALLREDUCE = os.path.join(cluster_utils.SCRIPTS, "allreduce.py")
PAYLOAD = os.path.join(cluster_utils.SCRIPTS, "slurm_payload.py")
KERAS_FIT = os.path.join(cluster_utils.SCRIPTS, "keras_fit.py")
_REASON = netbed.netbed_unavailable_reason() or (
    slurm_harness.slurm_unavailable_reason())
FAULT_JOB = os.path.join(cluster_utils.SCRIPTS, fault_runs.JOB)
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
_ENV = {"PYTHONPATH": cluster_utils.REPO, "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2"}


#: What each task learns of its job, as one JSON line.
FACTS = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
         "print(json.dumps({k: os.environ.get(k) for k in ('TFDIST_NNODES', "
         "'TFDIST_RUN_ID', 'TFDIST_RESTART', 'TFDIST_RESTART_COUNT', "
         "'TFDIST_MAX_RESTARTS', 'SLURM_JOB_ID')} | c))")
#: Worker 1 fails at once; worker 0 would sleep for 10 minutes.
ONE_FAILS = ("import json, os, sys, time; "
             "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
             "time.sleep(1 if i else 600); sys.exit(3)")
STALL_JOB = os.path.join(cluster_utils.SCRIPTS, "stall_job.py")


def _job_script(path: str, *, nodes: str) -> str:
  """Writes `tfdist slurm`'s multi_worker_mirrored script for ``nodes``
  (CPU only, one CPU a task) at ``path``."""
  subprocess.run(
      [sys.executable, "-m", "tfdist", "slurm", "--preset",
       "multi_worker_mirrored", "--nodes", nodes, "--gpus-per-node", "0",
       "--cpus-per-task", "1", "--time", "00:10:00", "-o", path],
      check=True, timeout=60, env=cluster_utils.base_env(),
      cwd=cluster_utils.REPO)
  return path


def _sleep_line() -> int:
  """The line of stall_job.py where worker K sleeps (``SLEEP_LINE``)."""
  with open(STALL_JOB) as f:
    return next(i for i, line in enumerate(f, 1)
                if "SLEEP_LINE" in line and "time.sleep" in line)
#: In round 0 worker 2 kills its node's launcher (a lost node); every other
#: task waits to be stopped. In later rounds each says what it sees.
ELASTIC_TASK = """import json, os, signal, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
if os.environ["TFDIST_RESTART"] == "0":
  if task["index"] == 2:
    os.kill(os.getppid(), signal.SIGKILL)
  time.sleep(600)
print(json.dumps({k: os.environ[k] for k in (
    "TFDIST_NNODES", "TFDIST_RESTART", "TFDIST_RESTART_COUNT")}), flush=True)
"""


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
      # Each node's launcher wrote TF_CONFIG with the nodes' NodeAddr, since
      # their names resolve nowhere.
      hosts = {a.rsplit(":", 1)[0] for a in result["cluster"]["worker"]}
      self.assertEqual(hosts, self._addresses(), job)

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
    self.assertEqual(out.count(f"tfdist: from SLURM job {job}: --nnodes 2 "),
                     2, out)

  def _addresses(self, nodes=("node1", "node2")) -> set[str]:
    return {self.bed.address(n) for n in nodes}

  def _launch(self, *args: str, srun=("-N", "2"), env=None, timeout=120):
    """``srun SRUN tfdist launch ARGS`` (one launcher a node unless SRUN
    says otherwise), its output as text."""
    return self.slurm.srun(
        [*srun, "--kill-on-bad-exit=0", "tfdist", "launch", *args],
        env={**_ENV, "TFDIST_JOB_SECRET": "slurm-bed-secret", **(env or {})},
        timeout=timeout)

  def test_one_launcher_a_node_takes_its_members_and_facts_from_slurm(self):
    r = self._launch("--workers", "2", "--", sys.executable, "-c", FACTS)
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    facts = _json_lines(r.stdout)
    self.assertLen(facts, 4, r.stdout)
    job = facts[0]["SLURM_JOB_ID"]
    for f in facts:
      self.assertEqual(
          (f["TFDIST_NNODES"], f["TFDIST_RUN_ID"], f["TFDIST_RESTART"],
           f["TFDIST_RESTART_COUNT"], f["TFDIST_MAX_RESTARTS"]),
          ("2", f"slurm-{job}", "0", "0", "0"), r.stdout)
      hosts = {a.rsplit(":", 1)[0] for a in f["cluster"]["worker"]}
      self.assertEqual(hosts, self._addresses(), r.stdout)
    self.assertEqual(sorted(f["task"]["index"] for f in facts), [0, 1, 2, 3])
    # One line on each node says where each value came from.
    for rank, node in enumerate(("node1", "node2")):
      self.assertIn(
          f"tfdist: from SLURM job {job}: --nnodes 2 (the step's nodes), "
          f"--node-rank {rank} ({node}'s place among them), --master-addr "
          f"{self.bed.address('node1')} (the first, node1, its NodeAddr), "
          "--master-port ", r.stdout)

  def test_a_failed_task_stops_every_node(self):
    # Worker 0 on node1 would sleep 10 minutes: the harness's bound on srun
    # (120 s) fails the test if node1's launcher waited for it.
    r = self._launch("--workers", "1", "--grace-seconds", "2", "--",
                     sys.executable, "-c", ONE_FAILS)
    self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
    self.assertIn("tfdist: node 0 stops: task worker:1 on node 1 failed",
                  r.stdout)

  def test_more_than_one_task_a_node_is_refused_naming_the_option(self):
    r = self._launch("--workers", "1", "--", sys.executable, "-c", "pass",
                     srun=("-N", "2", "--ntasks-per-node=2"))
    self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
    said = [l for l in r.stderr.splitlines() if l.startswith("tfdist: ")]
    self.assertLen(said, 4, r.stderr)  # One line from each launcher.
    for line in said:
      self.assertIn("--ntasks-per-node: received 2; expected 1", line)

  def test_a_node_of_another_job_is_refused_naming_both_ids(self):
    # Node2's launcher sees another SLURM_JOB_ID (the same port slot, so it
    # reaches node 0): node 0 refuses it, naming both.
    r = self.slurm.srun(
        ["-N", "2", "--kill-on-bad-exit=0", "bash", "-c",
         'if [[ "${SLURM_NODEID}" == 1 ]]; then export SLURM_JOB_ID=999999; '
         'fi; exec tfdist launch --workers 1 --rendezvous-timeout-seconds 4 '
         f'-- {sys.executable} -c pass'],
        env={**_ENV, "TFDIST_JOB_SECRET": "slurm-bed-secret",
             "TFDIST_PORT_BASE": "20000"}, timeout=120)
    self.assertNotEqual(r.returncode, 0, r.stdout)
    job, = set(re.findall(r"from SLURM job (\d+):", r.stdout)) - {"999999"}
    self.assertIn(f"SLURM_JOB_ID 999999 on node 1, {job} on node 0",
                  r.stdout + r.stderr)

  def test_a_stalled_job_reports_in_its_output_file(self):
    with tempfile.TemporaryDirectory() as d:
      script = _job_script(os.path.join(d, "job.sbatch"), nodes="2")
      os.chmod(d, 0o755)
      job, out = self.slurm.sbatch(script, args=[
          f"--export=ALL,PYTHONPATH={cluster_utils.REPO},TMPDIR={d},"
          f"TFDIST_COMMAND={sys.executable} {STALL_JOB} collective 6 "
          "--slow-worker 1 --at 5"], timeout=400)
    # Worker 1, on node2, sleeps in a callback: node 0's launcher prints one
    # report of both nodes when worker 0's collective times out, naming the
    # sleeper's line, and every node stops.
    self.assertRegex(out, r"tfdist: stall report \(node 0: worker:0 exited "
                          r"1: (DeadlineExceededError|WorkerLostError)", job)
    report = out[out.index("tfdist: stall report"):].splitlines()
    self.assertIn("behind: worker:1 (by 1 step, at step 5)", report[0])
    at = next(i for i, l in enumerate(report)
              if l.startswith("  worker:1 on node 1: "))
    self.assertTrue(report[at].startswith(
        "  worker:1 on node 1: step 5, BEHIND by 1 step; "), report)
    self.assertTrue(report[1].startswith("  worker:0 on node 0: step 6;"),
                    report)
    self.assertIn(f"{STALL_JOB}:{_sleep_line()} in on_train_batch_end",
                  report[at + 1])
    self.assertIn("tfdist: node 1 stops: task worker:0 on node 0 failed", out)
    # Each node's dumps in the job's TMPDIR, removed with it, not in /tmp.
    flight = re.escape(d) + r"/tfdist-flight-"
    self.assertRegex(out, rf"dumps .*: node 0 {flight}\S+/0, node 1 {flight}")
    print(f"\nstall report of SLURM job {job}:\n" + "\n".join(report[:12]))

  def _scontrol(self, *args: str) -> str:
    return subprocess.run(
        self.slurm.command(["scontrol", *args]), env=self.slurm.env,
        capture_output=True, text=True, timeout=30, check=False).stdout

  def _job(self, job: str) -> tuple[str, int, str]:
    record = self._scontrol("-o", "show", "job", job)
    field = lambda name: re.search(rf"\b{name}=(\S*)", record).group(1)
    return field("JobState"), int(field("Restarts")), field("NodeList")

  def _fault_job_requeued(self, directory, sbatch_args):
    """fault_job.py's fit, preempted at step 2 and requeued once.

    Submits ``sbatch_args`` with the fault job (backup in DIRECTORY/backup)
    as TFDIST_COMMAND, waits until both tasks train, drains node1 (the
    chief's), sends USR1 as ``--signal=B:USR1@N`` does and starts the
    requeued job at once.

    Returns:
      The first run's NodeList, the job's state, restarts and NodeList at
      its end, and the output of the first and the second run.
    """
    backup = os.path.join(directory, "backup")
    # TMPDIR: a worker killed at the requeue leaves its temporary save
    # directory (tfdist.training.chief) in the test's own, removed after.
    env = {**self.slurm.env, **_ENV, "SLURM_LABELIO": "1", "TMPDIR": directory,
           "TFDIST_COMMAND": f"{sys.executable} {FAULT_JOB} auto fit {backup}"}
    # A node range is granted at the controller's next tick: what is idle.
    self.slurm.wait_idle()
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

    wait(lambda: all(re.search(rf"(?m)^{r}: \[worker:{r}\] step 2$", text())
                     for r in range(2)), "step 2")
    state, _, first_nodes = self._job(job)
    self.assertEqual(state, "RUNNING")
    self._scontrol("update", "nodename=node1", "state=drain",
                   "reason=tfdist-test")
    self.addCleanup(self._scontrol, "update", "nodename=node1", "state=resume")
    subprocess.run(self.slurm.command(
        ["scancel", "--batch", "--signal=USR1", job]), env=self.slurm.env,
                   check=True, timeout=30)
    wait(lambda: self._job(job)[:2] == ("PENDING", 1), "the requeue")
    self.slurm.release_requeued(job)
    wait(lambda: self._job(job)[0] in _ENDED, "the second run")
    first, _, second = text().partition(f"tfdist: requeueing job {job}\n")
    return (first_nodes, *self._job(job), first, second)

  def test_a_preempted_two_node_run_resumes_on_the_node_left(self):
    # `tfdist slurm --nodes 1-2`: both nodes at first; node1 (the chief's) is
    # drained while the run saves and is requeued, so SLURM grants node2
    # alone, and training goes on there from the backup of two workers. (The
    # requeued job lands on the other node and resumes exactly: this covers
    # the one-node run moved by a drain too.)
    directory = tempfile.mkdtemp(prefix="tfdist-resize-")
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    os.chmod(directory, 0o755)
    reference = fault_runs.reference()
    script = _job_script(os.path.join(directory, "job.sbatch"), nodes="1-2")
    first_nodes, state, restarts, second_nodes, first, second = (
        self._fault_job_requeued(directory, [script]))
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
    steps = [int(s) for s in re.findall(r"(?m)^0: \[worker:0\] step (\d+)$",
                                        second)]
    self.assertEqual(steps, list(range(int(saved["0"]) + 1,
                                       fault_runs.STEPS + 1)), second)
    result = json.loads(re.search(r"(?m)^0: \[worker:0\] (\{.*\})$",
                                  second).group(1))
    # As every fault test: 1e-5 absolute, on weights of order 1 (one weight
    # near zero was 7e-5 apart relatively, 6e-8 absolutely, once).
    fault_runs.assert_like(self, result, reference)


@pytest.mark.timeout(600)
@absltest.skipIf(_REASON is not None, _REASON)
class ThreeNodeSlurmTest(absltest.TestCase):
  """`tfdist slurm --nodes 2-3`: SLURM grants three nodes, one is lost."""

  def test_a_lost_nodes_peers_go_on_at_the_smaller_size(self):
    with netbed.NetBed(hosts=("ctl", "node1", "node2", "node3"),
                       resolvable=False) as bed, \
        slurm_harness.LocalSlurm(bed=bed, cpus=2) as slurm, \
        tempfile.TemporaryDirectory() as d:
      task, script = os.path.join(d, "task.py"), os.path.join(d, "job.sbatch")
      with open(task, "w") as f:
        f.write(ELASTIC_TASK)
      subprocess.run(
          [sys.executable, "-m", "tfdist", "slurm", "--nodes", "2-3",
           "--cpus-per-task", "1", "--time", "00:10:00", "-o", script],
          check=True, timeout=60, env=cluster_utils.base_env(),
          cwd=cluster_utils.REPO)
      os.chmod(d, 0o755)
      job, out = slurm.sbatch(script, args=[
          f"--export=ALL,PYTHONPATH={cluster_utils.REPO},"
          f"TFDIST_COMMAND={sys.executable} {task}"], timeout=300)
    self.assertIn(f"tfdist: from SLURM job {job}: --nnodes 3 ", out)
    self.assertIn("members changed (round 1, no restart spent): node 2's "
                  "launcher went away", out)
    self.assertIn("; 3 nodes, now 2", out)
    # Exactly the two nodes left go on, at the smaller size, spending no
    # restart.
    self.assertEqual(_json_lines(out), [
        {"TFDIST_NNODES": "2", "TFDIST_RESTART": "1",
         "TFDIST_RESTART_COUNT": "0"}] * 2, out)


if __name__ == "__main__":
  absltest.main()
