"""Preemption through tfdist's sbatch templates on a real local SLURM.

Each test submits a template (cluster_configs/*.sbatch, or what
`tfdist.launch.sbatch.render` gives) to a private SLURM (slurm_harness.py) and
sends what SLURM sends at the ``--signal=B:USR1@N`` time: ``scancel --batch
--signal=USR1`` signals the batch shell only, without waiting for a time
limit. The template's trap forwards USR1 to srun and so to every task; the
shell then requeues the job. SLURM holds a requeued job (``BeginTime`` about
two minutes ahead) before it may start again; the tests start it 2 s after
the requeue (`slurm_harness.LocalSlurm.release_requeued`).

* A 2-task MultiWorkerMirrored job (tests/scripts/fault_job.py ``fit``, both
  tasks on one node: the toy nodes share one machine and so their ports)
  saves at one step on every task, every task exits 42, the job is requeued
  once, and the second run resumes at the saved step and ends with the
  weights of an uninterrupted single-process run.
* In a 2-element array only the signalled element is requeued, even the one
  whose SLURM_JOB_ID is the array's own id (which names every element).
* Tasks that finish (exit 0) although USR1 came are not run again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
import fault_runs
import slurm_harness
import tfdist
from tfdist.launch import sbatch as slurm_script

pytestmark = pytest.mark.timeout(300)

_REPO = cluster_utils.REPO
_FAULT_JOB = os.path.join(cluster_utils.SCRIPTS, fault_runs.JOB)
_PAYLOAD = os.path.join(cluster_utils.SCRIPTS, "slurm_payload.py")
_MWMS_TEMPLATE = os.path.join(
    _REPO, "cluster_configs",
    slurm_script.template_name("multi_worker_mirrored"))
_HOST = slurm_harness.local_node_name()
#: Job states that end a job (a requeued job goes back to PENDING).
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
          "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")

_SHARED = slurm_harness.SharedSlurm(nodes=(_HOST, "n9"), cpus=4)
tearDownModule = _SHARED.stop  # pylint: disable=invalid-name


def _tempdir(test: absltest.TestCase) -> str:
  directory = tempfile.mkdtemp(prefix="tfdist-slurm-preempt-")
  test.addCleanup(shutil.rmtree, directory, ignore_errors=True)
  return directory


def _read(path: str) -> str:
  if not os.path.exists(path):
    return ""
  with open(path, errors="replace") as f:
    return f.read()


def _field(record: str, name: str) -> str:
  match = re.search(rf"\b{name}=(\S*)", record)
  if match is None:
    raise AssertionError(f"no {name}= in {record!r}")
  return match.group(1)


def _task_ids(text: str) -> list[int]:
  """srun's task lists: ``0``, ``0-1``, ``0,2-3``."""
  ids = []
  for part in text.split(","):
    first, _, last = part.partition("-")
    ids += range(int(first), int(last or first) + 1)
  return ids


def _task_outcomes(output: str) -> dict[int, list[str]]:
  """What srun reported for each task that did not exit 0, in order."""
  outcomes: dict[int, list[str]] = {}
  for match in re.finditer(r"(?m)^srun: error: \S+: tasks? ([\d,-]+): (.+)$",
                           output):
    for task in _task_ids(match.group(1)):
      outcomes.setdefault(task, []).append(match.group(2))
  return outcomes


def _processes_mentioning(text: str) -> list[str]:
  """Command lines of this machine's processes that contain ``text``."""
  return [f"{p.pid}: {p.cmdline}" for p in cluster_utils.processes()
          if text in p.cmdline and p.pid != os.getpid()]


class _Job:
  """One submitted batch job (or array), polled with scontrol.

  The job is cancelled when the test ends, whatever happened.
  """

  def __init__(self, test: absltest.TestCase, slurm: slurm_harness.LocalSlurm,
               script: str, *, args: list[str], env: dict[str, str],
               chdir: str):
    self.env = dict(slurm.env)
    self.env.pop("TF_CONFIG", None)
    self.env.update(env)
    self.chdir = chdir
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={chdir}", *args, script],
        env=self.env, capture_output=True, text=True, timeout=30, check=False)
    test.assertEqual(submitted.returncode, 0, submitted.stderr)
    self.id = submitted.stdout.strip().split(";")[0]
    test.addCleanup(self.cancel)

  def scontrol(self, *args: str) -> str:
    return subprocess.run(["scontrol", *args], env=self.env,
                          capture_output=True, text=True, timeout=30,
                          check=False).stdout

  def records(self, job: str | None = None) -> list[str]:
    """``scontrol -o show job``: one line per job (per array element)."""
    return [line for line in self.scontrol(
        "-o", "show", "job", job or self.id).splitlines() if "JobId=" in line]

  def signal_batch_shell(self, job: str | None = None) -> None:
    """USR1 to the batch shell only, as ``--signal=B:USR1@N`` does."""
    subprocess.run(["scancel", "--batch", "--signal=USR1", job or self.id],
                   env=self.env, check=True, timeout=30)

  def active(self) -> bool:
    proc = subprocess.run(["squeue", "-h", "-j", self.id, "-o", "%i %T"],
                          env=self.env, capture_output=True, text=True,
                          timeout=30, check=False)
    return bool(proc.stdout.strip())

  def cancel(self) -> None:
    subprocess.run(["scancel", self.id], env=self.env, capture_output=True,
                   timeout=30, check=False)


def _wait(test: absltest.TestCase, condition, timeout: float, what) -> None:
  if not cluster_utils.wait_until(condition, timeout, interval=0.3):
    test.fail(f"timed out after {timeout} s waiting for {what()}")


class SlurmPreemptionTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.slurm = _SHARED.get()

  def assert_nothing_left(self, job: _Job, directory: str) -> None:
    """No job of the test in the queue, no process using its directory."""
    _wait(self, lambda: not job.active() and not _processes_mentioning(
        directory), 30, lambda: (f"job {job.id} and the processes of "
                                 f"{directory} to end: "
                                 f"{_processes_mentioning(directory)}"))

  def test_multi_worker_mirrored_template_saves_requeues_once_and_resumes(
      self):
    directory = _tempdir(self)
    started = time.monotonic()
    reference = fault_runs.reference(directory)
    backup = os.path.join(directory, "backup")
    job = _Job(
        self, self.slurm, _MWMS_TEMPLATE,
        # The toy cluster has no GPUs; one node holds both tasks.
        args=["--nodes=1", f"--nodelist={_HOST}", "--ntasks-per-node=2",
              "--gpus-per-node=0", "--cpus-per-task=1"],
        env={"TFDIST_COMMAND": f"{sys.executable} {_FAULT_JOB} auto fit "
                               f"{backup}",
             "PYTHONPATH": _REPO, "PYTHONUNBUFFERED": "1",
             "TF_CPP_MIN_LOG_LEVEL": "2",
             "SLURM_LABELIO": "1"},  # srun --label: "RANK: " before each line.
        chdir=directory)
    output_path = os.path.join(directory, f"tfdist-mwms-{job.id}.out")

    def output():
      return _read(output_path)

    seen = []  # The (state, restarts) sequence, for failure messages.

    def state():
      record = job.records()[0]
      now = _field(record, "JobState"), int(_field(record, "Restarts"))
      if not seen or seen[-1] != now:
        seen.append(now)
      return now

    def context():
      return (f"job {job.id}: states {seen}\n"
              f"{job.scontrol('show', 'job', job.id)}\n{output()}\n"
              f"{self.slurm.logs()}")

    submitted = time.monotonic()
    # Signal once both tasks are training.
    _wait(self, lambda: re.search(r"(?m)^0: step 2$", output()) and re.search(
        r"(?m)^1: step 2$", output()), 150, context)
    logging.info("reference run %.1f s, submit -> step 2 %.1f s",
                 submitted - started, time.monotonic() - submitted)
    self.assertEqual(state(), ("RUNNING", 0), context())
    job.signal_batch_shell()
    signalled = time.monotonic()

    # The shell requeues: the job is pending again, held until BeginTime.
    _wait(self, lambda: state() == ("PENDING", 1), 60, context)
    requeue_seconds = time.monotonic() - signalled
    hold = _field(job.records()[0], "StartTime")
    self.slurm.release_requeued(job.id)
    _wait(self, lambda: state()[0] in _ENDED, 150, context)
    finished_seconds = time.monotonic() - signalled
    record = job.records()[0]
    text = output()
    logging.info("signal -> requeued %.1f s (hold until %s), signal -> "
                 "finished %.1f s; states %s", requeue_seconds, hold,
                 finished_seconds, seen)

    self.assertEqual(
        (_field(record, "JobState"), _field(record, "Restarts"),
         _field(record, "ExitCode")), ("COMPLETED", "1", "0:0"), context())
    self.assertEqual(text.count("tfdist: USR1 at "), 1, text)
    self.assertEqual(text.count(f"tfdist: requeueing job {job.id}\n"), 1, text)
    first, _, second = text.partition(f"tfdist: requeueing job {job.id}\n")

    # First run: both tasks saved at one step and exited 42.
    saved = {int(m.group(1)): (int(m.group(2)), int(m.group(3)))
             for m in re.finditer(r"(?m)^(\d+): .*tfdist: checkpoint saved at "
                                  r"step (\d+); exiting with code (\d+)$",
                                  first)}
    self.assertLen(saved, 2, first)
    self.assertLen(set(saved.values()), 1, saved)
    step, code = saved[0]
    self.assertEqual(code, tfdist.PREEMPTED_EXIT_CODE)
    self.assertBetween(step, 2, 17)
    self.assertEqual(_task_outcomes(first), {
        0: [f"Exited with exit code {tfdist.PREEMPTED_EXIT_CODE}"],
        1: [f"Exited with exit code {tfdist.PREEMPTED_EXIT_CODE}"]}, first)
    for task in (0, 1):
      steps = [int(s) for s in re.findall(rf"(?m)^{task}: step (\d+)$",
                                          first)]
      self.assertEqual(steps, list(range(1, step + 1)), first)

    # Second run: resumes after the saved step, ends with the steps due and
    # the weights of an uninterrupted run.
    self.assertEqual(_task_outcomes(second), {}, second)
    results = {int(m.group(1)): m.group(2) for m in re.finditer(
        r"(?m)^(\d+): (\{.*\})$", second)}
    self.assertCountEqual(results, [0, 1], second)
    for task in (0, 1):
      steps = [int(s) for s in re.findall(rf"(?m)^{task}: step (\d+)$",
                                          second)]
      self.assertEqual(steps, list(range(step + 1, 19)), second)
      fault_runs.assert_like(self, json.loads(results[task]), reference)
    logging.info("saved and resumed at step %d", step)
    self.assert_nothing_left(job, directory)

  def test_array_requeues_only_the_signalled_element(self):
    """The element whose SLURM_JOB_ID is the array's id is the one signalled.

    ``scontrol requeue ARRAYID`` would requeue every element; the template
    names the element as ``ARRAYID_TASKID``.
    """
    directory = _tempdir(self)
    script = os.path.join(directory, "array.sbatch")
    with open(script, "w") as f:
      f.write(slurm_script.render(slurm_script.SbatchSpec(
          job_name="tfdist-array", nodes=1, tasks_per_node=1,
          cpus_per_task=1, time="00:10:00", signal_seconds=60,
          command=(sys.executable, _PAYLOAD, "--payload_mode=signal",
                   "--payload_wait=15"))))
    job = _Job(self, self.slurm, script, args=["--array=0-1"],
               env={"PYTHONPATH": _REPO, "PYTHONUNBUFFERED": "1"},
               chdir=directory)

    def elements():
      """{array index: (job id, state, restarts)}."""
      return {int(_field(r, "ArrayTaskId")): (
          _field(r, "JobId"), _field(r, "JobState"),
          int(_field(r, "Restarts"))) for r in job.records()
              if re.fullmatch(r"\d+", _field(r, "ArrayTaskId"))}

    def output(index):
      return _read(os.path.join(directory,
                                f"tfdist-array-{elements()[index][0]}.out"))

    def context():
      return f"{elements()}\n{job.scontrol('show', 'job', job.id)}"

    _wait(self, lambda: len(elements()) == 2 and all(
        '"waiting": true' in output(i) for i in (0, 1)), 60, context)
    ids = {i: e[0] for i, e in elements().items()}
    # SLURM gives one element the array's own id.
    (target,) = [i for i, job_id in ids.items() if job_id == job.id]
    other = 1 - target
    job.signal_batch_shell(f"{job.id}_{target}")
    _wait(self, lambda: elements()[target][1:] == ("PENDING", 1), 30, context)
    self.slurm.release_requeued(f"{job.id}_{target}")
    _wait(self, lambda: not job.active(), 60, context)

    self.assertEqual(elements(), {target: (ids[target], "COMPLETED", 1),
                                  other: (ids[other], "COMPLETED", 0)})
    requeued, untouched = output(target), output(other)
    self.assertEqual(requeued.count("tfdist: requeueing job "), 1, requeued)
    self.assertIn(f"tfdist: requeueing job {job.id}_{target}\n", requeued)
    self.assertEqual(re.findall(r'"restart": (\d), "usr1": (\w+)', requeued),
                     [("0", "true"), ("1", "false")], requeued)
    self.assertEqual(re.findall(r'"restart": (\d), "usr1": (\w+)', untouched),
                     [("0", "false")], untouched)
    self.assertNotIn("REQUEUE", untouched)
    self.assert_nothing_left(job, directory)

  def test_tasks_that_finish_after_usr1_are_not_requeued(self):
    directory = _tempdir(self)
    script = os.path.join(directory, "done.sbatch")
    with open(script, "w") as f:
      f.write(slurm_script.render(slurm_script.SbatchSpec(
          job_name="tfdist-done", nodes=1, tasks_per_node=1, cpus_per_task=1,
          time="00:10:00", signal_seconds=60,
          command=(sys.executable, _PAYLOAD, "--payload_mode=signal",
                   "--payload_usr1_exit=0"))))
    job = _Job(self, self.slurm, script, args=[],
               env={"PYTHONPATH": _REPO, "PYTHONUNBUFFERED": "1"},
               chdir=directory)
    output_path = os.path.join(directory, f"tfdist-done-{job.id}.out")
    _wait(self, lambda: '"waiting": true' in _read(output_path), 60,
          lambda: job.scontrol("show", "job", job.id))
    job.signal_batch_shell()
    _wait(self, lambda: not job.active(), 60,
          lambda: job.scontrol("show", "job", job.id))
    record = job.records()[0]
    text = _read(output_path)
    self.assertEqual((_field(record, "JobState"), _field(record, "Restarts")),
                     ("COMPLETED", "0"), text)
    self.assertIn("tfdist: not requeueing: srun exited 0, not 42", text)
    self.assertNotIn("tfdist: requeueing", text)
    self.assert_nothing_left(job, directory)

  def test_the_requeue_cap_ends_a_preempted_run_with_42(self):
    directory = _tempdir(self)
    script = os.path.join(directory, "capped.sbatch")
    with open(script, "w") as f:
      f.write(slurm_script.render(slurm_script.SbatchSpec(
          job_name="tfdist-capped", nodes=1, tasks_per_node=1,
          cpus_per_task=1, time="00:10:00", signal_seconds=60,
          max_requeues=0, setup=("echo set-up ran",),
          command=(sys.executable, _PAYLOAD, "--payload_mode=signal"))))
    job = _Job(self, self.slurm, script, args=[],
               env={"PYTHONPATH": _REPO, "PYTHONUNBUFFERED": "1"},
               chdir=directory)
    output_path = os.path.join(directory, f"tfdist-capped-{job.id}.out")
    _wait(self, lambda: '"waiting": true' in _read(output_path), 60,
          lambda: job.scontrol("show", "job", job.id))
    job.signal_batch_shell()
    _wait(self, lambda: not job.active(), 60,
          lambda: job.scontrol("show", "job", job.id))
    record = job.records()[0]
    text = _read(output_path)
    self.assertEqual((_field(record, "JobState"), _field(record, "Restarts"),
                      _field(record, "ExitCode")), ("FAILED", "0", "42:0"),
                     text)
    self.assertIn("set-up ran", text)
    self.assertIn("tfdist: not requeueing: 0 requeue(s) done (the cap)", text)
    self.assertNotIn("tfdist: requeueing", text)
    self.assert_nothing_left(job, directory)


if __name__ == "__main__":
  absltest.main()
