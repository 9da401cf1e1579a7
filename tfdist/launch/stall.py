"""The stall report: which task is behind, at which step, on which line.

Each task of ``tfdist launch`` keeps a flight record of its collectives
(`tfdist._flight`) and dumps it, with every thread's stack, when asked. On
``SIGUSR2`` to any node's launcher, a failed collective, or no step for
``--stall-seconds``, that node answers and sends an ``ask``, which node 0's
rendezvous relays to every node. A node answers by asking its tasks (`ask`),
waiting at most `WAIT_S` for dumps written for the request or after it
(`collect`), and sending node 0 each task's `brief`, aged by its own clock.
Node 0 prints one report of every node (`report`), naming a node that did
not answer within `ANSWER_S`, and keeps it as JSON beside its dumps.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from typing import Callable, Mapping, Sequence

from tfdist import _flight
from tfdist.errors import ConfigError

__all__ = ["WAIT_S", "ANSWER_S", "BRIEF_RECORDS", "SIGNAL", "Flight", "ask",
           "brief", "collect", "report", "stalled"]

#: The signal that asks the launcher for a report.
SIGNAL = signal.SIGUSR2
#: How often the launcher looks for a task's stall dump.
_LOOK_S = 1.0

#: The most a node waits for its tasks' dumps.
WAIT_S = 10.0
#: The most node 0 waits for every node's answer.
ANSWER_S = WAIT_S + 5.0
#: A task's collectives in its brief: its last ones.
BRIEF_RECORDS = 8
_POLL_S = 0.1
#: A dump's reason when a task saw no step (`tfdist._flight`).
_STALL = "no step for"
#: A task's line when it could not write its dump (`tfdist._flight.dump`).
_UNWRITTEN = "could not write its flight record"


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
               say: Callable[[str], None], source: str, rank: int = 0,
               send: Callable[[dict], None] | None = None):
    """Checks the directory; ``send`` carries this node's ``ask`` and
    ``report`` messages to node 0 (``None`` on one node)."""
    self._stall = stall_seconds
    self._say = say
    self._rank = rank
    self._send = send or (lambda m: self._pend({**m, "nodes": [0]}) if m[
        "kind"] == "ask" else self.merge(0, m))  # One node: no rendezvous.
    self._node = f"node {rank}: " if send else ""
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
    self.asked = False  # Set by `request`: a report is wanted.
    self.directory = self._root
    self._since = time.time()
    self._seen: set[str] = set()
    self._looked = 0.0
    self._turned = 0.0  # When the round's loop last watched.
    self._asks = self._requests = 0
    self._lock = threading.Lock()  # Node 0: answers come on other threads.
    # Node 0: the report to print (its first ask, why, nodes, deadline),
    # and each node's answer since the last report, when it came.
    self._pending: tuple[str, str, list[int], float] | None = None
    self._answers: dict[int, tuple[float, dict]] = {}

  def env(self, attempt: int) -> dict[str, str]:
    """The tasks' variables for round ``attempt``."""
    self.settle()
    self.directory = os.path.join(self._root, str(attempt))
    self._since = time.time()
    env = {_flight.DIR_VARIABLE: self.directory}
    if self._stall:
      env[_flight.STALL_VARIABLE] = f"{self._stall:g}"
    return env

  def request(self) -> None:
    """SIGUSR2 (from the signal handler): a report, or where no round runs
    here, one line saying so."""
    if time.monotonic() - self._turned < 2 * _LOOK_S:
      self.asked = True
    else:  # Not in the handler: the console's lock may be held.
      threading.Thread(target=self._say, daemon=True, args=(
          "no stall report: no round runs on this node",)).start()

  def watch(self, pids: Mapping[str, int],
            notes: Mapping[str, Sequence[str]],
            message: dict | None = None) -> None:
    """Each turn of the round's loop: answers an ``ask`` (the rendezvous's
    ``message``), asks when a report is wanted, and prints a report that is
    in. ``pids``: each task (``worker:1``) to its process id; ``notes``:
    each task's last lines of output."""
    self._turned = time.monotonic()
    if isinstance(message, dict) and message.get("kind") == "ask":
      if self._rank == 0:
        self._pend(message)
      if not message["id"].startswith(f"{self._rank}."):  # Not answered.
        self._answer(message["id"], pids, notes)
    why = None
    if self.asked:
      self.asked, why = False, "SIGUSR2 to the launcher"
    elif self._stall and time.monotonic() - self._looked > _LOOK_S:
      self._looked = time.monotonic()
      why = stalled(self.directory, self._seen)
    if why:
      self._ask_all(why, pids, notes)
    self._print()

  def lost_peer(self, role: str) -> dict | None:
    """The dump task ``role`` wrote this round as a collective failed (a
    timeout, a lost peer, calls out of order), if it did."""
    dump = _dumps(self.directory).get(role) or {}
    return dump if dump.get("time", 0) >= self._since and not str(
        dump["reason"]).startswith((_STALL, _flight.ASKED)) else None

  def failed(self, role: str, code: int, dump: dict, pids: Mapping[str, int],
             notes: Mapping[str, Sequence[str]]) -> None:
    """Task ``role`` failed as a collective failed (``dump``, from
    `lost_peer`): the report, asked before this node's tasks stop."""
    self._ask_all(f"{role} exited {code}: {dump['reason']}", pids, notes)
    self._print()  # One node: said before its tasks stop.

  def merge(self, rank: int, message: dict) -> None:
    """Node 0: node ``rank``'s answer to an ``ask``."""
    with self._lock:
      self._answers[rank] = (time.monotonic(), message)

  def settle(self) -> None:
    """Node 0: prints the report asked for, within `ANSWER_S`."""
    while not self._print():
      time.sleep(_POLL_S)

  def close(self) -> None:
    """Prints the reports asked for; removes a temporary directory no
    report named."""
    self.settle()
    if self._temporary and not self._reported:
      shutil.rmtree(self._root, ignore_errors=True)

  def _ask_all(self, why: str, pids: Mapping[str, int],
               notes: Mapping[str, Sequence[str]]) -> None:
    """This node answers at once (its tasks may be stopped next), then
    asks every node."""
    self._asks += 1
    number = f"{self._rank}.{self._asks}"
    self._answer(number, pids, notes)
    self._send({"kind": "ask", "id": number, "why": self._node + why})
    if self._rank:
      self._say(f"stall report asked of every node ({why}): node 0 says it")

  def _answer(self, number: str, pids: Mapping[str, int],
              notes: Mapping[str, Sequence[str]]) -> None:
    self._turned = time.monotonic() + WAIT_S  # Busy, yet in a round.
    asked_at, self._requests = time.time(), self._requests + 1
    with contextlib.suppress(OSError):  # Dumps written since answer too.
      ask(self.directory, self._requests)
    found = collect(self.directory, pids, request=self._requests,
                    since=self._since, asked_at=asked_at, notes=notes)
    self._reported = True
    # One report a stall: the tasks' stall dumps of this one are said.
    self._seen.update(_key(t, d) for t, d in found.items()
                      if isinstance(d, dict))
    self._send({"kind": "report", "id": number, "directory": self.directory,
                "found": {t: brief(d, time.time()) if isinstance(d, dict)
                          else d for t, d in found.items()}})

  def _pend(self, ask: dict) -> None:
    """Node 0: a report to print once its nodes answered; asks meanwhile
    join it (several nodes saw the same stall)."""
    with self._lock:
      first, why, nodes, deadline = self._pending or (
          ask["id"], "", [], time.monotonic() + ANSWER_S)
      self._pending = (first, "; ".join(filter(None, (why, ask["why"]))),
                       sorted({*nodes, *ask["nodes"]}), deadline)

  def _print(self) -> bool:
    """Says the report if its answers are in; whether none waits."""
    with self._lock:
      if self._pending is None:
        return True
      first, why, nodes, deadline = self._pending
      # Any answer to an ask of this stall: a node's round may end before
      # it hears every ask.
      got = {r: a for r, (at, a) in self._answers.items()
             if at > deadline - 2 * ANSWER_S}
      if time.monotonic() < deadline and not set(nodes) <= set(got):
        return False
      self._pending = None
      self._answers.clear()
    lines, record = report({r: got.get(r, (
        f"no answer within {ANSWER_S:g} s: its launcher is stopped, busy or "
        "cut off")) for r in nodes}, why=why)
    path = os.path.join(self.directory, f"report-{first}.json")
    try:
      os.makedirs(self.directory, mode=0o700, exist_ok=True)
      with open(path, "w") as f:
        json.dump({**record, "lines": lines}, f)
      lines[-1] += f"; this report: {path}"
    except OSError:
      pass  # The report is said all the same.
    self._reported = True
    self._say("\n".join(lines))
    return True


def ask(directory: str, number: int) -> None:
  """Asks every task writing to ``directory`` for a dump answering request
  ``number`` (larger than the last)."""
  os.makedirs(directory, mode=0o700, exist_ok=True)
  path = os.path.join(directory, _flight.REQUEST_FILE)
  with open(path + ".tmp", "w") as f:
    f.write(str(number))
  os.replace(path + ".tmp", path)


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
            since: float, asked_at: float,
            notes: Mapping[str, Sequence[str]] | None = None,
            wait_s: float = WAIT_S) -> dict[str, dict | str]:
  """Each task (``pids``: role -> pid) to its dump answering ``request``
  (from `ask`, at ``asked_at``), or why it has none (stopped, ended, its
  line in ``notes`` saying it could not write), within ``wait_s``. A task
  that ended answers with its last dump since ``since``."""
  deadline = time.monotonic() + wait_s
  while True:
    dumps = _dumps(directory)
    found: dict[str, dict | str] = {}
    for task, pid in pids.items():
      dump, state = dumps.get(task) or {}, _state(pid)
      written = dump.get("time", 0)
      if dump and (dump.get("request", 0) >= request or written >= asked_at
                   or state == "ended" and written >= since):
        found[task] = dump
      else:
        unwritten = [line.strip() for line in list(  # Read as they come.
            (notes or {}).get(task, ())) if _UNWRITTEN in line]
        found[task] = unwritten[-1] if unwritten else state
    waiting = [t for t, f in found.items() if f == "running"]
    if not waiting or time.monotonic() >= deadline:
      return {t: (f"no dump within {wait_s:g} s" if f == "running" else f)
              for t, f in found.items()}
    time.sleep(_POLL_S)


def brief(dump: dict, now: float) -> dict:
  """What node 0 reads of a dump: the task's place (``step``, ``done`` in
  it), its last `BRIEF_RECORDS` collectives and the one it waits in, aged by
  this node's clock (``for_s`` while open, else ``ago_s``), not timed."""
  records = dump.get("records") or []
  step = int(dump.get("step") or 0)
  last = _last(records)
  kept = records[-BRIEF_RECORDS:]
  if last is not None and last not in kept:
    kept = [last, *kept]
  aged = [{k: v for k, v in r.items() if k not in ("entered", "left")}
          | ({"for_s": round(now - r["entered"], 1)} if r.get("left") is None
             else {"ago_s": round(now - r["left"], 1)}) for r in kept]
  return {"step": step, "done": sum(r["step"] == step for r in records),
          "where": dump.get("where"), "reason": dump.get("reason"),
          "stacks": dump.get("stacks"), "records": aged,
          "last": aged[kept.index(last)] if last is not None else None}


def report(answers: Mapping[int, dict | str], *,
           why: str) -> tuple[list[str], dict]:
  """One report of every node's answer (a ``report`` message, or why there
  is none): its lines, at most 3 a task and 3 more, and its JSON record."""
  found: dict[str, dict | str] = {}
  node_of, dirs, silent = {}, [], []
  for rank, answer in sorted(answers.items()):
    if isinstance(answer, str):
      silent.append(rank)
      continue
    dirs.append(f"node {rank} {answer['directory']}" if len(answers) > 1
                else answer["directory"])
    for task, found_task in answer["found"].items():
      found[task], node_of[task] = found_task, rank
  briefs = {t: b for t, b in found.items() if isinstance(b, dict)}
  lead = max(((b["step"], b["done"]) for b in briefs.values()),
             default=(0, 0))
  behind, lines = [], []
  for task in sorted(found, key=_order):
    entry = found[task]
    name = f"{task} on node {node_of[task]}" if len(answers) > 1 else task
    if not isinstance(entry, dict):
      behind.append(f"{task} ({entry})")
      lines.append(f"  {name}: no flight record: {entry}")
      continue
    step, done = entry["step"], entry["done"]
    state = ""
    if step < lead[0]:
      gap = f"{lead[0] - step} step{'s' * (lead[0] - step > 1)}"
      state = f", BEHIND by {gap}"
      behind.append(f"{task} (by {gap}, at step {step})")
    elif done < lead[1]:
      state = f", BEHIND in step {step} by {lead[1] - done} collective(s)"
      behind.append(f"{task} (in step {step})")
    lines.append(f"  {name}: step {step}{state}; "
                 f"{_describe(entry['last'])}")
    lines.append(f"      at {entry.get('where') or 'no frame of user code'}")
  lines += [f"  node {rank}: {answers[rank]}" for rank in silent]
  mismatch = _mismatch(briefs)
  said = [mismatch] if mismatch else []
  said.append(f"behind: {', '.join(behind)}" if behind
              else "no task is behind")
  if silent:
    said.append(f"no answer from node {', '.join(map(str, silent))}")
  head = f"stall report ({why}): {'; '.join(said)}"
  tail = (f"  dumps (record .json, stacks .stacks.txt): {', '.join(dirs)}"
          if any(b.get("stacks") for b in briefs.values())
          else f"  no dump was written in {', '.join(dirs) or 'any node'}")
  return [head, *lines, tail], {
      "why": why, "mismatch": mismatch, "behind": behind,
      "answers": {str(r): a for r, a in answers.items()}}


def _mismatch(briefs: Mapping[str, dict]) -> str | None:
  """Tasks that wait (or failed) in different collectives at the same
  point (their count of collectives): another kind, size or bucket count."""
  at: dict = collections.defaultdict(lambda: collections.defaultdict(list))
  for task in sorted(briefs, key=_order):
    last = briefs[task].get("last") or {}
    if last.get("seq") and ("for_s" in last or last.get("failed")):
      at[last["seq"]][_what(last, peers=False)].append(task)
  for seq, sides in sorted(at.items()):
    if len(sides) > 1:
      return (f"MISMATCHED collectives (collective #{seq} of each task): "
              + "; ".join(f"{', '.join(tasks)} in {what}"
                          for what, tasks in sides.items()))
  return None


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


def _last(records: Sequence[dict]) -> dict | None:
  """The collective a task waits in (the innermost still open), else the
  last it entered."""
  waiting = [r for r in records if r.get("left") is None]
  return max(waiting or records, key=lambda r: r["entered"], default=None)


def _what(record: dict, *, peers: bool = True) -> str:
  what = f"{record['kind']} ({record['transport']}"
  if record.get("bytes"):
    what += f", {_size(record['bytes'])}"
  return what + (f", {record['peers']})" if peers else ")")


def _describe(record: dict | None) -> str:
  if record is None:
    return "no collective yet"
  if "for_s" in record:
    return f"in {_what(record)} for {record['for_s']:.1f} s"
  ended = "failed" if record.get("failed") else "left"
  return f"{ended} {_what(record)} {record['ago_s']:.1f} s ago"


def _size(nbytes: int) -> str:
  for unit in ("B", "KiB", "MiB"):
    if nbytes < 1024:
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  return f"{nbytes:.1f} GiB"


def _order(task: str) -> tuple[str, int]:
  kind, _, index = task.partition(":")
  return (kind, int(index)) if index.isdigit() else (task, 0)
