"""The launcher's console: each task's lines with its role, and its own.

Every line of a task carries one ``[type:index]`` prefix. Keras's progress
bar (backspaces, then a carriage return, then the new state) is drawn in
place on a terminal; elsewhere (a pipe, a log file) only a redrawn line's
last state is written, once, so no control character reaches a log.
TensorFlow's start-up lines that ``TF_CPP_MIN_LOG_LEVEL`` does not silence
are dropped from the console and from failure tails alike, unless the user
set that level; each task's log file keeps everything. TensorFlow-free.
"""

from __future__ import annotations

import collections
import re
import threading
from typing import BinaryIO, Sequence, TextIO

from tfdist.errors import INTERRUPTED_EXIT_CODE
from tfdist.errors import PREEMPTED_EXIT_CODE

__all__ = ["Console", "TAIL_LINES", "preempted_line", "signalled_line"]

#: The lines of a failed task's output that the launcher repeats.
TAIL_LINES = 20
#: TensorFlow's start-up lines that TF_CPP_MIN_LOG_LEVEL does not silence
#: (written before its logging starts): no GPU driver on a CPU machine, and
#: oneDNN's notice (TF_ENABLE_ONEDNN_OPTS=0 would silence it by changing the
#: numerics, so the line is dropped instead).
_NOISE = re.compile(
    r"All log messages before absl::InitializeLog\(\) is called are written "
    r"to STDERR|cudart_stub\.cc:\d+\] Could not find cuda drivers"
    r"|cuda_platform\.cc:\d+\] failed call to cuInit"
    r"|port\.cc:\d+\] oneDNN custom operations are on")
#: How to resume after a preemption, said by `tfdist launch`.
RESUME = "run the same command to resume"
#: What a task that stopped on a preemption signal printed last
#: (`tfdist.training.preemption`, `tfdist.strategy.startup`): the step and,
#: when the line names it, the directory.
_SAVED = re.compile(r"checkpoint saved at step (\d+)(?: in (.+?))?(?:;|$)")
_NOTHING_SAVED = re.compile(r"nothing (?:saved|to save)")
#: How a task's own one-line error starts (e.g. `tfdist.DiskFullError`).
_ONE_LINE = "tfdist: "
#: A terminal control sequence (colour, erase): kept for terminals only.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


class Console:
  """Where the tasks' output and the launcher's own lines meet.

  Args:
    out: the stream everything is written to.
    quiet: drop TensorFlow's start-up noise (`_NOISE`).
    resume: how to resume, said after a task was preempted and saved.
  """

  def __init__(self, out: TextIO, *, quiet: bool = True, resume: str = RESUME):
    self._out = out
    self.quiet = quiet
    self._resume = resume
    self._lock = threading.Lock()
    self._tty = hasattr(out, "isatty") and out.isatty()
    self._partial: dict[str, str] = {}  # Role -> its redrawn line's state.
    self._drawing: str | None = None  # The role whose bar the cursor is on.

  def reader(self, role: str, stream: BinaryIO, log: TextIO | None
             ) -> tuple[threading.Thread, collections.deque]:
    """A thread (not started) copying ``stream`` here and to ``log``, which
    it closes at the end, and the deque of the last `TAIL_LINES` lines."""
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    thread = threading.Thread(target=self._pump, args=(role, stream, tail, log),
                              daemon=True, name=f"tfdist-output-{role}")
    return thread, tail

  def say(self, text: str) -> None:
    """The launcher's own line(s), each after ``tfdist: ``."""
    with self._lock:
      self._end_bar()
      self._out.write(f"tfdist: {text}\n")
      self._out.flush()

  def failure(self, role: str, code: int, tail: Sequence[str], *,
              restarting: bool = False) -> None:
    """Says that task ``role`` ended with return code ``code``, and its
    last lines; in one line a preempted task (`PREEMPTED_EXIT_CODE`), with
    how to resume unless the launcher is ``restarting``, and a task whose
    last line was its own ``tfdist: `` line (e.g. `tfdist.DiskFullError`)."""
    if code == PREEMPTED_EXIT_CODE:
      self.say(preempted_line(role, tail,
                              resume=None if restarting else self._resume))
      return
    how = (f"was killed by signal {-code}" if code < 0
           else f"exited with code {code}")
    if tail and tail[-1].startswith(_ONE_LINE):  # Its own one-line error.
      self.say(f"task {role} {how}: {tail[-1][len(_ONE_LINE):]}")
      return
    lines = [f"task {role} {how}; last lines of its output:"]
    lines += [f"  | {line}" for line in tail] or ["  | (no output)"]
    self.say("\n".join(lines))

  def signalled(self, signal_name: str,
                tasks: Sequence[tuple[str, int | None, Sequence[str]]]
                ) -> None:
    """Says how the training ``tasks`` ended after the launcher got
    ``signal_name`` (`signalled_line`)."""
    self.say(signalled_line(signal_name, tasks, resume=self._resume))

  def _pump(self, role, stream, tail, log) -> None:
    """Copies a task's output; a carriage return ends a redrawn line."""
    pending = b""
    try:
      for chunk in iter(lambda: stream.read1(65536), b""):
        pending += chunk
        while True:
          cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r"))
                     if i >= 0), default=-1)
          if cut < 0:
            break
          piece, end = pending[:cut], pending[cut:cut + 1]
          pending = pending[cut + 1:]
          self._emit(role, piece.decode(errors="replace"), end == b"\n",
                     tail, log)
      if pending:
        self._emit(role, pending.decode(errors="replace"), True, tail, log)
    finally:
      if log:
        log.close()

  def _emit(self, role, text, newline, tail, log) -> None:
    """One line (``newline``) or one state of a redrawn line of ``role``."""
    text = text.replace("\b", "")  # Keras erases with \b, then returns.
    with self._lock:
      drawn = self._partial.get(role)
      if not newline:
        if text:
          self._partial[role] = text
          if self._tty:
            if self._drawing not in (None, role):
              self._out.write("\n")  # End the other task's bar.
            self._out.write(f"\r[{role}] {text}\x1b[K")
            self._drawing = role
            self._out.flush()
        return
      self._partial.pop(role, None)
      if not text and drawn is not None:
        text = drawn  # The bar's last state is its final line.
      plain = _ANSI.sub("", text)  # Keras colours its bar.
      if log:
        log.write(plain + "\n")
        log.flush()
      if self.quiet and _NOISE.search(plain):
        return  # Kept in the task's log file only.
      tail.append(plain)
      if self._tty and self._drawing is not None:
        self._out.write("\r" if self._drawing == role else "\n")
      self._drawing = None
      self._out.write(f"[{role}] {text if self._tty else plain}"
                      + ("\x1b[K\n" if self._tty else "\n"))
      self._out.flush()

  def _end_bar(self) -> None:
    if self._tty and self._drawing is not None:
      self._out.write("\n")
      self._drawing = None


def _saved(tail: Sequence[str]) -> str | None:
  """``at step N`` (``in DIR`` when said) from a task's last lines, ``""``
  when they say it saved nothing, else ``None``."""
  text = "\n".join(tail)
  saved = _SAVED.findall(text)
  if saved:
    step, where = saved[-1]
    return f"at step {step}" + (f" in {where}" if where else "")
  return "" if _NOTHING_SAVED.search(text) else None


def preempted_line(role: str, tail: Sequence[str], *,
                   resume: str | None) -> str:
  """One line for a task that exited `PREEMPTED_EXIT_CODE`, with the step
  it saved at when its last lines (``tail``) say.

  Example:
    >>> preempted_line("worker:0", ["... checkpoint saved at step 6; ..."],
    ...                resume="run the same command to resume")
    'worker:0 was preempted and saved at step 6; run the same command to resume'
  """
  saved = _saved(tail)
  if saved:
    line = f"{role} was preempted and saved {saved}"
  elif saved == "":
    line = f"{role} was preempted before it could save"
  else:
    line = f"{role} was preempted and saved"
  return line + (f"; {resume}" if resume else "")


def signalled_line(signal_name: str,
                   tasks: Sequence[tuple[str, int | None, Sequence[str]]], *,
                   resume: str) -> str:
  """One line for a launcher that got ``signal_name``, once its training
  tasks ended: where they saved, naming each that did not.

  Args:
    signal_name: e.g. ``"SIGTERM"``.
    tasks: each training task's role, return code (``None``: still
      running) and last lines.
    resume: how to resume, said when a task stopped as tfdist's do.

  Example:
    >>> signalled_line("SIGTERM", [
    ...     ("worker:0", 42, ["checkpoint saved at step 16; exiting"]),
    ...     ("worker:1", 42, ["checkpoint saved at step 16; exiting"])],
    ...     resume="run the same command to resume")
    'preempted (SIGTERM): every worker saved at step 16; run the same command to resume'
  """
  stopped = (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE)
  groups: dict[tuple[bool, str], list[str]] = {}
  for role, code, tail in tasks:
    saved = _saved(tail) if code in stopped else None
    if saved:
      outcome = (True, f"saved {saved}")
    elif code in stopped:
      outcome = ((True, "saved") if saved is None
                 else (False, "nothing to save yet"))
    elif code is None:
      outcome = (False, "still running")
    else:
      outcome = (False, f"killed by signal {-code}" if code < 0
                 else f"exit code {code}")
    groups.setdefault(outcome, []).append(role)
  parts = []
  for (saved, what), roles in groups.items():
    every = len(groups) == 1 and len(roles) > 1
    if saved:
      parts.append(f"{'every worker' if every else ', '.join(roles)} {what}")
    elif every:
      parts.append(f"no worker saved ({what})")
    else:
      parts.append(f"{', '.join(roles)} did not save ({what})")
  if any(code in stopped for _, code, _ in tasks):
    parts.append(resume)
  how = "interrupted" if signal_name == "SIGINT" else "preempted"
  return f"{how} ({signal_name}): " + "; ".join(parts)
