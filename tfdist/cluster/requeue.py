"""In-process requeue: the task that saved on preemption requeues its SLURM job.

For scripts that send USR1 to the tasks (``--signal=USR1@N``) and expect the
training process to requeue its job after it saved, as PyTorch Lightning's
``auto_requeue`` does. ``tfdist.fit(backup_dir=...)``, `tfdist.BackupAndRestore`
and `tfdist.Runner` call `requeue_after_save` on the chief once every worker
saved on SIGTERM or SIGUSR1, just before the process exits with 42.

The rule, read from the environment of every task:

* off unless ``TFDIST_SLURM_REQUEUE=1`` (`REQUEUE_VARIABLE`; ``tfdist slurm
  --requeue-from task`` exports it): tfdist's default scripts requeue from
  the batch shell instead;
* only the chief (`tfdist.cluster.info.is_chief_task`: rank 0 of an
  MultiWorkerMirrored step, the ParameterServer coordinator, a single
  process) runs ``scontrol requeue``, bounded by `TIMEOUT_SECONDS`, and
  logs one ``tfdist: `` line saying what it did or why not (the cap was
  reached, scontrol failed with its stderr or did not answer in time, the
  process is not in a SLURM job); a SIGINT (exit 130) requeues nothing;
* the job named is ``SLURM_JOB_ID``, or ``ARRAYID_TASKID``
  (``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID``) for an array element:
  one element's ``SLURM_JOB_ID`` is the array's id, which names every
  element;
* ``TFDIST_SLURM_MAX_REQUEUES=K`` (`MAX_REQUEUES_VARIABLE`) caps it: once
  ``SLURM_RESTART_COUNT`` (SLURM's count of this job's requeues) reaches K
  the job is not requeued and ends with 42.

SLURM then ends the job (the saved tasks only log the SIGTERM) and queues it
again. Nothing here raises: a failed or timed-out scontrol is a logged line,
and the exit code stays 42. TensorFlow-free.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
from typing import Mapping

from tfdist.errors import ConfigError

__all__ = ["REQUEUE_VARIABLE", "MAX_REQUEUES_VARIABLE", "TIMEOUT_SECONDS",
           "RequeueOptions", "options_from_environ", "job_to_requeue", "plan",
           "requeue_after_save"]

#: ``1`` turns in-process requeue on, ``0`` or unset leaves it off.
REQUEUE_VARIABLE = "TFDIST_SLURM_REQUEUE"
#: Requeue at most this many times (against ``SLURM_RESTART_COUNT``).
MAX_REQUEUES_VARIABLE = "TFDIST_SLURM_MAX_REQUEUES"
#: The bound on ``scontrol requeue``.
TIMEOUT_SECONDS = 10.0

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off", "")
_SOURCE = "tfdist.cluster.requeue.RequeueOptions"
_ENV_SOURCE = "the environment"
_MAX_STDERR = 300


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequeueOptions:
  """Whether and how the chief requeues its SLURM job after a preempted save.

  Attributes:
    enabled: run ``scontrol requeue``; ``False`` does nothing and logs
      nothing.
    max_requeues: requeue only while ``SLURM_RESTART_COUNT`` is below this;
      ``None``: no cap.
    timeout_seconds: the bound on ``scontrol requeue``.
  """
  enabled: bool = False
  max_requeues: int | None = None
  timeout_seconds: float = TIMEOUT_SECONDS

  def __post_init__(self):
    if not isinstance(self.enabled, bool):
      raise ConfigError(field="enabled", value=self.enabled, source=_SOURCE,
                        expected="True or False")
    if self.max_requeues is not None and (
        isinstance(self.max_requeues, bool)
        or not isinstance(self.max_requeues, int) or self.max_requeues < 0):
      raise ConfigError(field="max_requeues", value=self.max_requeues,
                        source=_SOURCE,
                        expected="a non-negative integer, or None for no cap")
    if (isinstance(self.timeout_seconds, bool)
        or not isinstance(self.timeout_seconds, (int, float))
        or not math.isfinite(self.timeout_seconds)
        or self.timeout_seconds <= 0):
      raise ConfigError(field="timeout_seconds", value=self.timeout_seconds,
                        source=_SOURCE, expected="a positive number of seconds")


def _count(text: str) -> int | None:
  """A non-negative decimal count, or None."""
  text = text.strip()
  if text.isascii() and text.isdigit() and len(text) <= 9:
    return int(text)
  return None


def options_from_environ(environ: Mapping[str, str] | None = None
                         ) -> RequeueOptions:
  """`RequeueOptions` from `REQUEUE_VARIABLE` and `MAX_REQUEUES_VARIABLE`.

  Args:
    environ: the variables to read; ``os.environ`` by default.

  Raises:
    ConfigError: a value that is not ``1``/``0`` (or true/false, yes/no,
      on/off), or a cap that is not a non-negative integer.
  """
  env = os.environ if environ is None else environ
  raw = env.get(REQUEUE_VARIABLE, "")
  if raw.strip().lower() not in _ON + _OFF:
    raise ConfigError(field=REQUEUE_VARIABLE, value=raw, source=_ENV_SOURCE,
                      expected="1 (the chief requeues the SLURM job after a "
                               "preempted save) or 0 (it does not)")
  cap = env.get(MAX_REQUEUES_VARIABLE)
  if cap is not None and cap.strip() and _count(cap) is None:
    raise ConfigError(field=MAX_REQUEUES_VARIABLE, value=cap,
                      source=_ENV_SOURCE,
                      expected="a non-negative integer: requeue at most that "
                               "many times (SLURM_RESTART_COUNT counts them)")
  return RequeueOptions(
      enabled=raw.strip().lower() in _ON,
      max_requeues=_count(cap) if cap and cap.strip() else None)


def job_to_requeue(environ: Mapping[str, str]) -> str | None:
  """The id ``scontrol requeue`` needs: the array element's, else the job's.

  ``None`` outside a SLURM job.
  """
  array_job = environ.get("SLURM_ARRAY_JOB_ID", "").strip()
  array_task = environ.get("SLURM_ARRAY_TASK_ID", "").strip()
  if array_job and array_task:
    return f"{array_job}_{array_task}"
  job = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "")
  return job.strip() or None


def plan(options: RequeueOptions, environ: Mapping[str, str]
         ) -> tuple[str | None, str | None]:
  """What to do after a preempted save, without doing it.

  Returns:
    ``(job, None)``: requeue ``job``. ``(None, line)``: do not, and log
    ``line``. ``(None, None)``: requeue is off; log nothing.
  """
  if not options.enabled:
    return None, None
  job = job_to_requeue(environ)
  if job is None:
    return None, (f"not requeueing: not in a SLURM job (no SLURM_JOB_ID), "
                  f"so {REQUEUE_VARIABLE}=1 has nothing to requeue")
  raw = environ.get("SLURM_RESTART_COUNT", "0")
  done = _count(raw)
  if done is None:
    return None, (f"not requeueing job {job}: SLURM_RESTART_COUNT={raw!r} is "
                  "not a count of requeues")
  if options.max_requeues is not None and done >= options.max_requeues:
    return None, (f"not requeueing job {job}: {done} requeue(s) done, the cap "
                  f"({MAX_REQUEUES_VARIABLE}={options.max_requeues})")
  return job, None


def _scontrol(environ: Mapping[str, str]) -> str | None:
  path = environ.get("PATH", os.defpath)
  return shutil.which("scontrol", path=path + os.pathsep + "/usr/bin:/usr/sbin")


def requeue_after_save(options: RequeueOptions | None = None, *,
                       environ: Mapping[str, str] | None = None) -> str | None:
  """Requeues this SLURM job if ``options`` say so; call it on the chief only.

  Runs ``scontrol requeue JOB`` (bounded by ``options.timeout_seconds``) when
  `plan` names a job. Never raises and never waits longer than the bound.

  Args:
    options: what to do; `options_from_environ` by default.
    environ: the variables to read, also scontrol's environment;
      ``os.environ`` by default.

  Returns:
    The line to log (without the ``tfdist: `` prefix) saying what was done
    or why not; ``None`` when requeue is off.
  """
  env = os.environ if environ is None else environ
  try:
    options = options_from_environ(env) if options is None else options
  except ConfigError as e:
    return f"not requeueing: {e}"
  job, line = plan(options, env)
  if job is None:
    return line
  done = _count(env.get("SLURM_RESTART_COUNT", "0")) or 0
  cap = ("" if options.max_requeues is None
         else f" of at most {options.max_requeues}")
  failed = f"requeueing job {job} failed: scontrol requeue {job}"
  scontrol = _scontrol(env)
  if scontrol is None:
    return f"not requeueing job {job}: no scontrol on PATH"
  try:
    proc = subprocess.run(
        [scontrol, "requeue", job], env=None if environ is None else dict(env),
        stdin=subprocess.DEVNULL, capture_output=True, text=True,
        errors="replace", timeout=options.timeout_seconds, check=False)
  except subprocess.TimeoutExpired:
    return (f"{failed} did not answer within {options.timeout_seconds:g} s "
            "(killed; the job may not be requeued)")
  except OSError as e:
    return f"{failed} could not run: {e}"
  if proc.returncode != 0:
    stderr = "; ".join(line.strip() for line in proc.stderr.splitlines()
                       if line.strip()) or "no message"
    if len(stderr) > _MAX_STDERR:
      stderr = stderr[:_MAX_STDERR - 3] + "..."
    return f"{failed} exited {proc.returncode}: {stderr}"
  return (f"requeued job {job} (requeue {done + 1}{cap}): it resumes from "
          "the checkpoint when SLURM starts it again")
