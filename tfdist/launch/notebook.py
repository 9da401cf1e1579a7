"""Training from a notebook cell on several local workers (Colab, Jupyter).

`notebook_launcher` is tfdist's answer to accelerate's launcher of the same
name: it runs ``function(*args)`` once per worker, each a fresh Python process
with its own TF_CONFIG (a MultiWorkerMirrored cluster on free loopback ports,
through `tfdist.launch.local`), streams their output into the cell with the
worker's role before each line, and returns what the chief's call returned.

The function travels by value (``cloudpickle``), so one defined in a cell
works; what it uses from other cells must be picklable, and it should import
TensorFlow and build its strategy itself (``tfdist.make_strategy()``), since
each worker is a new process. Nothing of TensorFlow runs in the notebook's
own process, which can launch again.

A failed or preempted worker, or an interrupted cell, stops every worker (see
`notebook_launcher`'s Raises); no process is left behind, and the temporary
files are removed in every case.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Mapping, Sequence, TextIO

from tfdist.errors import ConfigError
from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import WorkerFailedError
from tfdist.launch import local
from tfdist.launch import output
from tfdist.launch import spec as spec_lib

__all__ = ["notebook_launcher"]

#: The worker's program: ``python -m`` this, with the payload directory.
WORKER_MODULE = "tfdist.launch._notebook_worker"
_RESUME = "call notebook_launcher again to resume"


def notebook_launcher(function: Callable[..., Any], args: Sequence[Any] = (),
                      *, num_workers: int = 2,
                      env: Mapping[str, str] | None = None,
                      grace_seconds: float = 10.0,
                      out: TextIO | None = None) -> Any:
  """Runs ``function(*args)`` on ``num_workers`` local workers.

  Call it from the main thread (a notebook cell runs there): it handles
  SIGINT while the workers run.

  Args:
    function: the training function; any callable cloudpickle can send.
    args: its positional arguments.
    num_workers: worker processes, one MultiWorkerMirrored cluster.
    env: extra environment for the workers.
    grace_seconds: how long a worker may take to stop after SIGTERM.
    out: where the workers' prefixed output goes; ``sys.stdout`` (the
      cell) by default.

  Returns:
    What ``function`` returned on the chief (worker 0).

  Raises:
    ConfigError: ``function`` or ``args`` cannot be sent, or the launch
      spec is invalid; nothing was started.
    WorkerFailedError: a worker failed or was preempted (code 42); the
      others were stopped.
    KeyboardInterrupt: the cell was interrupted; every worker was stopped.
  """
  import cloudpickle  # pylint: disable=g-import-not-at-top
  payload = tempfile.mkdtemp(prefix="tfdist-notebook-")
  try:
    try:
      blob = cloudpickle.dumps((function, tuple(args)))
    except Exception as e:  # pylint: disable=broad-except
      raise ConfigError(
          field="function", value=function, source="tfdist.notebook_launcher",
          expected="a function and arguments cloudpickle can send",
          hint=f"{type(e).__name__}: {e}") from None
    with open(os.path.join(payload, "call.pkl"), "wb") as f:
      f.write(blob)
    spec = spec_lib.LaunchSpec(
        command=(sys.executable, "-m", WORKER_MODULE, payload),
        num_workers=num_workers, env=dict(env or {}),
        grace_seconds=grace_seconds)
    code = local.launch(spec, out=out, resume=_RESUME)
    if code == 0:
      with open(os.path.join(payload, "result.pkl"), "rb") as f:
        return cloudpickle.loads(f.read())
    if code == 128 + signal.SIGINT:
      raise KeyboardInterrupt
    raise _failure(payload, code)
  finally:
    shutil.rmtree(payload, ignore_errors=True)


def _failure(payload: str, code: int) -> WorkerFailedError:
  """The error of the worker that failed first (by its traceback file, or
  what it said when preempted)."""
  kind = "preempted-" if code == PREEMPTED_EXIT_CODE else "error-"
  failed = sorted((os.path.getmtime(os.path.join(payload, name)), name)
                  for name in os.listdir(payload) if name.startswith(kind))
  text, role = "", "a worker"
  if failed:
    name = failed[0][1]
    role = name[len(kind):-len(".txt")].replace("-", ":")
    with open(os.path.join(payload, name)) as f:
      text = f.read()
  if code == PREEMPTED_EXIT_CODE:
    return WorkerFailedError(role, code, summary=output.preempted_line(
        role, [text], resume=_RESUME))
  return WorkerFailedError(role, code, text)
