"""Real multi-process clusters on localhost for tests.

Every process is started by us and killed by its PID; every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

from tfdist import localhost

REPO = localhost.REPO_ROOT
SCRIPTS = os.path.join(REPO, "tests", "scripts")


free_ports = localhost.free_ports
base_env = localhost.child_env


@dataclasses.dataclass
class Result:
  returncode: int
  stdout: str
  stderr: str

  def json(self) -> dict:
    """The last line of stdout that parses as a JSON object."""
    for line in reversed(self.stdout.splitlines()):
      if line.startswith("{"):
        return json.loads(line)
    raise AssertionError(f"no JSON line in stdout:\n{self.stdout}\n"
                         f"stderr:\n{self.stderr[-3000:]}")


def session_processes(sid: int) -> list[int]:
  """PIDs of live processes in session ``sid`` (a process we started with
  ``start_new_session=True`` leads its own session)."""
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue
    # Fields after the name: state, ppid, pgrp, session, ...
    if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
      pids.append(int(entry))
  return pids


def run_alone(argv: Sequence[str], *, env: Mapping[str, str], cwd: str,
              timeout: float) -> tuple[Result, list[int]]:
  """Runs ``argv`` in a session of its own; returns its result and the PIDs
  of any process it left behind (those are killed before returning)."""
  proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    raise AssertionError(f"{argv} still running after {timeout} s:\n"
                         f"{err[-3000:]}") from None
  left = session_processes(proc.pid)
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  return Result(proc.returncode, out, err), left


def worker_configs(num_workers: int, *, num_ps: int = 0,
                   chief: bool = False) -> list[dict]:
  """One TF_CONFIG dict per task, on free ports: chief, workers, then ps."""
  return localhost.cluster_tf_configs(
      {"chief": int(chief), "worker": num_workers, "ps": num_ps})


def run_processes(commands: Sequence[Sequence[str]],
                  envs: Sequence[Mapping[str, str]], *,
                  timeout: float) -> list[Result]:
  """Runs the commands concurrently; kills all of them past ``timeout``."""
  procs = [subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
           for cmd, env in zip(commands, envs)]
  deadline = time.monotonic() + timeout
  results = []
  try:
    for proc in procs:
      remaining = max(0.1, deadline - time.monotonic())
      try:
        out, err = proc.communicate(timeout=remaining)
      except subprocess.TimeoutExpired:
        raise AssertionError(
            f"process {proc.args} did not finish within {timeout} s") from None
      results.append(Result(proc.returncode, out, err))
  finally:
    for proc in procs:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
  return results


def run_cluster(script: str, configs: Sequence[dict], *, args: Sequence[str] = (),
                timeout: float = 120, env: Mapping[str, str] | None = None
                ) -> list[Result]:
  """Runs ``tests/scripts/<script>`` once per TF_CONFIG."""
  path = os.path.join(SCRIPTS, script)
  return run_processes(
      [[sys.executable, path, *args] for _ in configs],
      [base_env({**(env or {}), "TF_CONFIG": json.dumps(c)}) for c in configs],
      timeout=timeout)


def run_script(script: str, *, args: Sequence[str] = (), timeout: float = 120,
               env: Mapping[str, str] | None = None) -> Result:
  """Runs one ``tests/scripts/<script>`` without TF_CONFIG."""
  return run_processes([[sys.executable, os.path.join(SCRIPTS, script), *args]],
                       [base_env(env)], timeout=timeout)[0]
