"""The stall report: which task is behind, at which step, on which line.

Each task of ``tfdist launch`` keeps a flight record of its collectives
(`tfdist._flight`) and dumps it, with every thread's stack, into this
round's flight directory when asked. The launcher asks (`ask`) on
``SIGUSR2``, when a task's collective timed out or lost a peer, and when a
task saw no step for ``--stall-seconds``; it waits at most `WAIT_S` for the
dumps (`collect`) and prints one screen (`report`): each task's step and last
collective, who is behind and by how much, the innermost frame of the user's
code in each task, and where the dumps are. A task that cannot dump (stopped,
ended, or unable to write) is named with the reason. On several nodes each
node's launcher reports its own tasks and sends what it found to node 0,
which reports every node's tasks together (`Flight.merge`) while the
rendezvous still reaches it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from typing import Callable, Mapping, Sequence

from tfdist import _flight
from tfdist.errors import ConfigError

__all__ = ["WAIT_S", "SIGNAL", "Flight", "ask", "collect", "report",
           "stalled"]

#: The signal that asks the launcher for a report.
SIGNAL = signal.SIGUSR2
#: How often the launcher looks for a task's stall dump.
_LOOK_S = 1.0

#: The most the launcher waits for the tasks' dumps.
WAIT_S = 10.0
_POLL_S = 0.1
#: A dump's reason when a task saw no step (`tfdist._flight`).
_STALL = "no step for"
#: A task's line when it could not write its dump (`tfdist._flight.dump`).
_UNWRITTEN = "could not write its flight record"

#: A task's answer: its dump, or why there is none.
Found = Mapping[str, "dict | str"]


class Flight:
  """The launcher's side: each round's flight directory, and the report.

  The dumps go under ``<log_dir>/flight/<round>/``, or without a log
  directory under ``$TMPDIR/tfdist-flight-<pid>-<random>/<round>/``,
  made by the first dump: a run without one writes nothing. A temporary
  one is removed at the end unless a report named it.

  Raises:
    ConfigError: ``<log_dir>/flight`` is there and no directory, said at
      start.
  """

  def __init__(self, *, log_dir: str | None, stall_seconds: float,
               say: Callable[[str], None], source: str,
               share: Callable[[dict], None] | None = None):
    """Checks the directory; ``share`` sends a report's findings to node 0
    (``None`` on node 0 and on one node)."""
    self._stall = stall_seconds
    self._say = say
    self._share = share
    self._temporary = log_dir is None
    # Unguessable where no log directory is given: nobody else makes it.
    self._root = (os.path.join(log_dir, "flight") if log_dir else
                  os.path.join(tempfile.gettempdir(), f"tfdist-flight-"
                               f"{os.getpid()}-{secrets.token_hex(8)}"))
    if os.path.lexists(self._root) and not os.path.isdir(self._root):
      # The log directory itself is checked where it is made.
      raise ConfigError(
          field="log_dir", value=log_dir, source=source,
          expected="a directory that can hold the tasks' flight records",
          hint=f"Move or remove {self._root}: it is no directory")
    self._reported = False
    self.asked = False  # Set by the signal handler: a report is wanted.
    self.directory = self._root
    self._since = time.time()
    self._seen: set[str] = set()
    self._looked = 0.0

  def env(self, attempt: int) -> dict[str, str]:
    """The tasks' variables for round ``attempt``."""
    self.directory = os.path.join(self._root, str(attempt))
    self._since = time.time()
    env = {_flight.DIR_VARIABLE: self.directory}
    if self._stall:
      env[_flight.STALL_VARIABLE] = f"{self._stall:g}"
    return env

  def watch(self, pids: Mapping[str, int],
            notes: Mapping[str, Sequence[str]]) -> None:
    """Reports when asked, or when a task's dump says it stalled.

    Args:
      pids: each task (``worker:1``) to its process id.
      notes: each task's last lines of output.
    """
    why = None
    if self.asked:
      self.asked, why = False, "SIGUSR2 to the launcher"
    elif self._stall and time.monotonic() - self._looked > _LOOK_S:
      self._looked = time.monotonic()
      why = stalled(self.directory, self._seen)
    if why:
      self._report(pids, notes, why)

  def lost_peer(self, role: str) -> dict | None:
    """The dump task ``role`` wrote this round as a collective failed on a
    peer (a timeout, a lost peer), if it did."""
    dump = _dumps(self.directory).get(role)
    if (dump and dump.get("time", 0) >= self._since and str(
        dump.get("reason")).split(":")[0] in _flight.COLLECTIVE_FAILURES):
      return dump
    return None

  def failed(self, role: str, code: int, dump: dict,
             pids: Mapping[str, int],
             notes: Mapping[str, Sequence[str]]) -> None:
    """Task ``role`` failed as a collective failed (``dump``, from
    `lost_peer`): the report."""
    self._report(pids, notes, f"{role} exited {code}: {dump['reason']}")

  def close(self) -> None:
    """Removes a temporary directory no report named."""
    if self._temporary and not self._reported:
      shutil.rmtree(self._root, ignore_errors=True)

  def _report(self, pids: Mapping[str, int],
              notes: Mapping[str, Sequence[str]], why: str) -> None:
    try:
      request = ask(self.directory)
    except OSError as e:
      request = 0  # The tasks' own dumps still tell what they can.
      why += f"; the tasks could not be asked ({e.strerror or e})"
    found = collect(self.directory, pids, request=request, since=self._since,
                    notes=notes)
    self._reported = True
    # One report a stall: the tasks' stall dumps of this one are said.
    self._seen.update(_key(t, d) for t, d in found.items()
                      if isinstance(d, dict))
    self._say("\n".join(report(found, why=why, directory=self.directory)))
    if self._share is not None:  # Node 0 may be gone: this report stands.
      self._share({"kind": "report", "why": why, "directory": self.directory,
                   "found": {t: _brief(d) for t, d in found.items()}})

  def merge(self, rank: int, message: dict, pids: Mapping[str, int]) -> None:
    """Node 0: node ``rank`` reported; says every node's tasks together,
    this node's as their dumps stand."""
    try:
      found = {**collect(self.directory, pids, request=0, since=self._since,
                         wait_s=0),
               **{str(t): d if isinstance(d, (dict, str)) else str(d)
                  for t, d in dict(message["found"]).items()}}
      lines = report(found, why=f"every node; node {rank}: {message['why']}",
                     directory=f"{self.directory} (node 0), "
                               f"{message['directory']} (node {rank})")
    except (KeyError, TypeError, ValueError) as e:
      lines = [f"node {rank} sent a stall report that cannot be read ({e})"]
    self._reported = True
    self._say("\n".join(lines))


def ask(directory: str) -> int:
  """Asks every task writing to ``directory`` for a dump; the request's
  number, which the dumps answering it carry."""
  os.makedirs(directory, mode=0o700, exist_ok=True)
  path = os.path.join(directory, _flight.REQUEST_FILE)
  try:
    with open(path) as f:
      number = int(f.read().strip() or 0) + 1
  except (OSError, ValueError):
    number = 1
  with open(path + ".tmp", "w") as f:
    f.write(str(number))
  os.replace(path + ".tmp", path)
  return number


def stalled(directory: str, seen: set[str]) -> str | None:
  """The first task whose dump says it saw no step and is not in ``seen``
  (it is added); ``None`` when there is none."""
  for task, dump in sorted(_dumps(directory).items()):
    key = _key(task, dump)
    if str(dump.get("reason", "")).startswith(_STALL) and key not in seen:
      seen.add(key)
      return f"{task} saw {dump['reason']}"
  return None


def collect(directory: str, pids: Mapping[str, int], *, request: int,
            since: float, notes: Mapping[str, Sequence[str]] | None = None,
            wait_s: float = WAIT_S) -> dict[str, dict | str]:
  """Each task's dump answering ``request``, or why it has none.

  Args:
    directory: this round's flight directory.
    pids: each task (``worker:1``) to its process id.
    request: the number `ask` returned; a dump written since ``since``
      for another reason (a timeout, a stall) answers too.
    since: ``time.time()`` when the round began.
    notes: each task's last lines of output: one saying it could not write
      its dump stands for the dump.
    wait_s: the bound on waiting.
  """
  deadline = time.monotonic() + wait_s
  while True:
    dumps = _dumps(directory)
    found: dict[str, dict | str] = {}
    for task, pid in pids.items():
      dump = dumps.get(task)
      if dump and (dump.get("request", 0) >= request
                   or dump.get("time", 0) >= since
                   and dump.get("reason") != "the launcher asked"):
        found[task] = dump
      else:
        unwritten = [line.strip() for line in (notes or {}).get(task, ())
                     if _UNWRITTEN in line]
        found[task] = unwritten[-1] if unwritten else _state(pid)
    waiting = [t for t, f in found.items() if f == "running"]
    if not waiting or time.monotonic() >= deadline:
      return {t: (f"no dump within {wait_s:g} s" if f == "running" else f)
              for t, f in found.items()}
    time.sleep(_POLL_S)


def report(found: Found, *, why: str, directory: str,
           now: float | None = None) -> list[str]:
  """The report's lines: at most 3 a task and 3 more."""
  now = time.time() if now is None else now
  dumps = {t: d for t, d in found.items() if isinstance(d, dict)}
  places = {t: _place(d) for t, d in dumps.items()}
  lead = max(places.values(), default=(0, 0))
  behind, lines = [], []
  for task in sorted(found, key=_order):
    dump = found[task]
    if not isinstance(dump, dict):
      behind.append(f"{task} ({dump})")
      lines.append(f"  {task}: no flight record: {dump}")
      continue
    step, done = places[task]
    state = ""
    if step < lead[0]:
      gap = f"{lead[0] - step} step{'s' * (lead[0] - step > 1)}"
      state = f", BEHIND by {gap}"
      behind.append(f"{task} (by {gap}, at step {step})")
    elif done < lead[1]:
      state = f", BEHIND in step {step} by {lead[1] - done} collective(s)"
      behind.append(f"{task} (in step {step})")
    lines.append(f"  {task}: step {step}{state}; "
                 f"{_describe(_last(dump), now)}")
    lines.append(f"      at {dump.get('where') or 'no frame of user code'}")
  head = (f"stall report ({why}): behind: {', '.join(behind)}"
          if behind else f"stall report ({why}): no task is behind")
  named = sorted(os.path.basename(d["stacks"]) for d in dumps.values()
                 if d.get("stacks"))
  tail = (f"  dumps (record .json, stacks .stacks.txt): {directory}"
          if named else f"  no dump was written in {directory}")
  return [head, *lines, tail]


def _brief(dump: dict | str) -> dict | str:
  """A dump as the report reads it: the records of its step and its last."""
  if not isinstance(dump, dict):
    return dump
  step, last = dump.get("step"), _last(dump)
  records = [r for r in dump.get("records", ()) if r["step"] == step]
  if last is not None and last not in records:
    records.append(last)
  return {**dump, "records": records}


def _key(task: str, dump: dict) -> str:
  """A stall of ``task``: its last progress before it."""
  return f"{task}@{dump.get('progress_at')}"


def _dumps(directory: str) -> dict[str, dict]:
  found = {}
  try:
    names = os.listdir(directory)
  except OSError:
    return found
  for name in names:
    if not name.endswith(".json"):
      continue
    try:
      with open(os.path.join(directory, name)) as f:
        dump = json.load(f)
    except (OSError, ValueError):
      continue  # Being replaced: the next look reads it.
    if isinstance(dump, dict) and "role" in dump:
      found[dump["role"]] = dump
  return found


def _state(pid: int) -> str:
  """``running``, or why a task that is no process that runs cannot dump."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      state = f.read().rpartition(")")[2].split()[0]
  except (OSError, IndexError):
    return "ended"
  if state in ("T", "t"):
    return "stopped (SIGSTOP or a debugger): it cannot answer"
  if state in ("Z", "X"):
    return "ended"
  return "running"


def _place(dump: dict) -> tuple[int, int]:
  """(step, collectives entered in that step): who is further."""
  step = int(dump.get("step") or 0)
  return step, sum(1 for r in dump.get("records", ()) if r["step"] == step)


def _last(dump: dict) -> dict | None:
  """The collective a task waits in (the innermost still open), else the
  last it entered."""
  records = dump.get("records") or ()
  waiting = [r for r in records if r.get("left") is None]
  return max(waiting or records, key=lambda r: r["entered"], default=None)


def _describe(record: dict | None, now: float) -> str:
  if record is None:
    return "no collective yet"
  what = f"{record['kind']} ({record['transport']}"
  if record.get("bytes"):
    what += f", {_size(record['bytes'])}"
  what += f", {record['peers']})"
  if record.get("left") is None:
    return f"in {what} for {now - record['entered']:.1f} s"
  ended = "failed" if record.get("failed") else "left"
  return f"{ended} {what} {now - record['left']:.1f} s ago"


def _size(nbytes: int) -> str:
  for unit in ("B", "KiB", "MiB"):
    if nbytes < 1024:
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  return f"{nbytes:.1f} GiB"


def _order(task: str) -> tuple[str, int]:
  kind, _, index = task.partition(":")
  return (kind, int(index)) if index.isdigit() else (task, 0)
