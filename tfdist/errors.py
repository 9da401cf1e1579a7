"""The errors tfdist raises.

Every error tfdist raises on purpose derives from `TfdistError`, so a caller can
catch one type. `ConfigError` carries the field, the value received, what was
expected and where the value came from, so its message says how to fix it.
"""

from __future__ import annotations

import signal
import types
from typing import Any, Mapping

__all__ = ["TfdistError", "ConfigError", "TpuUnavailableError",
           "StartupTimeoutError", "PreemptedError", "WorkerLostError",
           "CheckpointError", "DiskFullError", "WorkerFailedError",
           "PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS", "INTERRUPTED_EXIT_CODE",
           "STOP_SIGNALS", "exit_code_for"]

# The process contract: these signals in, this exit code out.

#: The signals that mean "save and stop": SIGTERM (schedulers, Kubernetes,
#: ``kill``) and SIGUSR1 (SLURM's ``--signal=USR1@N``, forwarded by tfdist's
#: sbatch templates).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

#: The exit code of a task that saved a checkpoint on SIGTERM or SIGUSR1 and
#: stopped (TensorFlow's PreemptionCheckpointHandler uses the same code).
PREEMPTED_EXIT_CODE = 42

#: The exit code of a task stopped by SIGINT (Ctrl-C): 128 + SIGINT, as a
#: shell reports a process that SIGINT ended.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT

#: Every signal that stops training, to the exit code it ends the process
#: with: the preemption signals ask to be restarted (42), SIGINT does not.
STOP_SIGNALS: Mapping[int, int] = types.MappingProxyType({
    **{signum: PREEMPTED_EXIT_CODE for signum in PREEMPTION_SIGNALS},
    signal.SIGINT: INTERRUPTED_EXIT_CODE,
})


def exit_code_for(signal_name: str) -> int:
  """The exit code for a stop signal's name; a peer's signal: preempted."""
  try:
    return STOP_SIGNALS.get(signal.Signals[signal_name], PREEMPTED_EXIT_CODE)
  except KeyError:
    return PREEMPTED_EXIT_CODE


_MISSING = object()


class TfdistError(Exception):
  """Root of every error tfdist raises on purpose."""


class ConfigError(TfdistError, ValueError):
  """A configuration value that cannot work.

  The message names the field, the value received, what was expected and the
  source of the value, e.g.::

    TF_CONFIG task.index: received 3; expected an index below 2, the number of
    entries in cluster.worker (TF_CONFIG from the environment)

  Attributes:
    field: the name of the offending field, e.g. ``"task.index"``.
    value: the value received (``None`` when it was missing).
    missing: no value was given at all (the message says "nothing").
    expected: what would have been accepted.
    source: where the value came from, e.g. ``"TF_CONFIG from the environment"``.
    hint: an optional sentence on how to fix it.
  """

  def __init__(self, *, field: str, value: Any = _MISSING, expected: str,
               source: str, hint: str | None = None):
    self.field = field
    self.missing = value is _MISSING
    self.value = None if self.missing else value
    self.expected = expected
    self.source = source
    self.hint = hint
    received = "nothing (missing)" if value is _MISSING else _short(value)
    message = f"{field}: received {received}; expected {expected} ({source})"
    if hint:
      message += f". {hint}"
    super().__init__(message)

  def restated(self, *, field: str, source: str) -> "ConfigError":
    """The same error under another field name and source, e.g. a config
    field restated as the flag that sets it."""
    return _rebuild_config_error(field, self.value, self.expected, source,
                                 self.hint, self.missing)

  def __reduce__(self):  # Keeps the error picklable across processes.
    return (_rebuild_config_error,
            (self.field, self.value, self.expected, self.source, self.hint,
             self.missing))


def _rebuild_config_error(field, value, expected, source, hint,
                          missing=False):
  given = {} if missing else {"value": value}
  return ConfigError(field=field, expected=expected, source=source, hint=hint,
                     **given)


class TpuUnavailableError(TfdistError, RuntimeError):
  """A TPU was asked for, and the TPU system could not be initialized."""


class StartupTimeoutError(TfdistError, TimeoutError):
  """Tasks a cluster needs did not come up within the start-up limit.

  The message names the missing tasks and their addresses.
  """


class PreemptedError(TfdistError, SystemExit):
  """Training stopped on a stop signal (`STOP_SIGNALS`), saving what it could.

  It is also a `SystemExit` with the signal's code: `PREEMPTED_EXIT_CODE`
  (42) for SIGTERM and SIGUSR1, `INTERRUPTED_EXIT_CODE` (130) for SIGINT.
  Left uncaught it ends the program with that code and no traceback, so a
  scheduler (SLURM's requeue, ``tfdist launch --max-restarts``) restarts a
  preempted run and training resumes at ``step``.

  Attributes:
    step: the step every worker saved at (the global step, counted from 0),
      or ``None`` when nothing was saved (the signal came during start-up or
      restore, or after training's last agreed step).
    signal_name: the signal that asked for it, e.g. ``"SIGTERM"``.
    where: with ``step=None``, when the signal came, in words.
    directory: where the chief saved, when known.
  """

  def __init__(self, *, step: int | None, signal_name: str,
               code: int | None = None, where: str = "during start-up",
               directory: str | None = None):
    self.step = step
    self.signal_name = signal_name
    self.where = where
    self.directory = directory
    code = exit_code_for(signal_name) if code is None else code
    SystemExit.__init__(self, code)
    saved = (f"checkpoint saved at step {step}" if step is not None
             else f"nothing saved ({where})")
    if step is not None and directory:
      saved += f" in {directory}"
    self.args = (f"stopped by {signal_name}: {saved}; exiting with code "
                 f"{code}" + (" to be restarted" if code ==
                              PREEMPTED_EXIT_CODE else ""),)

  def __str__(self):
    return self.args[0]

  def __reduce__(self):
    return (_rebuild_preempted, (self.step, self.signal_name, self.code,
                                 self.where, self.directory))


def _rebuild_preempted(step, signal_name, code=None, where="during start-up",
                       directory=None):
  return PreemptedError(step=step, signal_name=signal_name, code=code,
                        where=where, directory=directory)


class WorkerLostError(TfdistError, RuntimeError):
  """A peer task died, stopped or stopped answering during training.

  Raised in place of TensorFlow's ``UnavailableError``/``DeadlineExceededError``
  /``AbortedError`` so the message says what happened and what to do.
  """


class WorkerFailedError(TfdistError, RuntimeError):
  """A worker started by `tfdist.notebook_launcher` failed.

  Attributes:
    role: the worker, e.g. ``"worker:1"``.
    code: its exit code (``128 + N`` when killed by signal N).
    remote_traceback: the worker's own traceback, when it raised.
    summary: what happened, when not "exited with code N" (a preemption).
  """

  def __init__(self, role: str, code: int, remote_traceback: str = "",
               summary: str = ""):
    self.role, self.code, self.remote_traceback = role, code, remote_traceback
    self.summary = summary
    super().__init__(
        (summary or f"{role} exited with code {code}")
        + (f"; its traceback:\n{remote_traceback.rstrip()}"
           if remote_traceback else ""))

  def __reduce__(self):
    return (WorkerFailedError,
            (self.role, self.code, self.remote_traceback, self.summary))


class CheckpointError(TfdistError, RuntimeError):
  """No checkpoint in a non-empty directory could be restored.

  Training never silently starts over when checkpoints exist but are
  unreadable: fix or remove the directory to start from scratch.
  """


class DiskFullError(CheckpointError, SystemExit):
  """A checkpoint save failed for lack of space or quota; nothing else broke.

  Raised after the partial save was removed. Left uncaught it ends the
  program with its one line, ``tfdist: ...``, on stderr and exit code 1
  (it is a `SystemExit` whose code is that line), not a traceback.

  Attributes:
    directory: the directory the save was writing.
    free: bytes free there after the partial save was removed.
    last: the newest whole checkpoint, intact, or ``None`` when there is none.
    reason: the system's words, e.g. ``"No space left on device"``.
  """

  def __init__(self, *, directory: str, free: int, last: str | None,
               reason: str):
    self.directory, self.free, self.last, self.reason = (directory, free,
                                                         last, reason)
    kept = (f"the last whole checkpoint, {last}, is intact: make room and "
            "run the same command to resume from it" if last else
            "no whole checkpoint is there yet: make room, or pass a "
            "directory on a filesystem with more space")
    message = (f"saving a checkpoint in {directory} failed: {reason} "
               f"({free / 1e6:.1f} MB free there); {kept}")
    SystemExit.__init__(self, f"tfdist: {message}")
    self.args = (message,)

  def __str__(self):
    return self.args[0]

  def __reduce__(self):
    return (_rebuild_disk_full,
            (self.directory, self.free, self.last, self.reason))


def _rebuild_disk_full(directory, free, last, reason):
  return DiskFullError(directory=directory, free=free, last=last,
                       reason=reason)


def _short(value: Any, limit: int = 200) -> str:
  try:
    text = repr(value)
  except (ValueError, RecursionError):  # An int past Python's digit limit
    text = f"{type(value).__name__} too large to print"  # or deep nesting.
  return text if len(text) <= limit else text[:limit - 3] + "..."
