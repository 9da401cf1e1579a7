"""Preemption through tfdist's sbatch templates on a real local SLURM.

Each test submits a template (cluster_configs/*.sbatch, or what
`tfdist.launch.sbatch.render` gives) to a private SLURM (slurm_harness.py) and
sends what SLURM sends at the ``--signal=B:USR1@N`` time: ``scancel --batch
--signal=USR1`` signals the batch shell only, without waiting for a time
limit. The template's trap forwards USR1 to srun and so to every task; the
shell then requeues the job. SLURM holds a requeued job (``BeginTime`` about
two minutes ahead) before it may start again; the tests start it in the
second after the requeue (`slurm_harness.LocalSlurm.release_requeued`).

* A 2-task MultiWorkerMirrored job (tests/scripts/fault_job.py ``fit``, both
  tasks on one node: the toy nodes share one machine and so their ports)
  saves at one step on every task, every task exits 42, the job is requeued
  once, and the second run resumes at the saved step and ends with the
  weights of an uninterrupted single-process run.
* In a 2-element array only the signalled element is requeued, even the one
  whose SLURM_JOB_ID is the array's own id (which names every element).
* Tasks that finish (exit 0) although USR1 came are not run again.

In-process requeue (`tfdist.cluster.requeue`, ``requeue_from="task"``): USR1
goes to the tasks (``scancel --signal=USR1``, what ``--signal=USR1@N``
sends) and the chief task requeues the job itself: the same 2-task job saves,
is requeued once by its chief and resumes; with a cap of 1 the second
preemption ends the job with 42 and says why. The rule's decisions (job id,
cap, enablement) are tables. `requeue.requeue_after_save` runs the real
scontrol: against running ``sleep`` jobs of the local SLURM (SLURM's record
shows the requeue), a job id SLURM does not know (scontrol's own error), and
a copy of the slurm.conf whose controller port is a loopback socket that
never answers (the time bound). The watcher's log lines (requeue on or off,
not under SLURM, SIGINT) come from a `PreemptionWatcher` in this process
whose environment names a running job of the local SLURM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
import fault_runs
import slurm_harness
import stalls
import tfdist
from tfdist.cluster import requeue
from tfdist.launch import sbatch as slurm_script

pytestmark = pytest.mark.timeout(300)

_REPO = cluster_utils.REPO
_FAULT_JOB = os.path.join(cluster_utils.SCRIPTS, fault_runs.JOB)
_PAYLOAD = os.path.join(cluster_utils.SCRIPTS, "slurm_payload.py")
_REQUEUE_PAYLOAD = os.path.join(cluster_utils.SCRIPTS, "requeue_payload.py")
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


def _script(directory: str, spec: slurm_script.SbatchSpec) -> str:
  """Writes ``render(spec)`` into ``directory``; returns the file's path."""
  path = os.path.join(directory, f"{spec.job_name}.sbatch")
  with open(path, "w") as f:
    f.write(slurm_script.render(spec))
  return path


#: A line of worker K under the job script's one launcher (srun's rank 0).
_LINE = r"(?m)^0: \[worker:{}\] "


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

  def signal_tasks(self, job: str | None = None) -> None:
    """USR1 to the job's steps, not the batch shell, as ``--signal=USR1@N``."""
    subprocess.run(["scancel", "--signal=USR1", job or self.id],
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

  @parameterized.named_parameters(("script", "script"), ("task", "task"))
  def test_multi_worker_mirrored_template_saves_requeues_once_and_resumes(
      self, requeue_from):
    """The shipped template, or its preset with ``requeue_from="task"``.

    script: USR1 to the batch shell, which requeues. task: USR1 to the tasks
    (``--signal=USR1@N``), and the chief task requeues the job itself.
    """
    directory = _tempdir(self)
    started = time.monotonic()
    reference = fault_runs.reference()
    backup = os.path.join(directory, "backup")
    script = _MWMS_TEMPLATE
    if requeue_from == "task":
      script = _script(directory, dataclasses.replace(
          slurm_script.PRESETS["multi_worker_mirrored"], requeue_from="task"))
    job = _Job(
        self, self.slurm, script,
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
    _wait(self, lambda: re.search(_LINE.format(0) + "step 2$", output())
          and re.search(_LINE.format(1) + "step 2$", output()), 150, context)
    logging.info("reference run %.1f s, submit -> step 2 %.1f s",
                 submitted - started, stalls.running_since(submitted))
    self.assertEqual(state(), ("RUNNING", 0), context())
    if requeue_from == "task":
      job.signal_tasks()
    else:
      job.signal_batch_shell()
    signalled = time.monotonic()

    # The shell requeues: the job is pending again, held until BeginTime.
    _wait(self, lambda: state() == ("PENDING", 1), 60, context)
    requeue_seconds = stalls.running_since(signalled)
    hold = _field(job.records()[0], "StartTime")
    self.slurm.release_requeued(job.id)
    _wait(self, lambda: state()[0] in _ENDED, 150, context)
    finished_seconds = stalls.running_since(signalled)
    record = job.records()[0]
    text = output()
    logging.info("signal -> requeued %.1f s (hold until %s), signal -> "
                 "finished %.1f s; states %s", requeue_seconds, hold,
                 finished_seconds, seen)

    self.assertEqual(
        (_field(record, "JobState"), _field(record, "Restarts"),
         _field(record, "ExitCode")), ("COMPLETED", "1", "0:0"), context())
    if requeue_from == "task":
      # The shell got no USR1 and requeued nothing; the chief task did.
      self.assertNotIn("tfdist: USR1 at ", text)
      self.assertNotIn("tfdist: requeueing job", text)
      self.assertNotIn("tfdist: not requeueing", text)
      marker = re.search(
          rf"(?m)^0: .*tfdist: requeued job {job.id} \(requeue 1\): it "
          r"resumes from the checkpoint when SLURM starts it again$", text)
      self.assertIsNotNone(marker, text)
      # SLURM counted one requeue (Restarts 1 above). In one run of
      # 2026-11-28 the chief's last lines came twice (the requeue's SIGTERM
      # reached the step as it left), so the line is checked for what it
      # says, not counted; a failed second requeue would say "failed".
      self.assertEqual(
          set(re.findall(r"tfdist: requeue\w* job \d+ \(?\w*", text)),
          {f"tfdist: requeued job {job.id} (requeue"}, text)
    else:
      self.assertEqual(text.count("tfdist: USR1 at "), 1, text)
      self.assertEqual(text.count(f"tfdist: requeueing job {job.id}\n"), 1,
                       text)
      marker = re.search(f"tfdist: requeueing job {job.id}\n", text)
    # The second run starts with the tasks' pid lines after the requeue.
    cut = re.compile(_LINE.format(r"\d+") + r"pid \d+$").search(
        text, marker.end())
    self.assertIsNotNone(cut, text)
    first, second = text[:cut.start()], text[cut.start():]

    # First run: both tasks saved at one step and exited 42.
    saved = {int(m.group(1)): (int(m.group(2)), int(m.group(3)))
             for m in re.finditer(_LINE.format(r"(\d+)") + r".*tfdist: "
                                  r"checkpoint saved at step (\d+) in \S+; "
                                  r"exiting with code (\d+)$", first)}
    self.assertLen(saved, 2, first)
    self.assertLen(set(saved.values()), 1, saved)
    step, code = saved[0]
    self.assertEqual(code, tfdist.PREEMPTED_EXIT_CODE)
    self.assertBetween(step, 2, 17)
    exited = f"Exited with exit code {tfdist.PREEMPTED_EXIT_CODE}"
    if requeue_from == "task":
      # SLURM ends the job it requeues: SIGTERM to every task (logged, but
      # one already past Python's handlers ends by it), SIGKILL KillWait
      # later. Whatever srun reports, the saves are done.
      # The launcher, signalled again, kills what is left and exits 128+10.
      for outcome in _task_outcomes(first).values():
        self.assertContainsSubset(outcome, [
            exited, "Terminated", "Killed", "Exited with exit code 138"],
                                  first)
    else:
      self.assertEqual(_task_outcomes(first), {0: [exited]}, first)
    for task in (0, 1):
      steps = [int(s) for s in re.findall(
          _LINE.format(task) + r"step (\d+)$", first)]
      self.assertEqual(steps, list(range(1, step + 1)), first)

    # Second run: resumes after the saved step, ends with the steps due and
    # the weights of an uninterrupted run.
    self.assertEqual(_task_outcomes(second), {}, second)
    results = {int(m.group(1)): m.group(2) for m in re.finditer(
        _LINE.format(r"(\d+)") + r"(\{.*\})$", second)}
    self.assertCountEqual(results, [0, 1], second)
    for task in (0, 1):
      steps = [int(s) for s in re.findall(
          _LINE.format(task) + r"step (\d+)$", second)]
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
    script = _script(directory, slurm_script.SbatchSpec(
        job_name="tfdist-array", nodes=1, tasks_per_node=1,
        cpus_per_task=1, time="00:10:00", signal_seconds=60,
        command=(sys.executable, _PAYLOAD, "--payload_mode=signal",
                 "--payload_wait=6")))
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
    script = _script(directory, slurm_script.SbatchSpec(
        job_name="tfdist-done", nodes=1, tasks_per_node=1, cpus_per_task=1,
        time="00:10:00", signal_seconds=60,
        command=(sys.executable, _PAYLOAD, "--payload_mode=signal",
                 "--payload_usr1_exit=0")))
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
    script = _script(directory, slurm_script.SbatchSpec(
        job_name="tfdist-capped", nodes=1, tasks_per_node=1,
        cpus_per_task=1, time="00:10:00", signal_seconds=60,
        max_requeues=0, setup=("echo set-up ran",),
        command=(sys.executable, _PAYLOAD, "--payload_mode=signal")))
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
    self.assertIn("tfdist: the tasks were preempted and saved; submit the "
                  "same script again to resume", text)
    self.assertNotIn("tfdist: requeueing", text)
    self.assert_nothing_left(job, directory)

  @parameterized.named_parameters(("srun", True), ("no_srun", False))
  def test_the_task_requeues_once_then_stops_at_the_cap_with_42(self, srun):
    """requeue_from="task" with max_requeues=1, or a script without srun.

    tests/scripts/requeue_payload.py does what a training task does after
    its save (the chief calls `requeue.requeue_after_save`), without
    TensorFlow. The first USR1 requeues the job from the chief; after the
    second, at the cap, the chief says so and the job ends with 42. srun:
    the rendered script, two tasks, USR1 to the tasks. no_srun: a plain
    script that ``exec``s the program with ``--signal=B:USR1@N`` and the two
    exports, USR1 to the batch shell, which is the program.
    """
    directory = _tempdir(self)
    name = "tfdist-task-capped"
    if srun:
      script = _script(directory, slurm_script.SbatchSpec(
          job_name=name, nodes=1, tasks_per_node=2, cpus_per_task=1,
          time="00:10:00", signal_seconds=60, requeue_from="task",
          max_requeues=1, command=(sys.executable, _REQUEUE_PAYLOAD)))
    else:
      script = os.path.join(directory, "no-srun.sbatch")
      with open(script, "w") as f:
        f.write("\n".join([
            "#!/bin/bash", f"#SBATCH --job-name={name}", "#SBATCH --requeue",
            "#SBATCH --output=%x-%j.out", "#SBATCH --open-mode=append",
            "#SBATCH --signal=B:USR1@60", "#SBATCH --time=00:10:00",
            f"export {requeue.REQUEUE_VARIABLE}=1 "
            f"{requeue.MAX_REQUEUES_VARIABLE}=1",
            f"exec {sys.executable} {_REQUEUE_PAYLOAD}", ""]))
    job = _Job(self, self.slurm, script, args=[],
               env={"PYTHONPATH": _REPO, "PYTHONUNBUFFERED": "1"},
               chdir=directory)
    output_path = os.path.join(directory, f"{name}-{job.id}.out")
    tasks = 2 if srun else 1
    preempt = job.signal_tasks if srun else job.signal_batch_shell

    def state():
      record = job.records()[0]
      return _field(record, "JobState"), int(_field(record, "Restarts"))

    def waiting(restart):
      return _read(output_path).count(
          f'"restart": {restart}, "waiting": true') == tasks

    def context():
      return f"{job.scontrol('show', 'job', job.id)}\n{_read(output_path)}"

    _wait(self, lambda: waiting(0), 60, context)
    preempt()
    _wait(self, lambda: state() == ("PENDING", 1), 60, context)
    self.slurm.release_requeued(job.id)
    _wait(self, lambda: waiting(1), 60, context)
    preempt()
    _wait(self, lambda: not job.active(), 60, context)

    record = job.records()[0]
    text = _read(output_path)
    self.assertEqual((_field(record, "JobState"), _field(record, "Restarts"),
                      _field(record, "ExitCode")), ("FAILED", "1", "42:0"),
                     text)
    lines = [re.sub(r"^\[worker:0\] ", "", line)  # The launcher's prefix.
             for line in text.splitlines() if "requeu" in line
             and "CANCELLED" not in line]  # slurmstepd's "DUE TO JOB REQUEUE".
    self.assertEqual(lines, [
        f"tfdist: requeued job {job.id} (requeue 1 of at most 1): it resumes "
        "from the checkpoint when SLURM starts it again",
        f"tfdist: not requeueing job {job.id}: 1 requeue(s) done, the cap "
        f"({requeue.MAX_REQUEUES_VARIABLE}=1)"], text)
    if srun:  # The rendered script says it; the plain one is the program.
      self.assertIn("tfdist: the tasks were preempted and saved; submit the "
                    "same script again to resume", text)
    self.assert_nothing_left(job, directory)


def _running_job(test: absltest.TestCase, slurm: slurm_harness.LocalSlurm,
                 *args: str, elements: int = 1) -> _Job:
  """A requeueable ``sleep`` batch job (an array with ``--array=...`` in
  ``args``, of ``elements`` elements), once every element runs, as a
  preempted training job does. Cancelled when the test ends."""
  directory = _tempdir(test)
  script = os.path.join(directory, "sleep.sbatch")
  with open(script, "w") as f:
    f.write("#!/bin/sh\nexec sleep 300\n")
  job = _Job(test, slurm, script, args=["--requeue", "--output=/dev/null",
                                        "--cpus-per-task=1", *args],
             env={}, chdir=directory)

  def running():
    records = job.records()
    return len(records) == elements and all(
        _field(r, "JobState") == "RUNNING" for r in records)

  _wait(test, running, 60, lambda: job.scontrol("show", "job", job.id))
  return job


def _state(job: _Job, name: str | None = None) -> tuple[str, int]:
  """SLURM's ``(JobState, Restarts)`` for the job, or for ``name`` (an array
  element's ``ARRAYID_TASKID``)."""
  record = job.records(name)[0]
  return _field(record, "JobState"), int(_field(record, "Restarts"))


def _assert_requeued(test: absltest.TestCase, job: _Job,
                     name: str | None = None) -> None:
  """SLURM ended the run and queued the job again: PENDING, one restart.

  SLURM counts the requeue in ``scontrol requeue`` itself; the state passes
  through COMPLETING while the run is killed, hence the bounded wait.
  """
  _wait(test, lambda: _state(job, name) == ("PENDING", 1), 30,
        lambda: job.scontrol("show", "job", name or job.id))


_ON = {requeue.REQUEUE_VARIABLE: "1"}


def _watcher():
  """A `PreemptionWatcher` on the default strategy (imports TensorFlow)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.training import preemption  # pylint: disable=g-import-not-at-top
  return preemption.PreemptionWatcher(tf.distribute.get_strategy())


class RequeueRuleTest(parameterized.TestCase):
  """The decisions of `tfdist.cluster.requeue`, one table each."""

  @parameterized.named_parameters(
      ("job", {"SLURM_JOB_ID": "12"}, "12"),
      ("old_spelling", {"SLURM_JOBID": "12"}, "12"),
      ("array_element", {"SLURM_JOB_ID": "14", "SLURM_ARRAY_JOB_ID": "12",
                         "SLURM_ARRAY_TASK_ID": "2"}, "12_2"),
      ("array_element_with_the_arrays_id",
       {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "12",
        "SLURM_ARRAY_TASK_ID": "0"}, "12_0"),
      ("array_job_id_alone", {"SLURM_JOB_ID": "14",
                              "SLURM_ARRAY_JOB_ID": "12"}, "14"),
      ("not_in_slurm", {}, None),
      ("empty_job_id", {"SLURM_JOB_ID": ""}, None),
  )
  def test_job_to_requeue(self, environ, job):
    self.assertEqual(requeue.job_to_requeue(environ), job)

  @parameterized.named_parameters(
      ("unset", {}, {}),
      ("off", {requeue.REQUEUE_VARIABLE: "0"}, {}),
      ("empty", {requeue.REQUEUE_VARIABLE: ""}, {}),
      ("on", _ON, {"enabled": True}),
      ("on_word", {requeue.REQUEUE_VARIABLE: " True "}, {"enabled": True}),
      ("off_word", {requeue.REQUEUE_VARIABLE: "no"}, {}),
      ("cap", {**_ON, requeue.MAX_REQUEUES_VARIABLE: "3"},
       {"enabled": True, "max_requeues": 3}),
      ("cap_zero", {**_ON, requeue.MAX_REQUEUES_VARIABLE: "0"},
       {"enabled": True, "max_requeues": 0}),
      ("cap_empty", {**_ON, requeue.MAX_REQUEUES_VARIABLE: ""},
       {"enabled": True}),
      ("cap_while_off", {requeue.MAX_REQUEUES_VARIABLE: "2"},
       {"max_requeues": 2}),
  )
  def test_options_from_environ(self, environ, fields):
    self.assertEqual(requeue.options_from_environ(environ),
                     requeue.RequeueOptions(**fields))

  @parameterized.named_parameters(
      ("maybe", {requeue.REQUEUE_VARIABLE: "maybe"},
       requeue.REQUEUE_VARIABLE, "maybe"),
      ("two", {requeue.REQUEUE_VARIABLE: "2"}, requeue.REQUEUE_VARIABLE, "2"),
      ("negative_cap", {**_ON, requeue.MAX_REQUEUES_VARIABLE: "-1"},
       requeue.MAX_REQUEUES_VARIABLE, "-1"),
      ("cap_word", {**_ON, requeue.MAX_REQUEUES_VARIABLE: "three"},
       requeue.MAX_REQUEUES_VARIABLE, "three"),
  )
  def test_bad_environment_is_a_config_error(self, environ, field, value):
    with self.assertRaises(tfdist.ConfigError) as e:
      requeue.options_from_environ(environ)
    self.assertEqual((e.exception.field, e.exception.value,
                      e.exception.source), (field, value, "the environment"))
    self.assertIn("expected", str(e.exception))

  @parameterized.named_parameters(
      ("enabled", {"enabled": "yes"}, "enabled"),
      ("negative_cap", {"max_requeues": -1}, "max_requeues"),
      ("bool_cap", {"max_requeues": True}, "max_requeues"),
      ("zero_timeout", {"timeout_seconds": 0}, "timeout_seconds"),
      ("nan_timeout", {"timeout_seconds": float("nan")}, "timeout_seconds"),
  )
  def test_invalid_options(self, fields, field):
    with self.assertRaises(tfdist.ConfigError) as e:
      requeue.RequeueOptions(**fields)
    self.assertEqual(e.exception.field, field)

  @parameterized.named_parameters(
      ("off", {}, {"SLURM_JOB_ID": "12"}, (None, None)),
      ("off_outside_slurm", {}, {}, (None, None)),
      ("first_run", {"enabled": True}, {"SLURM_JOB_ID": "12"}, ("12", None)),
      ("no_cap", {"enabled": True},
       {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "50"}, ("12", None)),
      ("below_the_cap", {"enabled": True, "max_requeues": 2},
       {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "1"}, ("12", None)),
      ("at_the_cap", {"enabled": True, "max_requeues": 2},
       {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "2"},
       (None, "not requeueing job 12: 2 requeue(s) done, the cap "
              "(TFDIST_SLURM_MAX_REQUEUES=2)")),
      ("cap_zero_on_the_first_run", {"enabled": True, "max_requeues": 0},
       {"SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_JOB_ID": "11"},
       (None, "not requeueing job 9_1: 0 requeue(s) done, the cap "
              "(TFDIST_SLURM_MAX_REQUEUES=0)")),
      ("array_element", {"enabled": True, "max_requeues": 1},
       {"SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_JOB_ID": "11"}, ("9_1", None)),
      ("not_in_slurm", {"enabled": True}, {},
       (None, "not requeueing: not in a SLURM job (no SLURM_JOB_ID), so "
              "TFDIST_SLURM_REQUEUE=1 has nothing to requeue")),
      ("bad_restart_count", {"enabled": True},
       {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "x"},
       (None, "not requeueing job 12: SLURM_RESTART_COUNT='x' is not a count "
              "of requeues")),
  )
  def test_plan(self, fields, environ, expected):
    self.assertEqual(
        requeue.plan(requeue.RequeueOptions(**fields), environ), expected)


@pytest.mark.timeout(120)
class RequeueScontrolTest(absltest.TestCase):
  """`requeue.requeue_after_save` running the real scontrol with the local
  SLURM's environment: what it says, what SLURM did, and its time bound."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.slurm = _SHARED.get()

  def environ(self, **slurm: str) -> dict[str, str]:
    return {**self.slurm.env, **slurm}

  def test_requeues_the_job_once(self):
    job = _running_job(self, self.slurm)
    line = requeue.requeue_after_save(
        requeue.RequeueOptions(enabled=True, max_requeues=3),
        environ=self.environ(SLURM_JOB_ID=job.id, SLURM_RESTART_COUNT="1"))
    # The line counts from SLURM_RESTART_COUNT (what this run was told);
    # SLURM's record counts the requeues it did to this job: one.
    self.assertEqual(line, f"requeued job {job.id} (requeue 2 of at most 3): "
                           "it resumes from the checkpoint when SLURM starts "
                           "it again")
    _assert_requeued(self, job)

  def test_requeues_only_the_array_element(self):
    """The element whose SLURM_JOB_ID is the array's own id, which names
    every element: only ``ARRAYID_TASKID`` is requeued."""
    job = _running_job(self, self.slurm, "--array=0-1", elements=2)
    ids = {int(_field(r, "ArrayTaskId")): _field(r, "JobId")
           for r in job.records()}
    (target,) = [i for i, job_id in ids.items() if job_id == job.id]
    other = 1 - target
    line = requeue.requeue_after_save(
        requeue.RequeueOptions(enabled=True, max_requeues=3),
        environ=self.environ(SLURM_JOB_ID=job.id, SLURM_ARRAY_JOB_ID=job.id,
                             SLURM_ARRAY_TASK_ID=str(target),
                             SLURM_RESTART_COUNT="1"))
    self.assertEqual(line, f"requeued job {job.id}_{target} (requeue 2 of at "
                           "most 3): it resumes from the checkpoint when "
                           "SLURM starts it again")
    _assert_requeued(self, job, f"{job.id}_{target}")
    self.assertEqual(_state(job, f"{job.id}_{other}"), ("RUNNING", 0))

  def test_a_failing_scontrol_is_one_line_with_its_stderr(self):
    """``scontrol requeue`` of a job id the controller does not know."""
    line = requeue.requeue_after_save(
        requeue.RequeueOptions(enabled=True),
        environ=self.environ(SLURM_JOB_ID="999999"))
    prefix = ("requeueing job 999999 failed: scontrol requeue 999999 exited "
              "1: ")
    self.assertStartsWith(line, prefix)
    # SLURM 22.05 says "Invalid job id specified for job 999999".
    self.assertIn("Invalid job id", line[len(prefix):])
    self.assertNotIn("\n", line)

  def test_a_controller_that_never_answers_is_cut_at_the_bound(self):
    """scontrol facing a controller that takes the connection and never
    answers: a copy of the local slurm.conf whose SlurmctldPort is a
    loopback socket that listens (the kernel completes the connection) and
    never reads or writes. Unbounded, scontrol gives up by itself after
    MessageTimeout (10 s by default; measured: 10.0 s, "Unexpected message
    received for job 12"; a port nobody listens on: 9 s of retries), so a
    return well before that is the 1 s bound killing it."""
    with open(self.slurm.conf_path) as f:
      conf = f.read()
    self.assertRegex(conf, r"(?m)^SlurmctldHost=\S+\(127\.0\.0\.1\)$")
    silent = socket.create_server(("127.0.0.1", 0), backlog=8)
    self.addCleanup(silent.close)
    conf, count = re.subn(r"(?m)^SlurmctldPort=\d+$",
                          f"SlurmctldPort={silent.getsockname()[1]}", conf)
    self.assertEqual(count, 1)
    conf_path = os.path.join(_tempdir(self), "slurm.conf")
    with open(conf_path, "w") as f:
      f.write(conf)
    started = time.monotonic()
    line = requeue.requeue_after_save(
        requeue.RequeueOptions(enabled=True, timeout_seconds=1),
        environ=self.environ(SLURM_CONF=conf_path, SLURM_JOB_ID="12"))
    self.assertLess(stalls.running_since(started), 5)
    self.assertEqual(line, "requeueing job 12 failed: scontrol requeue 12 did "
                           "not answer within 1 s (killed; the job may not be "
                           "requeued)")


@pytest.mark.timeout(120)
class WatcherRequeueTest(parameterized.TestCase):
  """`PreemptionWatcher.exit`, in this process, with the local SLURM's
  ``SLURM_CONF`` and a running job of it: the exit code stays 42, the log
  says what happened to the job and SLURM's record shows it.

  ``scontrol requeue`` returns once the controller counted the requeue, so
  a job that still runs with no restart right after `exit` was not requeued.
  """

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.slurm = _SHARED.get()

  def preempt(self, environ: dict[str, str], signum=signal.SIGUSR1):
    """Signals a watcher on the default strategy, exits at step 3.

    ``environ`` replaces the process's SLURM and requeue variables; the
    local SLURM's ``SLURM_CONF`` is added.

    Returns:
      (the PreemptedError's code, the tfdist lines logged).
    """
    previous = {s: signal.getsignal(s) for s in tfdist.errors.STOP_SIGNALS}
    for signum_, handler in previous.items():
      self.addCleanup(signal.signal, signum_, handler)
    with mock.patch.dict(os.environ):
      for name in list(os.environ):
        if name.startswith(("SLURM_", "TFDIST_SLURM_")):
          del os.environ[name]
      os.environ.update(environ, SLURM_CONF=self.slurm.env["SLURM_CONF"])
      with self.assertLogs("absl", "WARNING") as logs, self.assertRaises(
          tfdist.PreemptedError) as e:
        with _watcher() as w:
          signal.raise_signal(signum)
          self.assertTrue(w.should_stop())
          w.exit(3)
    lines = [r.getMessage() for r in logs.records
             if r.getMessage().startswith("tfdist: ")
             and "received" not in r.getMessage()]
    return e.exception.code, lines

  def test_disabled_requeues_nothing_and_says_nothing(self):
    job = _running_job(self, self.slurm)
    code, lines = self.preempt({"SLURM_JOB_ID": job.id})
    self.assertEqual(code, 42)
    self.assertEqual(
        lines, ["tfdist: checkpoint saved at step 3; exiting with code 42"])
    self.assertEqual(_state(job), ("RUNNING", 0))

  def test_outside_slurm_says_nothing_was_requeued(self):
    """No SLURM_JOB_ID, though a controller with a running job is reachable:
    that job is left alone."""
    job = _running_job(self, self.slurm)
    code, lines = self.preempt(_ON)
    self.assertEqual(code, 42)
    self.assertEqual(lines, [
        "tfdist: checkpoint saved at step 3; exiting with code 42",
        "tfdist: not requeueing: not in a SLURM job (no SLURM_JOB_ID), so "
        "TFDIST_SLURM_REQUEUE=1 has nothing to requeue"])
    self.assertEqual(_state(job), ("RUNNING", 0))

  def test_the_chief_requeues_after_the_save(self):
    job = _running_job(self, self.slurm)
    code, lines = self.preempt({**_ON, "SLURM_JOB_ID": job.id})
    self.assertEqual(code, 42)
    self.assertEqual(lines, [
        "tfdist: checkpoint saved at step 3; exiting with code 42",
        f"tfdist: requeued job {job.id} (requeue 1): it resumes from the "
        "checkpoint when SLURM starts it again"])
    _assert_requeued(self, job)

  def test_sigint_requeues_nothing(self):
    job = _running_job(self, self.slurm)
    code, lines = self.preempt({**_ON, "SLURM_JOB_ID": job.id}, signal.SIGINT)
    self.assertEqual(code, 130)
    self.assertEqual(
        lines, ["tfdist: checkpoint saved at step 3; exiting with code 130"])
    self.assertEqual(_state(job), ("RUNNING", 0))

  def test_a_bad_variable_fails_before_training(self):
    with mock.patch.dict(os.environ, {requeue.REQUEUE_VARIABLE: "sometimes"}):
      with self.assertRaises(tfdist.ConfigError) as e:
        _watcher()
    self.assertEqual(e.exception.field, requeue.REQUEUE_VARIABLE)


if __name__ == "__main__":
  absltest.main()
