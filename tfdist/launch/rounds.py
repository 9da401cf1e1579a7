"""Who trains, round by round: the rendezvous's decisions, without I/O.

`Rounds` decides, from joins, failures, losses and the clock, when a round
of the job starts, who is in it and where each task goes, and when it ends
in a restart (at whatever size is left) or for good. `Solo` is the
rendezvous of one node, `Rounds` run in the launcher's own process; node 0's
`tfdist.launch.rendezvous.Master` runs the same `Rounds` for many nodes over
the network. TensorFlow-free.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Mapping, Sequence

from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import TfdistError

__all__ = ["Rounds", "Solo", "RendezvousError", "layout_problem",
           "disagreement", "Outbox", "Cluster", "Stop", "Finish", "Wait",
           "Failed", "Done", "typed", "wire"]

_JOB_ORDER = ("chief", "worker", "ps")


class RendezvousError(TfdistError):
  """The rendezvous failed; ``str()`` is one line for the user.

  Attributes:
    code: the exit code the launcher should end with (2: a layout or input
      that cannot work; 1: a node lost or not joining; 0: the job finished
      without this node).
  """

  def __init__(self, message: str, *, code: int = 1):
    super().__init__(message)
    self.code = code


# The typed messages of every source of members (`tfdist.launch.members`).
@dataclasses.dataclass(frozen=True)
class Cluster:
  """A round starts; after a restart, ``why`` and the size before."""
  attempt: int
  cluster: dict
  places: list  # This node's tasks' (type, index).
  nodes: list
  failures: int
  max_restarts: int
  why: str | None = None
  previous: int | None = None
  failure: bool = False
  late: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Stop:
  """The round ends: rejoin as round ``restart``, or (``None``) exit."""
  code: int
  why: str
  restart: int | None = None
  failure: bool = False
  failures: int = 0


@dataclasses.dataclass(frozen=True)
class Wait:
  why: str  # This node waits for the next round.


@dataclasses.dataclass(frozen=True)
class Failed:
  role: str
  code: int
  attempt: int
  peer_lost: bool = False


@dataclasses.dataclass(frozen=True)
class Finish:
  """Every training task is done."""


@dataclasses.dataclass(frozen=True)
class Done:
  """This node's training tasks are done."""


#: A message's kind as sent -> its type; "lost" and "error" are stops.
_KINDS = {"cluster": Cluster, "stop": Stop, "lost": Stop, "error": Stop,
          "finish": Finish, "wait": Wait, "failed": Failed, "done": Done}


def typed(message: Mapping[str, Any]) -> Any:
  """A message as sent as its type; another (a stall report's ``ask``,
  `tfdist.launch.stall`) as it is."""
  kind = _KINDS.get(message.get("kind"))
  if kind is None:
    return message
  return kind(**{f.name: message[f.name] for f in dataclasses.fields(kind)
                 if f.name in message})


def wire(message: Any) -> dict:
  """A typed message as sent."""
  return {"kind": type(message).__name__.lower(),
          **dataclasses.asdict(message)}


def layout_problem(joins: Mapping[int, Mapping[str, Any]]) -> str | None:
  """Why the nodes' tasks make no cluster, or ``None``.

  Args:
    joins: node rank -> its join message (``jobs``: job -> count,
      ``evaluator``: bool).
  """
  def where(job: str) -> list[int]:
    return [r for r, j in sorted(joins.items()) if j["jobs"].get(job)]
  total = {job: sum(j["jobs"].get(job, 0) for j in joins.values())
           for job in _JOB_ORDER}
  if not total["worker"]:
    return "no node runs a worker task: give one node --workers 1 or more"
  if total["chief"] > 1:
    return (f"{total['chief']} chief tasks (nodes {where('chief')}): give "
            "exactly one node --chief")
  if total["ps"] and not total["chief"]:
    return (f"ps tasks on nodes {where('ps')} but no chief: give one node "
            "--chief (the ParameterServerStrategy coordinator)")
  evaluators = [r for r, j in sorted(joins.items()) if j.get("evaluator")]
  if len(evaluators) > 1:
    return (f"evaluators on nodes {evaluators}: give at most one node "
            "--evaluator")
  return None


def _cluster(joins: Mapping[int, Mapping[str, Any]]) -> tuple[dict, dict]:
  """The cluster spec, and node rank -> its tasks' (type, index), in order."""
  cluster: dict[str, list[str]] = {job: [] for job in _JOB_ORDER}
  places: dict[int, list[tuple[str, int]]] = {}
  for rank, join in sorted(joins.items()):
    ports = iter(join["ports"])
    host = join["host"]
    where = f"[{host}]" if ":" in host else host
    places[rank] = []
    for job in _JOB_ORDER:
      for _ in range(join["jobs"].get(job, 0)):
        places[rank].append((job, len(cluster[job])))
        cluster[job].append(f"{where}:{next(ports)}")
    if join.get("evaluator"):
      places[rank].append(("evaluator", 0))
  return {job: tasks for job, tasks in cluster.items() if tasks}, places


Outbox = list[tuple[int, dict]]


def disagreement(ours: Mapping[str, Any], theirs: Any, *,
                 rank: int) -> str | None:
  """Why node ``rank``'s job settings (flag -> value, e.g. ``--nnodes``)
  differ from node 0's ``ours``, naming both values; or ``None``."""
  theirs = theirs if isinstance(theirs, Mapping) else {}
  differ = [f"{flag} {theirs.get(flag, 'unset')} on node {rank}, {value} on "
            "node 0" for flag, value in ours.items()
            if theirs.get(flag) != value]
  if not differ:
    return None
  return f"{'; '.join(differ)} (every node needs the same {' and '.join(ours)})"


@dataclasses.dataclass
class _Change:
  """A change of members settling in a running round."""
  fires: float  # When it stops the round, unless more comes.
  latest: float  # When it stops the round in any case.
  previous: int  # The round's size before.
  whys: list[tuple[int, str]] = dataclasses.field(default_factory=list)
  newcomers: dict[int, dict] = dataclasses.field(default_factory=dict)
  lost: bool = False


class Rounds:
  """Who trains, round by round: the rendezvous's decisions, without I/O.

  A round gathers joins, then runs. It starts at once when ``max_nodes``
  joined, or (after a restart) when every node still connected joined
  again; else, once ``min_nodes`` joined, at the last call ``last_call``
  seconds later, without the nodes that have not joined by then (a later
  join admits them). ``timeout`` bounds each round's wait for
  ``min_nodes``. A running round ends in ``finish`` (every node with
  training tasks is done) or in ``stop``: with ``restart`` (the next
  round's number) or for good. As in torchrun, a change of members (a node
  lost; a node new, back, or left out, joining below ``max_nodes``)
  restarts for free while ``min_nodes`` or more are left; a task that fails
  spends one of ``max_restarts``. A task that failed because it lost a peer
  (``peer_lost`` in its message) races the loss of that peer's node: in an
  elastic job its failure waits ``peer_grace`` seconds, and a node lost
  meanwhile makes the restart a free one. In an elastic job a change of
  members settles first: losses and newcomers within ``settle`` seconds of
  each other (at most ``peer_grace`` in all) are one change, one restart,
  and a task that fails meanwhile is taken for its consequence. Every
  method returns the messages to send, as (node rank, message) pairs.
  """

  def __init__(self, *, min_nodes: int, max_nodes: int, max_restarts: int,
               timeout: float, last_call: float = 0.0, peer_grace: float = 0.0,
               settle: float = 0.0, clock=time.monotonic):
    self._min, self._max = min_nodes, max_nodes
    self._max_restarts = max_restarts
    self._peer_grace = peer_grace if min_nodes < max_nodes else 0.0
    self._settle = settle if min_nodes < max_nodes else 0.0
    self._change: _Change | None = None
    self._held: tuple[float, str, int] | None = None  # A failure waiting.
    self._timeout, self._last_call_seconds = timeout, last_call
    self._clock = clock
    self.attempt = 0  # The round's number.
    self.failures = 0  # Restarts spent.
    self.over = False
    self._members: set[int] = set()  # Connected and proven.
    self._joins: dict[int, dict] = {}  # The round gathering, or running.
    self._running = False
    self._done: set[int] = set()
    self._deadline = clock() + timeout
    self._last_call: float | None = None
    self._restarted: dict[str, Any] = {}  # Why, and the size before.
    self._ending: dict | None = None  # How the job ended.

  def join(self, rank: int, message: dict, *, first: bool) -> Outbox:
    """Node ``rank`` (0 to ``max_nodes`` - 1) joins, ``first`` on a new
    connection; a node outside the running round restarts it for free."""
    if self.over:  # A node late for all of it learns how it ended.
      return [(rank, self._ending)] if first and self._ending else []
    if first:
      self._members.add(rank)
    if not self._running:
      self._joins[rank] = message
      return self._maybe_start()
    if rank in self._joins:
      return []  # Already in the running round.
    # New, back, or left out at a last call: below max_nodes, as ranks are.
    return self._changed(f"node {rank} joined", rank, message)

  def failed(self, rank: int, message: dict) -> Outbox:
    """A task of node ``rank`` failed in the round ``message`` names."""
    if (self.over or not self._running or rank not in self._joins
        or message.get("attempt") != self.attempt):
      return []  # Already stopping, or a failure from before a restart.
    where = f" on node {rank}" if self._max > 1 else ""
    code = message.get("code", 1)
    what = "was preempted" if code == PREEMPTED_EXIT_CODE else "failed"
    why = f"task {message.get('role')}{where} {what}"
    if self._change:
      return []  # The change of members stops the round, for free.
    if message.get("peer_lost") and self._peer_grace:
      if self._held is None:  # A node lost meanwhile restarts for free.
        self._held = (self._clock() + self._peer_grace, why, code)
      return []
    return self._stop(why, code=code, failure=True)

  def done(self, rank: int) -> Outbox:
    """Node ``rank``'s training tasks finished."""
    if self.over or not self._running or rank not in self._joins:
      return []
    self._done.add(rank)
    if not set(_trainer_nodes(self._joins)) <= self._done:
      return []
    return self._end({"kind": "finish"})

  def lost(self, rank: int, why: str) -> Outbox:
    """Node ``rank`` is gone (its connection closed, or it went silent)."""
    self._members.discard(rank)
    if self.over:
      return []
    if not self._running:
      self._joins.pop(rank, None)
      return self._maybe_start()
    if rank not in self._joins:  # It waited for a restart, or came back.
      if self._change:
        self._change.newcomers.pop(rank, None)
      return []
    return self._changed(why, rank)

  def tick(self) -> Outbox:
    """What the clock decides: the last call, or a round not joined in
    time."""
    change = self._change
    if change and self._clock() >= min(change.fires, change.latest):
      return self._changed(None)
    if self._running and self._held and self._clock() >= self._held[0]:
      _, why, code = self._held  # No node was lost: the task's failure.
      return self._stop(why, code=code, failure=True)
    if self.over or self._running:
      return []
    if self._last_call is not None and self._clock() >= self._last_call:
      return self._start()
    if self._clock() <= self._deadline:
      return []
    if self._min == self._max:
      why = (f"nodes {sorted(set(range(self._max)) - set(self._joins))} did "
             f"not join the rendezvous within {self._timeout:g} s")
    else:
      why = (f"{len(self._joins)} nodes joined the rendezvous within "
             f"{self._timeout:g} s; the job needs {self._min} or more")
    return self._end({"kind": "error", "code": 1, "why": why})

  def _changed(self, why: str | None, rank: int = -1,
               joined: dict | None = None) -> Outbox:
    """Node ``rank`` lost (or ``joined``, with its message) in the running
    round: the round stops once the change settled (``why`` ``None``)."""
    now, change = self._clock(), self._change
    if change is None:
      change = self._change = _Change(
          now + self._settle, now + self._peer_grace, len(self._joins))
    if why is not None:
      change.fires = now + self._settle
      change.whys.append((rank, why))
      if joined is None:
        change.lost = True
        self._joins.pop(rank, None)
      else:
        change.newcomers[rank] = joined
      if self._settle:
        return []
    (_, why), *more = change.whys
    if more:
      ranks = ", ".join(map(str, dict.fromkeys(r for r, _ in more)))
      why += (f"; {len(more)} more within {self._settle:g} s of each other "
              f"(nodes {ranks})")
    out = self._stop(why, code=int(change.lost), failure=False,
                     previous=change.previous)
    self._joins.update(change.newcomers)
    return out

  def _maybe_start(self) -> Outbox:
    joined = set(self._joins)
    if len(joined) < self._min:
      self._last_call = None
      return []
    if len(joined) >= self._max or (self.attempt and joined >= self._members):
      return self._start()
    if self._last_call is None:  # Never past the round's deadline.
      self._last_call = min(self._clock() + self._last_call_seconds,
                            self._deadline)
    return self._start() if self._clock() >= self._last_call else []

  def _start(self) -> Outbox:
    problem = layout_problem(self._joins)
    if problem:
      return self._end({"kind": "error", "code": 2, "why": problem})
    cluster, places = _cluster(self._joins)
    late = sorted(self._members - set(self._joins))
    self._running, self._done, self._last_call = True, set(), None
    shared = {"kind": "cluster", "attempt": self.attempt, "cluster": cluster,
              "nodes": sorted(self._joins), "failures": self.failures,
              "max_restarts": self._max_restarts, **self._restarted}
    if late:
      shared["late"] = late
    return [(r, {**shared, "places": places[r]}) for r in sorted(self._joins)
            ] + [(r, {"kind": "wait", "why": (
                f"node {r} did not join again by the last call "
                f"({self._last_call_seconds:g} s): the job goes on without "
                "it, and it joins at the next restart")}) for r in late]

  def _stop(self, why: str, *, code: int, failure: bool,
            previous: int | None = None) -> Outbox:
    """Ends the running round: a restart, or the end of the job."""
    self._held = self._change = None
    nodes = len(self._members)
    if nodes >= self._min and (not failure
                               or self.failures < self._max_restarts):
      self.attempt += 1
      self.failures += failure
      message = {"kind": "stop", "code": code, "why": why,
                 "restart": self.attempt, "failure": failure,
                 "failures": self.failures}
      self._restarted = {"why": why, "failure": failure,
                         "previous": previous or len(self._joins)}
      self._running, self._joins, self._last_call = False, {}, None
      self._deadline = self._clock() + self._timeout
      return [(r, message) for r in sorted(self._members)]
    if nodes < self._min:
      why += f"; {nodes} nodes left, the job needs {self._min}"
    return self._end({"kind": "stop", "code": code or 1, "why": why,
                      "restart": None})

  def _end(self, message: dict) -> Outbox:
    """Ends the job: ``message`` to every node, and to any that joins
    later."""
    self.over, self._ending = True, message
    return [(r, message) for r in sorted(self._members)]


def _trainer_nodes(joins: Mapping[int, Mapping[str, Any]]) -> list[int]:
  """Nodes running training tasks: chief and, without ps, workers."""
  servers = any(j["jobs"].get("ps") for j in joins.values())
  return sorted(r for r, j in joins.items()
                if j["jobs"].get("chief")
                or (j["jobs"].get("worker") and not servers))


class Solo:
  """The members of one node: `Rounds` in this process, no network."""

  def __init__(self, *, max_restarts: int):
    self._rounds = Rounds(min_nodes=1, max_nodes=1, max_restarts=max_restarts,
                          timeout=math.inf)
    self._inbox: collections.deque = collections.deque()
    self._joined = False

  def join(self, *, attempt: int, host: str, jobs: Mapping[str, int],
           evaluator: bool, ports: Sequence[int]) -> Cluster:
    out = self._rounds.join(0, {"attempt": attempt, "host": host,
                                "jobs": dict(jobs), "evaluator": evaluator,
                                "ports": list(ports)}, first=not self._joined)
    self._joined = True
    self._inbox.extend(m for _, m in out)
    message = self.poll()
    if not isinstance(message, Cluster):
      raise RendezvousError(getattr(message, "why", "no cluster"),
                            code=getattr(message, "code", 1))
    return message

  def send(self, message: Any) -> None:
    if isinstance(message, Failed):
      self._inbox.extend(m for _, m in self._rounds.failed(0, wire(message)))
    elif isinstance(message, Done):
      self._inbox.extend(m for _, m in self._rounds.done(0))

  def poll(self, timeout: float = 0.0) -> Any:
    if self._inbox:
      return typed(self._inbox.popleft())
    time.sleep(timeout)
    return None

  def close(self) -> None:
    pass
