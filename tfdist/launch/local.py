"""The launcher's one supervision loop (``tfdist launch``), any number of
nodes.

TensorFlow has no ``torchrun``. `launch` starts one process per task of this
node, each with its own TF_CONFIG, and never leaves a process behind. Its
members come from the first source of `tfdist.launch.members` that serves
(SLURM's step, one node, a TCP rendezvous), its processes are a
`tfdist.launch.workers.Workers`, and the same loop runs each round:

1. join, and get this node's TF_CONFIGs;
2. start the tasks, prefixing each line of output with the task's role
   (`tfdist.launch.output`);
3. watch them and the rendezvous: a task that fails is reported (its exit
   code and the tail of its output; a preempted one, exit 42, as the step it
   saved at) and stops the round; ``finish`` (every
   training task done) gives the evaluator ``grace_seconds``, then stops the
   servers; ``stop`` ends the round, and the job unless it names the next
   round, which every node joins at once after a change of members, and
   after ``restart_delay_seconds`` after a failure (doubling with each,
   at most `MAX_RESTART_DELAY_SECONDS`). Each task sees the job as torchrun's
   see theirs (`job_variables`).

SIGINT, SIGTERM and SIGUSR1 are forwarded to every task, SIGHUP as SIGTERM,
and a second signal kills the tasks at once (call `launch` from the main
thread: `Workers` explains). A launcher that got signal N leaves the job and
exits ``128 + N`` (after SIGUSR1, SLURM's cue, 42 or 0 once every task
saved or finished), once its tasks ended saying in one line where they saved and which
did not (`tfdist.launch.output.signalled_line`); a waiting one leaves at
once.

Every run gives its tasks one secret in ``TFDIST_JOB_SECRET``
(`tfdist._net.JOB_SECRET_VARIABLE`), fresh unless given: the socket
all-reduce ring admits only tasks that know it. TensorFlow's gRPC server
listens on every interface (``0.0.0.0``/``[::]``), whatever address TF_CONFIG
names: ``host`` only sets the addresses the tasks dial, and isolates nothing.

Example:
  >>> spec = LaunchSpec(num_workers=2, command=("python", "train.py"))
  >>> launch(spec)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from typing import TextIO

from tfdist import _net
from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.launch import members as members_lib
from tfdist.launch import output
from tfdist.launch import rendezvous
from tfdist.launch import rounds
from tfdist.launch import stall
from tfdist.launch.spec import LaunchSpec
from tfdist.launch.spec import Prepared
from tfdist.launch.spec import make_dirs
from tfdist.launch.workers import Workers

__all__ = ["Launcher", "launch", "job_variables"]

_SOURCE = "LaunchSpec"
#: The launcher's signal -> what its tasks get: SIGUSR1 (SLURM's
#: ``--signal=USR1@N``) as it is, tfdist's tasks save on it as on SIGTERM;
#: SIGHUP (the terminal went away) asks them to save and stop, as SIGTERM.
_FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
              signal.SIGUSR1: signal.SIGUSR1, signal.SIGHUP: signal.SIGTERM}


@dataclasses.dataclass(frozen=True)
class _Outcome:
  """How one node's round ended: its exit code, or the round to join and
  how long to wait first."""
  code: int
  restart: int | None = None
  delay: float = 0.0


class Launcher:
  """Runs a `LaunchSpec`; `run` returns the exit code.

  Raises:
    ConfigError: from `run`, when `preflight` fails, node 0 cannot listen
      for the rendezvous, or the log directory or a task cannot be created;
      no task is left running.
  """

  def __init__(self, spec: LaunchSpec, *, out: TextIO | None = None,
               resume: str = output.RESUME):
    self._spec = spec
    self._console = output.Console(out or sys.stdout, resume=resume,
                                   quiet="TF_CPP_MIN_LOG_LEVEL" not in {
                                       **os.environ, **spec.env})
    self._workers = Workers(spec=spec, console=self._console, source=_SOURCE)
    self._signal: int | None = None
    self._stopping = threading.Event()  # Set with _signal: waits end.
    self._flight: stall.Flight | None = None

  def run(self) -> int:
    handlers = {s: signal.signal(s, self._on_signal) for s in _FORWARDED}
    handlers[stall.SIGNAL] = signal.signal(stall.SIGNAL, self._on_report)
    opened = None
    try:
      opened = members_lib.open_members(
          self._spec, console=self._console, stopping=self._stopping,
          merge_report=self._merge_report)
      spec = self._spec = opened.spec
      member = opened.members
      make_dirs(spec.log_dir)
      self._flight = stall.Flight(
          log_dir=spec.log_dir, stall_seconds=spec.stall_seconds,
          say=self._console.say, source=_SOURCE, rank=spec.node_rank,
          send=member.send if spec.nnodes > 1 else None)
      outcome = _Outcome(0, restart=0)
      while True:
        placed = member.join(attempt=outcome.restart, host=opened.host,
                             jobs=spec.jobs, evaluator=spec.evaluator,
                             ports=spec.ports(opened.host))
        if placed.why is not None:  # A restart.
          self._console.say(self._restart_line(placed, outcome.delay))
        if self._signal is not None:
          return 128 + self._signal
        outcome = self._run_round(placed, member, opened.prepared)
        if outcome.restart is None:
          return outcome.code
        if not self._sleep(outcome.delay):
          return 128 + self._signal
    except rendezvous.RendezvousError as e:
      self._console.say(f"node {self._spec.node_rank}: {e}")
      return e.code if self._signal is None else 128 + self._signal
    finally:
      self._workers.stop()
      if self._flight is not None:
        self._flight.close()
      if opened is not None:
        opened.close()
      for s, h in handlers.items():
        signal.signal(s, h)

  def _run_round(self, placed: rounds.Cluster, member,
                 prepared: Prepared) -> _Outcome:
    """Runs this node's part of the round ``placed`` until its members end
    it."""
    configs = [{"cluster": placed.cluster,
                "task": {"type": kind, "index": index}}
               for kind, index in placed.places]
    env = {**os.environ, **self._spec.env,
           _net.JOB_SECRET_VARIABLE: prepared.secret}
    # TensorFlow's C++ chatter, unless the user asked for a level: level 2,
    # and the start-up lines that ignore it dropped from the console.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(job_variables(placed, prepared.run_id), PYTHONUNBUFFERED="1",
               **self._flight.env(placed.attempt))
    workers = self._workers
    workers.start(configs, env, prepared.gpus)
    servers = "ps" in placed.cluster  # Workers only serve under PS.
    trainers = [t for t in workers.tasks
                if t.kind == "chief" or (t.kind == "worker" and not servers)]
    done = failed = False
    while True:
      if self._signal is not None:  # The tasks got it: this node leaves.
        workers.stop()
        if trainers:
          self._console.signalled(
              signal.Signals(self._signal).name,
              [(t.role, t.proc.returncode, t.tail) for t in trainers])
        # SLURM's cue to save: the tasks' own outcome once each saved (42:
        # the job script requeues) or finished (0).
        codes = {t.proc.returncode for t in workers.tasks}
        if self._signal == signal.SIGUSR1 and codes <= {0, PREEMPTED_EXIT_CODE}:
          return _Outcome(max(codes))
        return _Outcome(128 + self._signal)
      message = member.poll(timeout=0.1)
      if self._signal is not None:
        continue  # It came meanwhile: said at the loop's top.
      self._flight.watch(workers.pids(), workers.tails(), message)
      if isinstance(message, rounds.Finish):
        bad = workers.finish_evaluator()
        workers.stop()
        if bad:
          self._console.failure(bad.role, bad.proc.returncode, bad.tail)
          return _Outcome(_exit_code(bad.proc.returncode))
        return _Outcome(0)
      if isinstance(message, rounds.Stop):
        workers.stop()
        if message.restart is None and self._spec.nnodes > 1:
          self._console.say(
              f"node {self._spec.node_rank} stops: {message.why}")
        return _Outcome(
            _exit_code(message.code), message.restart,
            self._spec.restart_delay(message.failures)
            if message.failure else 0.0)
      t = None if failed else workers.failed()
      if t is not None:
        failed, code = True, t.proc.returncode
        dump = self._flight.lost_peer(t.role)
        self._console.failure(
            t.role, code, t.tail,
            restarting=placed.failures < placed.max_restarts)
        if dump is not None:  # Asked before any node stops its tasks.
          self._flight.failed(t.role, code, dump, workers.pids(),
                              workers.tails())
        member.send(rounds.Failed(role=t.role, code=code,
                                  attempt=placed.attempt,
                                  peer_lost=dump is not None))
        workers.stop()
      if not failed and not done and trainers and all(
          t.proc.poll() == 0 for t in trainers):
        done = True
        member.send(rounds.Done())

  def _restart_line(self, placed: rounds.Cluster, delay: float) -> str:
    """The one line of a restart: after a failure its number and wait, else
    that members changed; why; on several nodes the sizes before and
    after, and the nodes left out at the last call."""
    if placed.failure:
      line = (f"restart {placed.failures} of {placed.max_restarts} "
              f"after {delay:g} s: {placed.why}")
    else:
      line = (f"members changed (round {placed.attempt}, no restart "
              f"spent): {placed.why}")
    if self._spec.nnodes > 1:
      line += f"; {placed.previous} nodes, now {len(placed.nodes)}"
    if placed.late:
      line += (f" (not back by the last call: node"
               f"{'s' if len(placed.late) > 1 else ''} "
               f"{', '.join(map(str, placed.late))})")
    return line

  def _on_signal(self, signum, frame) -> None:
    """Forwards the first signal; a second one kills the tasks at once, but
    SIGTERM after SIGUSR1 (SLURM ending a job it told to save, or
    requeueing it) leaves them their grace to finish saving."""
    del frame
    first, self._signal = self._signal, self._signal or signum
    self._stopping.set()
    if (first, signum) != (signal.SIGUSR1, signal.SIGTERM):
      self._workers.signal(signal.SIGKILL if first else _FORWARDED[signum])

  def _on_report(self, signum, frame) -> None:
    """SIGUSR2: the stall report, made by the round's loop."""
    del signum, frame
    if self._flight is not None:
      self._flight.request()

  def _merge_report(self, rank: int, message: dict) -> None:
    """Node 0: a node's answer to a stall report's ask."""
    if self._flight is not None:
      self._flight.merge(rank, message)

  def _sleep(self, seconds: float) -> bool:
    """Sleeps ``seconds`` unless a signal comes; whether none came."""
    return not self._stopping.wait(seconds)


def launch(spec: LaunchSpec, *, out: TextIO | None = None,
           resume: str = output.RESUME) -> int:
  """Runs every task of ``spec``; returns the launcher's exit code.

  Call it from the main thread: it handles SIGINT, SIGTERM, SIGUSR1 and
  SIGHUP, and the tasks die when the thread that started them ends.

  Args:
    spec: what to launch.
    out: where the tasks' prefixed output goes; ``sys.stdout`` by default.
    resume: how to resume, said after a task was preempted and saved.

  Returns:
    0 when the training tasks succeeded and the evaluator, if any, did not
    fail; after the last restart, the failed task's exit code (42 for a
    preempted task that saved: run the same command to resume), ``128 + N``
    when it was killed by signal N; ``128 + N`` when the launcher itself got
    signal N (after SIGUSR1, SLURM's cue, 42 or 0 once every task saved or
    finished).

  Raises:
    ConfigError: `preflight` failed, or the log directory or a task could
      not be created; no task is left running.
  """
  return Launcher(spec, out=out, resume=resume).run()


def job_variables(placed: rounds.Cluster, run_id: str) -> dict[str, str]:
  """What each task of round ``placed`` learns of the job, as torchrun's
  tasks do from its ``TORCHELASTIC_*`` variables."""
  return {
      "TFDIST_RESTART": str(placed.attempt),  # The round: 0, 1, ...
      "TFDIST_RESTART_COUNT": str(placed.failures),  # Restarts spent.
      "TFDIST_MAX_RESTARTS": str(placed.max_restarts),
      "TFDIST_RUN_ID": run_id,
      "TFDIST_NNODES": str(len(placed.nodes)),  # This round's nodes.
  }


def _exit_code(code: int) -> int:
  """A task's return code as a shell gives it: ``128 + N`` for signal N."""
  return code if code >= 0 else 128 - code
