"""A flight recorder of this process's collectives, dumped when a run stalls.

TensorFlow says only "Collective has timed out" when a run stalls, and no
one can tell which worker is behind or where it stands. Every process keeps
its last `CAPACITY` collectives in memory, as PyTorch's flight recorder does
for its collectives: for each, the step, the kind, the bytes, the transport,
the peers, and when it was entered and left. tfdist records what it sees:

| kind               | recorded by                                        |
|--------------------|----------------------------------------------------|
| ``gradients``      | each training step of Keras ``fit`` and `Runner` (TensorFlow's collectives run inside it: the gradients, the metrics, the loss-scale agreement) |
| ``bucket K/N``     | the socket transport: each gradient bucket on the ring |
| ``all-reduce``     | a socket ring's other calls (`tfdist.ring.SocketRing`) |
| ``barrier``        | tfdist's own agreements: the restored position, the transport, the clean exit |

Where ``tfdist launch`` asks for it (``TFDIST_FLIGHT_DIR``), a thread of the
process writes the record and every thread's Python stack (faulthandler)
there as ``<type>-<index>.json`` and ``.stacks.txt``: when the launcher asks
(`REQUEST_FILE`), when no step began for ``TFDIST_STALL_SECONDS``, and when
a collective failed (`failed`). The thread keeps answering while the main
thread waits in TensorFlow, which releases the interpreter. The launcher
reads the dumps and prints one report (`tfdist.launch.stall`).
A record costs two clock reads and a list (``tfdist bench`` measures Keras
``fit`` with and without the recorder: ``flight_recorder_ratio``); with no
launcher asking, no thread runs and nothing is written.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import linecache
import os
import re
import site
import sys
import sysconfig
import threading
import time
from typing import Any, Iterator

__all__ = ["CAPACITY", "COLLECTIVE_FAILURES", "DIR_VARIABLE", "STALL_VARIABLE",
           "REQUEST_FILE", "ASKED", "set_recording", "recording",
           "begin_step", "progress", "enter", "leave", "recorded", "failed",
           "summary", "watch", "dump", "snapshot"]

#: Collectives kept per process, oldest dropped first.
CAPACITY = 1000
#: Where the launcher wants the dumps; unset: nothing is written.
DIR_VARIABLE = "TFDIST_FLIGHT_DIR"
#: No step for this many seconds (after the first) dumps; unset or 0: never.
STALL_VARIABLE = "TFDIST_STALL_SECONDS"
#: The launcher writes a growing number here to ask every task for a dump;
#: the dump's reason.
REQUEST_FILE, ASKED = "request", "the launcher asked"
_POLL_S = 0.25
#: Errors of a collective that failed on a peer, by class name (TensorFlow's
#: and tfdist's), which dump before they are raised on; the dump's reason
#: begins with the name.
COLLECTIVE_FAILURES = frozenset({
    "DeadlineExceededError", "UnavailableError", "AbortedError",
    "WorkerLostError", "StartupTimeoutError"})

# A record: [step, kind, bytes, transport, peers, entered, left, failed,
# seq]; times from time.time(); seq: this process's count of collectives.
_STEP, _KIND, _BYTES, _TRANSPORT, _PEERS, _ENTERED, _LEFT, _FAILED = range(8)
_GENERIC_LINE = re.compile(
    r"^(graph execution error:|\d+ root error\(s\) found\."
    r"|detected at node .* defined at \(most recent call last\):"
    r"|file \".*\", line \d+.*)$", re.IGNORECASE)
_FIELDS = ("step", "kind", "bytes", "transport", "peers", "entered", "left",
           "failed", "seq")


class _State:
  """This process's record: the collectives, the step, and the dumps."""

  def __init__(self):
    self.records: collections.deque[list] = collections.deque(
        maxlen=CAPACITY)
    self.step = 0  # The step in progress, or the last one begun.
    self.progress_at = time.time()  # When a step began or a batch ended.
    self.stepped = False
    self.entered = 0  # Collectives entered.
    self.failed: BaseException | None = None  # The last said (`failed`).
    self.watching = False
    self.recording = True  # Keras steps are recorded (`set_recording`).
    self.lock = threading.Lock()  # Dumps: one at a time.


_state = _State()


def set_recording(on: bool) -> None:
  """Whether Keras ``fit`` records its steps (the bench compares both)."""
  _state.recording = on


def recording() -> bool:
  """Whether Keras ``fit`` records its steps."""
  return _state.recording


def begin_step(step: int) -> None:
  """Step ``step`` (1 for the first of a run) begins."""
  _state.step = step
  _state.stepped = True
  _state.progress_at = time.time()


def progress() -> None:
  """Work that is no training step went on (an evaluation batch, say)."""
  _state.progress_at = time.time()


def enter(kind: str, *, transport: str, peers: str,
          nbytes: int | None = None) -> list:
  """Notes that a collective began; `leave` it with what this returns."""
  _state.entered += 1
  record = [_state.step, kind, nbytes, transport, peers, time.time(), None,
            False, _state.entered]
  _state.records.append(record)
  return record


def leave(record: list, *, failed: bool = False) -> None:
  """Notes that the collective of ``record`` ended."""
  record[_LEFT] = time.time()
  record[_FAILED] = failed


@contextlib.contextmanager
def recorded(kind: str, *, transport: str, peers: str,
             nbytes: int | None = None) -> Iterator[None]:
  """Records the collective run inside the block."""
  record = enter(kind, transport=transport, peers=peers, nbytes=nbytes)
  try:
    yield
  except BaseException as e:
    leave(record, failed=True)
    if isinstance(e, Exception):
      failed(e, collective=True)
    raise
  leave(record)


def failed(error: BaseException, *, collective: bool = False) -> None:
  """Where a collective failed (``collective``, or ``error`` is a timeout
  or a lost peer), dumps for ``tfdist launch``, else (``srun python
  train.py``) prints one line: this task, its step, its collective and its
  innermost frame of user code. Call it before raising ``error`` on."""
  if _state.failed is error or not (
      collective or type(error).__name__ in COLLECTIVE_FAILURES):
    return
  _state.failed = error
  reason = f"{type(error).__name__}: {summary(error, 200)}"
  if os.environ.get(DIR_VARIABLE):
    dump(reason)
    return
  records = list(_state.records)
  last = max([r for r in records if r[_LEFT] is None] or records,
             key=lambda r: r[_ENTERED], default=None)
  where = _where(threading.main_thread()) or "no frame of user code"
  print(f"tfdist: {_role()} at step {_state.step}, "
        + (f"in {last[_KIND]} ({last[_TRANSPORT]}, {last[_PEERS]})"
           if last else "in no collective")
        + f", at {where.partition(': ')[0]}: {reason}",
        file=sys.stderr, flush=True)


def summary(error: BaseException, limit: int = 300) -> str:
  """The first informative line of an error's message (TensorFlow's often
  begin with a generic one), cut at a word and ended with ``...`` beyond
  ``limit`` characters."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  line = next((x for x in lines if not _GENERIC_LINE.match(x)),
              lines[0] if lines else "no message")
  return line if len(line) <= limit else (
      line[:limit - 3].rsplit(" ", 1)[0] + "...")


def _role() -> str:
  """This task as ``type:index`` from its TF_CONFIG, else ``pid-N``."""
  try:
    task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task") or {}
  except ValueError:
    task = {}
  if task.get("type") is not None:
    return f"{task['type']}:{task.get('index', 0)}"
  if os.environ.get("SLURM_PROCID"):
    return f"task:{os.environ['SLURM_PROCID']}"
  return f"pid-{os.getpid()}"


def snapshot(reason: str, *, request: int = 0) -> dict[str, Any]:
  """This process's record as the dump holds it."""
  records = list(_state.records)
  return {"role": _role(), "pid": os.getpid(), "reason": reason,
          "request": request, "time": time.time(), "step": _state.step,
          "progress_at": _state.progress_at,
          "where": _where(threading.main_thread()),
          "records": [dict(zip(_FIELDS, r)) for r in records]}


def dump(reason: str, *, request: int = 0) -> str | None:
  """Writes the record and every thread's stack under ``TFDIST_FLIGHT_DIR``.

  Returns:
    The record's path; ``None`` when no directory was asked for or writing
    failed (then one line on stderr says what could not be written, and
    this task's step and place, so the stall still shows).
  """
  directory = os.environ.get(DIR_VARIABLE)
  if not directory:
    return None
  with _state.lock:
    found = snapshot(reason, request=request)
    # worker:1 -> worker-1, as the launcher names each task's log.
    stem = os.path.join(directory, found["role"].replace(":", "-"))
    found["stacks"] = stem + ".stacks.txt"
    try:
      os.makedirs(directory, mode=0o700, exist_ok=True)
      with open(found["stacks"], "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)
      with open(stem + ".json.tmp", "w") as f:
        json.dump(found, f)
      os.replace(stem + ".json.tmp", stem + ".json")
    except OSError as e:
      print(f"tfdist: {found['role']} could not write its flight record "
            f"({e}); it is at step {found['step']}, "
            f"{found['where'] or 'no user frame'}",
            file=sys.stderr, flush=True)
      return None
    return stem + ".json"


def watch() -> None:
  """Starts this process's dump thread, once, where the launcher asked for
  dumps; elsewhere does nothing."""
  directory = os.environ.get(DIR_VARIABLE)
  with _state.lock:
    if not directory or _state.watching:
      return
    _state.watching = True
  try:
    stall = max(0.0, float(os.environ.get(STALL_VARIABLE) or 0))
  except ValueError:
    stall = 0.0
  threading.Thread(target=_watch, args=(directory, stall), daemon=True,
                   name="tfdist-flight").start()


def _watch(directory: str, stall: float) -> None:
  answered = _request(directory)  # Requests before this process started.
  stalled_at = None
  while True:
    time.sleep(_POLL_S)
    asked = _request(directory)
    if asked > answered:
      answered = asked
      dump(ASKED, request=asked)
    quiet = time.time() - _state.progress_at
    if stall and _state.stepped and quiet > stall:
      if stalled_at != _state.progress_at:
        stalled_at = _state.progress_at
        dump(f"no step for {stall:g} s")


def _request(directory: str) -> int:
  try:
    with open(os.path.join(directory, REQUEST_FILE)) as f:
      return int(f.read().strip() or 0)
  except (OSError, ValueError):
    return 0


def _library_dirs() -> tuple[str, ...]:
  """Where code that is not the user's lives: tfdist, the standard library
  and installed packages."""
  paths = {os.path.dirname(os.path.abspath(__file__))}
  paths.update(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib",
                                                   "purelib", "platlib"))
  try:
    paths.update(site.getsitepackages())
  except AttributeError:  # Some virtualenvs' site module.
    pass
  return tuple(os.path.realpath(p) + os.sep for p in paths if p)


_LIBRARY = _library_dirs()


def _where(thread: threading.Thread) -> str | None:
  """The innermost frame of the user's code in ``thread``'s stack:
  ``file:line in function: code``."""
  frame = sys._current_frames().get(thread.ident)  # pylint: disable=protected-access
  while frame is not None:
    path = frame.f_code.co_filename
    if (not path.startswith("<")
        and not os.path.realpath(path).startswith(_LIBRARY)):
      code = linecache.getline(path, frame.f_lineno).strip()
      return (f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
              + (f": {code}" if code else ""))
    frame = frame.f_back
  return None
