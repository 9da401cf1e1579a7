"""The errors tfdist raises.

Every error tfdist raises on purpose derives from `TfdistError`, so a caller can
catch one type. `ConfigError` carries the field, the value received, what was
expected and where the value came from, so its message says how to fix it.
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["TfdistError", "ConfigError", "TpuUnavailableError",
           "StartupTimeoutError", "PreemptedError", "WorkerLostError",
           "CheckpointError", "PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS"]

# The process contract: these signals in, this exit code out.

#: The signals that mean "save and stop": SIGTERM (schedulers, Kubernetes,
#: ``kill``) and SIGUSR1 (SLURM's ``--signal=USR1@N``, forwarded by tfdist's
#: sbatch templates).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

#: The exit code of a task that saved a checkpoint on SIGTERM or SIGUSR1 and
#: stopped (TensorFlow's PreemptionCheckpointHandler uses the same code).
PREEMPTED_EXIT_CODE = 42


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
    expected: what would have been accepted.
    source: where the value came from, e.g. ``"TF_CONFIG from the environment"``.
    hint: an optional sentence on how to fix it.
  """

  def __init__(self, *, field: str, value: Any = _MISSING, expected: str,
               source: str, hint: str | None = None):
    self.field = field
    self.value = None if value is _MISSING else value
    self.expected = expected
    self.source = source
    self.hint = hint
    received = "nothing (missing)" if value is _MISSING else _short(value)
    message = f"{field}: received {received}; expected {expected} ({source})"
    if hint:
      message += f". {hint}"
    super().__init__(message)

  def __reduce__(self):  # Keeps the error picklable across processes.
    return (_rebuild_config_error,
            (self.field, self.value, self.expected, self.source, self.hint))


def _rebuild_config_error(field, value, expected, source, hint):
  return ConfigError(field=field, value=value, expected=expected,
                     source=source, hint=hint)


class TpuUnavailableError(TfdistError, RuntimeError):
  """A TPU was asked for, and the TPU system could not be initialized."""


class StartupTimeoutError(TfdistError, TimeoutError):
  """Tasks a cluster needs did not come up within the start-up limit.

  The message names the missing tasks and their addresses.
  """


class PreemptedError(TfdistError, SystemExit):
  """Training saved a checkpoint on a preemption signal and stopped.

  It is also a `SystemExit` with code `PREEMPTED_EXIT_CODE`: left uncaught it
  ends the program with that code and no traceback, so a scheduler (SLURM's
  requeue, ``tfdist launch --max-restarts``) restarts it and training resumes
  at ``step``.

  Attributes:
    step: the step every worker saved at (the global step, counted from 0).
    signal_name: the signal that asked for it, e.g. ``"SIGTERM"``.
  """

  def __init__(self, *, step: int, signal_name: str):
    self.step = step
    self.signal_name = signal_name
    SystemExit.__init__(self, PREEMPTED_EXIT_CODE)
    self.args = (f"preempted by {signal_name}: checkpoint saved at step "
                 f"{step}; exiting with code {PREEMPTED_EXIT_CODE} to be "
                 "restarted",)

  def __str__(self):
    return self.args[0]

  def __reduce__(self):
    return (_rebuild_preempted, (self.step, self.signal_name))


def _rebuild_preempted(step, signal_name):
  return PreemptedError(step=step, signal_name=signal_name)


class WorkerLostError(TfdistError, RuntimeError):
  """A peer task died, stopped or stopped answering during training.

  Raised in place of TensorFlow's ``UnavailableError``/``DeadlineExceededError``
  /``AbortedError`` so the message says what happened and what to do.
  """


class CheckpointError(TfdistError, RuntimeError):
  """No checkpoint in a non-empty directory could be restored.

  Training never silently starts over when checkpoints exist but are
  unreadable: fix or remove the directory to start from scratch.
  """


def _short(value: Any, limit: int = 200) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."
