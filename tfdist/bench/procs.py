"""Bounded subprocesses for the bench: every one is ours, timed and reaped.

Each process starts in its own session; on a deadline (or any error) the
launcher's stopper (`tfdist.launch.stopper`) stops its whole process group:
SIGTERM, then SIGKILL after a short grace. Nothing the bench starts outlives
the call that started it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from typing import Mapping, Sequence

from tfdist import _net
from tfdist.errors import TfdistError
from tfdist.launch import stopper

__all__ = ["BenchProcessError", "Finished", "run_all", "worker_env",
           "tf_configs", "json_lines", "python_module"]

_GRACE_S = 5.0


class BenchProcessError(TfdistError):
  """A process the bench started failed or ran past its time limit."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finished:
  """A process that ended.

  Attributes:
    returncode: its exit status.
    stdout: what it printed.
    stderr: its error output.
    ended: ``time.time()`` when it was seen to end.
  """
  returncode: int
  stdout: str
  stderr: str
  ended: float


def python_module(module: str, *args: str) -> list[str]:
  """``python -m module args`` with this interpreter."""
  return [sys.executable, "-m", module, *args]


worker_env = _net.child_env
tf_configs = _net.worker_tf_configs


def run_all(commands: Sequence[Sequence[str]],
            envs: Sequence[Mapping[str, str]], *, timeout_s: float,
            what: str) -> list[Finished]:
  """Runs the commands at once and waits for all, at most ``timeout_s``.

  Raises:
    BenchProcessError: one exited non-zero or the deadline passed; every
      process has been stopped by then.
  """
  procs = []
  try:
    for cmd, env in zip(commands, envs):
      procs.append(subprocess.Popen(
          list(cmd), env=dict(env), stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
          start_new_session=True))
    deadline = time.monotonic() + timeout_s
    results = [None] * len(procs)
    pending = set(range(len(procs)))
    while pending:
      for i in sorted(pending):
        # communicate() drains the pipes so a chatty child never blocks.
        try:
          out, err = procs[i].communicate(timeout=0.2)
        except subprocess.TimeoutExpired:
          continue
        results[i] = Finished(returncode=procs[i].returncode, stdout=out,
                              stderr=err, ended=time.time())
        pending.discard(i)
        if procs[i].returncode != 0:
          raise BenchProcessError(
              f"bench {what}: {' '.join(procs[i].args[:4])} exited with "
              f"{procs[i].returncode}: {err.strip()[-1500:]}")
      if pending and time.monotonic() > deadline:
        raise BenchProcessError(
            f"bench {what}: still running after {timeout_s:.0f} s; stopped")
    return results
  finally:
    stopper.stop(procs, grace_seconds=_GRACE_S)
    for p in procs:
      p.stdout.close()
      p.stderr.close()


def json_lines(text: str) -> list[dict]:
  """Every line of ``text`` that holds a JSON object (after any prefix)."""
  found = []
  for line in text.splitlines():
    start = line.find("{")
    if start < 0:
      continue
    try:
      value = json.loads(line[start:])
    except ValueError:
      continue
    if isinstance(value, dict):
      found.append(value)
  return found
