"""`SocketRing`: ring all-reduce of float32 numpy buffers over TCP sockets.

`SocketRing` sums one float32 buffer over ``n`` processes the way Baidu's and
Horovod's ring all-reduce does, a reduce-scatter then an all-gather of ``n``
segments (`tfdist.ring.schedule`): each process sends and receives
``2 (n - 1) / n`` of the buffer, the least any all-reduce can.

* **Accumulation** is float32. The wire dtype (``float32``, ``float16`` or
  ``bfloat16``) is only what crosses the socket: a received partial sum is
  widened before it is added. The owner of a segment rounds its sum to the
  wire dtype once and keeps that rounded value too, so every process ends
  with the same bits.
* **Pipelining**: a step moves its segment in blocks of ``block_bytes`` (of
  float32), encoding a block just before it is sent and adding one as soon
  as it is in, so the working set stays in cache (`tfdist.ring.exchange`:
  one thread, or two for a large step where the process has two cores).
* **Schedules** (`SCHEDULES`, a module each, a pure plan that `SocketRing`
  alone carries out): `choose` picks by their alpha-beta models over the
  link the ring measured as it connected (`SocketRing.link`): with float32
  on the wire, recursive doubling for small buffers, from 4 ranks halving
  and doubling for middle ones, else the ring. ``schedule=`` forces one.
* **In place**: ``out=data`` sums into the input (no output buffer; what
  the TensorFlow glue does with its packed gradients).
* **Lists**: a list of arrays is summed as their concatenation without
  making it (`tfdist.ring.pieces`): a block spanning several arrays is
  sent as their views and added view by view, so a model's large
  gradients reach the ring with no packing copy.
* **Connection** (`tfdist.ring.connection`): at the first call, or on
  `SocketRing.connect`, through a `Rendezvous`, listening on this process's
  own address within ``ports``; a stray connection is dropped and waited
  past.
* **Security** (`tfdist._secret.Gate`, `tfdist.ring.auth`): with a job
  secret (``secret``, or ``TFDIST_JOB_SECRET``) every connection proves
  both ends hold it (challenge and response, fresh nonces); with
  ``authenticate_values`` every step's bytes carry an HMAC-SHA256 tag,
  checked before use. Without a secret the ring logs once that it is
  unauthenticated. Nothing is encrypted.
* **Ordering check**: every call starts with a header
  (`tfdist.ring.wire`) that must match the left neighbour's, so
  processes that call in a different order fail loudly instead of adding
  unrelated numbers.
* **Timeouts**: connecting is bounded by ``connect_timeout_s``; during an
  all-reduce a peer that sends nothing (or takes nothing) for ``timeout_s``
  is declared lost. A closed connection is noticed at once. Every socket
  call is bounded, so nothing waits forever. After a failure the ring is
  closed and every later call raises the same error.

Pure Python, numpy and ``ml_dtypes`` (bfloat16); no TensorFlow here.

Example (one process per rank; ``rendezvous`` shared, e.g. TensorFlow's
coordination service)::

  ring = SocketRing(rank=r, hosts=["10.0.0.1", "10.0.0.2"],
                    rendezvous=rendezvous, key="job-1/ring-0")
  total = ring.all_reduce(np.ones(1000, np.float32), wire="bfloat16")
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Iterable, Iterator, NamedTuple, Sequence

from absl import logging
import numpy as np

from tfdist import _flight
from tfdist import _net
from tfdist import _process
from tfdist.errors import ConfigError
from tfdist.errors import WorkerLostError
from tfdist.ring import auth
from tfdist.ring import connection
from tfdist.ring import courier as courier_lib
from tfdist.ring import doubling
from tfdist.ring import exchange
from tfdist.ring import halving
from tfdist.ring import pieces
from tfdist.ring import schedule as ring_schedule
from tfdist.ring import wire as wire_lib
from tfdist.ring.schedule import Step
from tfdist.ring.schedule import blocks
from tfdist.ring.wire import WIRE_DTYPES
from tfdist.ring.wire import as_bytes
from tfdist.ring.wire import decode
from tfdist.ring.wire import encode

__all__ = ["SocketRing", "DEFAULT_BLOCK_BYTES", "DEFAULT_LATENCY_S",
           "DEFAULT_BYTES_PER_S", "SCHEDULES", "choose"]

#: Bytes (of float32) per pipelined block: small enough to stay in L2 cache,
#: large enough that Python's per-block cost is noise.
DEFAULT_BLOCK_BYTES = 512 << 10

#: The schedules by name, a module each with ``NAME``, ``WIRES`` (the wire
#: dtypes it carries), ``seconds(size, nbytes, *, latency_s, bytes_per_s)``
#: (its alpha-beta model), ``CAP_BYTES`` (float32 bytes above which `choose`
#: never picks it; ``None``: none) and ``plan(rank, size, length)`` (its
#: `tfdist.ring.schedule.Step`s). The ring, last, takes every other call.
SCHEDULES = {m.NAME: m for m in (doubling, halving, ring_schedule)}

#: The fallback link `choose` assumes where none was measured
#: (`SocketRing.link`): 0.95 of 1 Gbit/s, the slowest tfdist is measured
#: on, and 100 us a message, Python at both ends (two bed hosts took 73 us a
#: ring step, 98 us a doubling exchange at 4 KiB; docs/benchmarks.md).
DEFAULT_BYTES_PER_S = 0.95 * 125e6
DEFAULT_LATENCY_S = 100e-6
#: Another schedule must beat the ring's model time by more than rounding:
#: a tie keeps the ring, which needs no connections of its own.
_TIE = 1e-9
#: What a ring times when it connects (`SocketRing.link`): (bytes, times)
#: of exchanges for the rate, (float32 values, times) of all-reduces for a
#: message's cost; figures that took longer than `_MEASURE_S` are dropped.
_PROBES, _STEP_PROBE = ((8, 20), (1 << 20, 3)), (256, 5)
_MEASURE_S = 1.0


@functools.lru_cache(maxsize=1024)
def choose(size: int, nbytes: int, wire: str = "float32", *,
           latency_s: float = DEFAULT_LATENCY_S,
           bytes_per_s: float = DEFAULT_BYTES_PER_S) -> str:
  """The schedule an all-reduce takes: the rule, the same on every rank.

  Of `SCHEDULES` that carry ``wire`` and whose cap (``CAP_BYTES``) admits
  ``nbytes``, the one whose model (``seconds``) is least, a message of
  ``b`` bytes costing ``latency_s + b / bytes_per_s``; the ring on a tie,
  for one rank and for an empty buffer.

  Args:
    size: the number of ranks.
    nbytes: the buffer's float32 bytes.
    wire: the wire dtype.
    latency_s: one message's fixed cost.
    bytes_per_s: the link's rate.

  Returns:
    A key of `SCHEDULES`.
  """
  best = ring_schedule.NAME
  if size < 2 or nbytes <= 0:
    return best
  model = dict(latency_s=latency_s, bytes_per_s=bytes_per_s)
  least = ring_schedule.seconds(size, nbytes, **model) * (1 - _TIE)
  for name, m in SCHEDULES.items():
    if wire in m.WIRES and (m.CAP_BYTES is None
                            or nbytes <= m.CAP_BYTES):
      seconds = m.seconds(size, nbytes, **model)
      if seconds < least:
        best, least = name, seconds
  return best


def _carries(name: str, size: int, wire: str | None = None) -> bool:
  """Whether schedule ``name`` carries ``size`` ranks (and ``wire``)."""
  try:
    SCHEDULES[name].plan(0, size, 0)
  except ValueError:
    return False
  return wire is None or wire in SCHEDULES[name].WIRES


class _Plan(NamedTuple):
  """A rank's plan and what `SocketRing._moves` derives from it."""
  steps: tuple[Step, ...]
  along: bool  # `tfdist.ring.schedule.along`
  sources: tuple[tuple[bool, bool], ...]  # `tfdist.ring.schedule.sources`
  longest: int  # The longest span, in elements.


def _prepared(steps: tuple[Step, ...], rank: int, size: int) -> _Plan:
  return _Plan(steps, ring_schedule.along(steps, rank, size),
               ring_schedule.sources(steps),
               max([hi - lo for s in steps for lo, hi in (s.send, s.recv)],
                   default=0))


@functools.lru_cache(maxsize=256)  # A training step's lengths recur.
def _planned(name: str, rank: int, size: int, length: int) -> _Plan:
  return _prepared(SCHEDULES[name].plan(rank, size, length), rank, size)


def _apart(xs: list[np.ndarray], outs: list[np.ndarray]) -> list[np.ndarray]:
  """``xs``, each copied where it overlaps its output without being it."""
  return [x.copy() if (np.may_share_memory(x, o)
                       and x.ctypes.data != o.ctypes.data) else x
          for x, o in zip(xs, outs)]


def _shaped(out: np.ndarray, data) -> np.ndarray:
  """``out`` in ``data``'s shape; ``out`` itself when it has it already."""
  shape = np.shape(data)
  return out if out.shape == shape else out.reshape(shape)


class SocketRing:
  """One process's place in a ring all-reduce over TCP.

  Thread-safe: concurrent calls are serialized (their order must still be
  the same on every process; the header check catches most mistakes).

  Args:
    rank: this process's position, 0 to ``len(hosts) - 1``.
    hosts: every member's host name or address, by rank.
    rendezvous: where listening ports are published and looked up.
    key: a prefix unique to this ring among everything published in
      ``rendezvous``; every member passes the same one.
    names: how errors name each member (e.g. ``"worker:1"``); ranks if
      omitted.
    connect_timeout_s: bound on connecting the ring.
    timeout_s: a peer that sends nothing (or takes nothing) for this long
      during an all-reduce is declared lost.
    block_bytes: float32 bytes per pipelined block.
    source: where the hosts came from, for error messages.
    secret: the job's shared secret, the same on every member;
      ``TFDIST_JOB_SECRET`` (`tfdist._net.job_secret`) when ``None``.
      Without either the ring is unauthenticated (logged once).
    ports: ``"FIRST-LAST"`` (or one port): listen on the first free one;
      ``TFDIST_RING_PORTS`` when ``None``, else any port the OS picks.
    authenticate_values: also tag every step's bytes (HMAC-SHA256), so
      values altered on the way fail the call; costs hashing every byte
      sent and received. Needs a secret.
    threaded_bytes: steps that receive at least this many bytes run a
      sending and a receiving thread; ``None``:
      `tfdist.ring.exchange.threaded_bytes`.
    schedule: the name of the schedule every call takes, one of
      `SCHEDULES`; ``None``: `choose`'s. A call whose wire it does not
      carry is refused (`schedule_for`).
      With more than two ranks the schedules other than the ring make a
      connection per partner (one more listening port each, made at the
      first such call).

  Raises:
    ConfigError: a rank out of range, a non-positive timeout or
      ``block_bytes``, malformed ``ports``, ``authenticate_values``
      without a secret, or an unknown ``schedule`` or one that cannot
      carry ``len(hosts)`` ranks (naming those that can).
  """

  def __init__(self, *, rank: int, hosts: Sequence[str],
               rendezvous: connection.Rendezvous, key: str,
               names: Sequence[str] | None = None,
               connect_timeout_s: float = 300.0, timeout_s: float = 300.0,
               block_bytes: int = DEFAULT_BLOCK_BYTES,
               source: str = "SocketRing", secret: bytes | str | None = None,
               ports: str | None = None, authenticate_values: bool = False,
               threaded_bytes: int | None = None,
               schedule: str | None = None):
    hosts = tuple(hosts)
    self._members = connection.Members(
        rank=rank, hosts=hosts, source=source,
        names=tuple(names) if names else tuple(
            f"rank {i}" for i in range(len(hosts))))
    for field, value in (("connect_timeout_s", connect_timeout_s),
                         ("timeout_s", timeout_s),
                         ("block_bytes", block_bytes)):
      if not value > 0:
        raise ConfigError(field=field, value=value, source=source,
                          expected="a positive number")
    if secret is None:
      secret = _net.job_secret()
    self._secret = secret.encode() if isinstance(secret, str) else secret
    if authenticate_values and not self._secret:
      raise ConfigError(
          field="authenticate_values", value=True, source=source,
          expected=f"a job secret ({_net.JOB_SECRET_VARIABLE} or secret=)")
    self._authenticate_values = bool(authenticate_values)
    if schedule is not None and not (isinstance(schedule, str)
                                     and schedule in SCHEDULES):
      raise ConfigError(field="schedule", value=schedule, source=source,
                        expected=f"None (the rule) or one of "
                                 f"{sorted(SCHEDULES)}")
    if schedule is not None and not _carries(schedule, len(hosts)):
      raise ConfigError(field="schedule", value=schedule, source=source,
                        expected=f"one that carries {len(hosts)} hosts: "
                        f"{[n for n in SCHEDULES if _carries(n, len(hosts))]}")
    self._forced = schedule
    self._link_figures = dict(latency_s=DEFAULT_LATENCY_S,
                              bytes_per_s=DEFAULT_BYTES_PER_S)
    self._pairs: dict[int, SocketRing] = {}
    self._ports_text = ports
    self._ports = connection.ring_ports(ports, source=source)
    self._rendezvous = rendezvous
    self._key = key
    self._connect_timeout_s = float(connect_timeout_s)
    self._timeout_s = float(timeout_s)
    self._block = max(1, int(block_bytes) // 4)
    self._threaded_bytes = int(exchange.threaded_bytes()
                               if threaded_bytes is None else threaded_bytes)
    self._source = source
    self._header_source = (
        f"socket transport, {self._members.describe(self._members.left)}")
    self._lock = threading.Lock()
    self._link: exchange.Link | None = None
    self._failure: BaseException | None = None
    self._calls = 0
    self._wire_bufs: dict[str, list[np.ndarray]] = {}
    self._widened = np.empty(self._block, np.float32)
    self._courier: courier_lib.Courier | None = None
    self._courier_lock = threading.Lock()

  @property
  def rank(self) -> int:
    return self._members.rank

  @property
  def size(self) -> int:
    return self._members.size

  @property
  def connected(self) -> bool:
    return self._link is not None

  def schedule_for(self, nbytes: int, wire: str = "float32") -> str:
    """The schedule (a key of `SCHEDULES`) a call of ``nbytes`` float32
    bytes with ``wire`` takes on this ring: `choose`'s, or the one forced
    (``schedule``); the ring for an empty buffer (it moves only the call's
    header).

    Raises:
      ConfigError: the forced schedule does not carry ``wire``; names the
        schedules that do.
    """
    forced = self._forced
    if forced is None or not nbytes:
      return choose(self.size, nbytes, wire, **self._link_figures)
    if wire not in SCHEDULES[forced].WIRES:
      raise ConfigError(
          field="schedule", value=forced, source=self._source,
          expected=f"one that carries wire={wire!r}: "
                   f"{[n for n in SCHEDULES if _carries(n, self.size, wire)]}")
    return forced

  @property
  def link(self) -> dict[str, float]:
    """The figures `choose` takes for this ring (``latency_s``,
    ``bytes_per_s``): measured when a ring of the rule (no ``schedule``)
    connects, the same on every rank; the defaults until then, or where
    the measuring failed (logged, naming the hops)."""
    return dict(self._link_figures)

  @property
  def calls(self) -> int:
    """The calls (all-reduces and exchanges) this ring has started."""
    return self._calls

  # Connection.

  def connect(self) -> None:
    """Connects to both neighbours; does nothing when connected.

    Once connecting or a call has failed, this and every later call raise
    that first error again, whatever its type.

    Raises:
      StartupTimeoutError: a neighbour did not publish its port, accept or
        connect within ``connect_timeout_s``.
      ConfigError: a host that does not resolve.
      WorkerLostError: the ring was closed, or lost a peer in a call.
    """
    with self._lock:
      self._connect_locked()

  @property
  def failure(self) -> BaseException | None:
    """The error that closed this ring for good (every later call raises it
    again), or ``None`` while it works."""
    return self._failure

  @property
  def courier(self) -> courier_lib.Courier:
    """The thread that runs work queued for this ring in order (made at
    first use; `tfdist.ring.courier`)."""
    with self._courier_lock:
      if self._courier is None:
        self._courier = courier_lib.Courier(lambda: self._failure)
      return self._courier

  def _connect_locked(self) -> None:
    if self._failure is not None:
      raise self._failure
    if self._link is not None or self.size == 1:
      return
    members = self._members
    deadline = time.monotonic() + self._connect_timeout_s
    self._warn_unauthenticated()
    try:
      listener = connection.listen(members, ports=self._ports,
                                   ports_source=self._source)
      pair = connection.handshake(
          listener, members, rendezvous=self._rendezvous, key=self._key,
          deadline=deadline, timeout_s=self._connect_timeout_s,
          secret=self._secret or None)
    except BaseException as e:
      # The port is published under this key for good: no second try.
      self._failure = e if isinstance(e, Exception) else WorkerLostError(
          f"socket transport: connecting was interrupted ({e!r})")
      raise
    seal = None
    if self._authenticate_values:
      seal = auth.Sealer(send_key=pair.right_key, recv_key=pair.left_key,
                         left_rank=members.left).seal
    self._link = exchange.Link(left=pair.left, right=pair.right,
                               left_rank=members.left,
                               right_rank=members.right,
                               timeout_s=self._timeout_s, seal=seal,
                               threaded_bytes=self._threaded_bytes)
    if self._forced is None:
      try:
        self._measure()
      except exchange.PeerLost as e:
        self._fail(WorkerLostError(
            f"socket transport: {members.me} lost "
            f"{members.describe(e.rank)} measuring the link: {e.what}"))

  def _measure(self) -> None:
    """Times the ring, all ranks at once: a message costs the median of
    `_STEP_PROBE` all-reduces over their 2 (N - 1) steps (each waits for
    the left's), the rate from `_PROBES`; every rank takes the slowest."""
    start, times, n, r = time.monotonic(), [], self.size, self.rank
    values, repeats = _STEP_PROBE
    steps, probe = [], pieces.Pieces([np.zeros(values, np.float32)])
    for _ in range(repeats):
      t = time.perf_counter()
      self._run(_planned(ring_schedule.NAME, r, n, values), probe, probe,
                "float32", 0, "measuring the link")
      steps.append(time.perf_counter() - t)
    self._calls = 0  # Not the user's calls (every rank alike).
    for nbytes, repeats in _PROBES:
      sent, got = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)
      took = []
      for _ in range(repeats):
        t = time.perf_counter()
        self._link.exchange([lambda: sent], [(got, None, -1)])
        took.append(time.perf_counter() - t)
      times.append(min(took))
    (small, large), (t_small, t_large) = [p[0] for p in _PROBES], times
    figures = np.full((n, 2), np.nan)
    if time.monotonic() - start < _MEASURE_S and t_large > t_small:
      figures[r] = (np.median(steps) / (2 * (n - 1)),
                    (t_large - t_small) / (large - small))
    for s in range(n - 1):  # Rank r passes on what it has of rank r - s.
      self._link.exchange([lambda i=(r - s) % n: as_bytes(figures[i])],
                          [(as_bytes(figures[(r - s - 1) % n]), None, -1)])
    failed = np.isnan(figures[:, 0])
    if failed.any():
      names = self._members.names
      logging.warning(
          "socket transport: measuring the link failed or took over %s s "
          "on the hop(s) %s; the schedules are chosen for the assumed link",
          _MEASURE_S, ", ".join(f"{names[(i - 1) % n]} -> {names[i]}"
                                for i in np.flatnonzero(failed)))
      return
    self._link_figures = dict(latency_s=float(figures[:, 0].max()),
                              bytes_per_s=float(1 / figures[:, 1].max()))

  def _warn_unauthenticated(self) -> None:
    if self._secret or not _process.once("unauthenticated ring"):
      return
    logging.warning(
        "socket transport: the ring is unauthenticated: any process that "
        "reaches its ports can join it. Set %s to the same secret on every "
        "worker (tfdist launch and tfdist slurm do), or pass secret=",
        _net.JOB_SECRET_VARIABLE)

  # All-reduce.

  def all_reduce(self, data: np.ndarray | Sequence[np.ndarray], *,
                 wire: str = "float32", tag: int = 0,
                 out: np.ndarray | Sequence[np.ndarray] | None = None,
                 kind: str = "all-reduce") -> np.ndarray | list[np.ndarray]:
    """The element-wise sum of ``data`` over every process of the ring.

    Every process must call with the same length, ``wire`` and ``tag``, in
    the same order.

    Args:
      data: a float32 array (any shape; summed flat), or a list of float32
        arrays summed as their concatenation without making it
        (`tfdist.ring.pieces`: a model's gradients as they are).
      wire: the dtype sent, one of `WIRE_DTYPES`.
      tag: a number identifying the call site, checked against the peers'.
      out: where the sum goes. For an array, a contiguous float32 array of
        ``data``'s size; for a list, a list of such arrays of its arrays'
        sizes, in order. ``data`` itself sums in place. New arrays when
        omitted.
      kind: what the call is, for the flight recorder (`tfdist._flight`).

    Returns:
      ``out`` (or new float32 arrays) holding the same bits on every
      process: an array shaped as ``data``, or a list of flat arrays.

    Raises:
      WorkerLostError: a peer closed its connection, failed or sent nothing
        for ``timeout_s``; names the peer.
      StartupTimeoutError: the ring could not connect.
      ConfigError: an unknown ``wire``, an unusable ``out``, or a peer that
        called with another length, wire dtype or tag (calls out of order).
    """
    if wire not in WIRE_DTYPES:
      raise ConfigError(field="wire", value=wire, source=self._source,
                        expected=f"one of {sorted(WIRE_DTYPES)}")
    if isinstance(data, (list, tuple)):
      xs = [np.ascontiguousarray(d, dtype=np.float32).reshape(-1)
            for d in data]
      if out is None:
        out = [np.empty(x.size, np.float32) for x in xs]
      elif (not isinstance(out, (list, tuple)) or len(out) != len(xs)):
        raise ConfigError(field="out", value=type(out).__name__,
                          source=self._source,
                          expected=f"a list of {len(xs)} arrays, as data")
      outs = [self._checked_out(o, x.size) for o, x in zip(out, xs)]
      self._sum(pieces.Pieces(_apart(xs, outs)), pieces.Pieces(outs), wire,
                tag, kind)
      return list(out)
    x = np.ascontiguousarray(data, dtype=np.float32).reshape(-1)
    if out is None:
      out = np.empty(x.size, np.float32)
    flat_out = self._checked_out(out, x.size)
    self._sum(pieces.Pieces(_apart([x], [flat_out])),
              pieces.Pieces([flat_out]), wire, tag, kind)
    return _shaped(out, data)

  def _checked_out(self, out, size: int) -> np.ndarray:
    """``out`` flat, if it can take a sum of ``size`` float32 values."""
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32
        or out.size != size or not out.flags.c_contiguous
        or not out.flags.writeable):
      raise ConfigError(field="out", value=type(out).__name__,
                        source=self._source,
                        expected=f"a writable contiguous float32 array of "
                                 f"{size} values")
    return out.reshape(-1)

  def _sum(self, x: pieces.Pieces, out: pieces.Pieces, wire: str,
           tag: int, kind: str) -> None:
    """Sums ``x`` into ``out`` (the same layout) by its `schedule_for`."""
    with self._lock:
      if self.size == 1 and self._failure is None:
        for a, b in zip(x.arrays, out.arrays):
          if a.ctypes.data != b.ctypes.data:
            np.copyto(b, a)
        return
      with self._recorded(kind, wire, x.size):
        if self._forced is None:
          self._connect_locked()  # Measures the link the rule takes.
        if self._failure is not None:
          raise self._failure
        name = self.schedule_for(x.size * 4, wire)
        self._run(_planned(name, self.rank, self.size, x.size), x,
                  out, wire, tag, "all-reduce")

  def _recorded(self, kind: str, wire: str, size: int):
    """The flight recorder's note of one call: its peers are the ring."""
    members = self._members
    return _flight.recorded(
        kind, transport=f"socket ring ({wire})", nbytes=size * 4,
        peers=f"ring of {members.size}: from {members.names[members.left]}"
              f" to {members.names[members.right]}")

  def send_receive(self, data: np.ndarray, out: np.ndarray, *,
                   tag: int = 0) -> None:
    """Sends ``data`` to the right neighbour, receives the left's into ``out``.

    The data movement of an all-reduce without its arithmetic, on the same
    sockets and loop: with 2 workers an all-reduce of S bytes moves S bytes
    each way, so an exchange of S bytes bounds how fast any all-reduce can
    be on these sockets (`tfdist bench` reports it as the ceiling). Every
    worker calls it in step, as `all_reduce`.

    Args:
      data: a contiguous float32 array.
      out: a writable contiguous float32 array of the same size.
      tag: a number identifying the call site, checked against the peers'.

    Raises:
      WorkerLostError: a peer died or stopped.
      StartupTimeoutError: the ring could not connect.
    """
    with self._lock:
      if self.size == 1 and self._failure is None:
        np.copyto(out.reshape(-1), data.reshape(-1))
        return
      with self._recorded("exchange", "float32", data.size):
        span, m = (0, data.size), self._members
        step = Step(m.right, span, m.left, span, False)
        self._run(_prepared((step,), self.rank, self.size),
                  pieces.Pieces([data.reshape(-1)]),
                  pieces.Pieces([out.reshape(-1)]), "float32", tag, "exchange")

  def _run(self, plan: _Plan, x: pieces.Pieces,
           out: pieces.Pieces, wire: str, tag: int, what: str) -> None:
    """Carries out one rank's plan (`tfdist.ring.schedule`) as one call:
    along the ring, over the neighbours' connections with one header; by
    partner, each step one call on that partner's ring of two (`_pair`),
    where a partner's failure closes this ring and every partner's."""
    moves = self._moves(plan, x, out, wire)
    if plan.along:
      self._call_locked(what, x.size, wire, tag,
                        ((sends, recvs) for _, sends, recvs in moves))
      return
    self._calls += 1
    try:
      for partner, sends, recvs in moves:
        pair = self._pair(partner)
        with pair._lock:
          pair._call_locked(what, x.size, wire, tag, [(sends, recvs)])
    except BaseException as e:
      # The partner's own error (a WorkerLostError naming it, a timeout).
      self._failure = e if isinstance(e, Exception) else WorkerLostError(
          f"socket transport: an all-reduce of {self._members.me} was "
          f"interrupted ({e!r}); the ring is out of step and closed")
      self._close_locked()
      raise

  def _moves(self, plan: _Plan, x: pieces.Pieces,
             out: pieces.Pieces, wire: str
             ) -> Iterator[tuple[int, list, list]]:
    """Each step's ``(peer, sends, recvs)`` for `exchange.Link.exchange`,
    in blocks of ``block_bytes``: a block is encoded just before it is
    sent, and a received one added (or stored) as soon as it is in.

    A span is read from ``x`` until received into, then from ``out``
    (`tfdist.ring.schedule.sources`), so ``out`` may be ``x``. With a
    compressed wire, a rank that sends a value its peer stores keeps the
    rounding too (the same bits everywhere), and a span stored at one
    step and sent at the next is forwarded as it came.
    """
    compressed, block = wire != "float32", self._block
    bufs = self._wire(wire, plan.longest)
    previous = None
    for k, (step, (send_x, add_x)) in enumerate(
        zip(plan.steps, plan.sources)):
      send_buf, recv_buf = bufs[(k + 1) % 2], bufs[k % 2]
      src, base = x if send_x else out, x if add_x else out
      (slo, shi), (rlo, rhi) = step.send, step.recv
      forward = (compressed and previous is not None and not previous.add
                 and previous.recv == step.send)
      overlap = slo < rhi and rlo < shi  # Adds wait for what they overwrite.
      sends, ends = [], []
      for lo, hi in blocks(step.send, block):
        if forward:
          sends.append(functools.partial(as_bytes,
                                         send_buf[lo - slo:hi - slo]))
        elif compressed:
          sends.append(functools.partial(
              _encode, src.views(lo, hi), send_buf[lo - slo:hi - slo],
              None if step.add else out.views(lo, hi)))
        else:
          sends.extend(functools.partial(as_bytes, v)
                       for _, v in src.views(lo, hi))
        if overlap:
          ends.append((lo, hi, len(sends) - 1))
      recvs = []
      for lo, hi in blocks(step.recv, block):
        if not (compressed or step.add):
          recvs.extend((as_bytes(v), None, -1) for _, v in out.views(lo, hi))
          continue
        part = recv_buf[lo - rlo:hi - rlo]
        recvs.append((as_bytes(part), functools.partial(
            _land, part, self._widened if compressed else None,
            base.views(lo, hi) if step.add else None, out.views(lo, hi)),
                      max((i for a, b, i in ends if a < hi and lo < b),
                          default=-1) if overlap else -1))
      yield (step.source if step.to is None else step.to), sends, recvs
      previous = step

  def _pair(self, partner: int) -> "SocketRing":
    """The ring of two joining this rank and ``partner`` (made once)."""
    pair = self._pairs.get(partner)
    if pair is None:
      lo, hi = sorted((self.rank, partner))
      members = self._members
      pair = SocketRing(
          rank=0 if self.rank == lo else 1,
          hosts=(members.hosts[lo], members.hosts[hi]),
          names=(members.names[lo], members.names[hi]),
          rendezvous=self._rendezvous, key=f"{self._key}/pair/{lo}-{hi}",
          connect_timeout_s=self._connect_timeout_s,
          timeout_s=self._timeout_s, block_bytes=self._block * 4,
          source=self._source, secret=self._secret,
          ports=self._ports_text,
          authenticate_values=self._authenticate_values,
          threaded_bytes=self._threaded_bytes, schedule="ring")  # Unmeasured.
      self._pairs[partner] = pair
    return pair

  def _call_locked(self, what: str, length: int, wire: str, tag: int,
                   moves: Iterable[tuple[list, list]]) -> None:
    """One numbered call over the neighbours' connections, under the ring's
    failure rules: each of ``moves`` is one step's ``(sends, recvs)``
    (`tfdist.ring.exchange.Link.exchange`), the call's header first.

    A lost peer becomes `WorkerLostError` naming it, a mismatched header a
    `ConfigError`; either, or an interruption, closes the ring for good.
    """
    if self._failure is not None:
      raise self._failure
    self._connect_locked()
    call = self._calls
    self._calls += 1
    try:
      header = wire_lib.header(call, length, wire, tag)
      head_in = bytearray(wire_lib.HEADER_SIZE)
      # The peer's header is checked once ours is written, so that on a
      # mismatch both sides learn it before either closes.
      sends = [lambda: header]
      recvs = [(head_in, lambda: self._check_header(head_in, header), 0)]
      for step_sends, step_recvs in moves:
        if sends:  # The header is sent first: the step's sends move up one.
          step_recvs = [(b, done, after + 1 if after >= 0 else after)
                        for b, done, after in step_recvs]
        self._link.exchange(sends + step_sends, recvs + step_recvs)
        sends, recvs = [], []
    except exchange.PeerLost as e:
      self._fail(WorkerLostError(
          f"socket transport: {self._members.me} lost "
          f"{self._members.describe(e.rank)} during {what} #{call} "
          f"({length} float32 values): {e.what}. A peer died or stopped; "
          "restart the cluster (tfdist launch --max-restarts K, or "
          "SLURM's requeue)"))
    except ConfigError as e:
      self._fail(e)
    except BaseException as e:  # E.g. KeyboardInterrupt: the ring is torn.
      self._failure = WorkerLostError(
          f"socket transport: {what} #{call} of "
          f"{self._members.me} was interrupted ({e!r}); the ring "
          "is out of step and closed")
      self._close_locked()
      raise

  def _fail(self, error: BaseException):
    self._failure = error
    self._close_locked()
    raise error from None

  def _check_header(self, received: bytearray, mine: bytes) -> None:
    wire_lib.check_header(received, mine, source=self._header_source)

  def _wire(self, wire: str, length: int) -> list[np.ndarray]:
    """Two wire buffers of at least ``length``, reused across calls."""
    bufs = self._wire_bufs.get(wire)
    if bufs is None or bufs[0].size < length:
      bufs = [np.empty(length, WIRE_DTYPES[wire]) for _ in range(2)]
      self._wire_bufs[wire] = bufs
    return bufs

  # Shutdown.

  def close(self) -> None:
    """Closes the connections for good; later calls raise `WorkerLostError`.

    Peers in the middle of an all-reduce with this process see the
    connection close and fail at once. Idempotent.
    """
    with self._lock:
      if self._failure is None:
        self._failure = WorkerLostError(
            f"socket transport: the ring of {self._members.me} was "
            "closed; make a new one")
      self._close_locked()

  def _close_locked(self) -> None:
    if self._link is not None:
      self._link.close()
    self._link = None
    for pair in self._pairs.values():
      pair.close()


def _encode(views: list[tuple[int, np.ndarray]], into: np.ndarray,
            keep: list[tuple[int, np.ndarray]] | None) -> memoryview:
  """Rounds float32 ``views`` (offset, values) into the wire buffer
  ``into``, and widens the rounding back into ``keep`` (the same span)."""
  for at, v in views:
    encode(v, into[at:at + v.size])
  for at, v in keep or ():
    decode(into[at:at + v.size], v)
  return as_bytes(into)


def _land(received: np.ndarray, widened: np.ndarray | None,
          xs: list[tuple[int, np.ndarray]] | None,
          outs: list[tuple[int, np.ndarray]]) -> None:
  """A received block: ``outs = xs + received`` (`pieces.add`), or, with
  ``xs`` ``None``, ``outs = received``; widened first from a compressed
  wire (into ``widened`` for the sum)."""
  if xs is None:
    for at, o in outs:
      decode(received[at:at + o.size], o)
    return
  if widened is not None:
    received = decode(received, widened[:received.size])
  pieces.add(received, xs, outs)
