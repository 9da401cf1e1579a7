"""Moving one ring step's blocks both ways over a pair of sockets.

A `Link` holds a process's two connections, to the right neighbour (sends)
and from the left one (receives). A small step (under `THREADED_BYTES`
received) is moved by one thread with non-blocking sockets: it writes and
reads whatever the kernel takes or has, runs each received block's callback
as soon as the block is in, and waits in ``poll`` only when neither
direction moves. No thread hand-offs (the lowest latency), and no deadlock
when both sides send first. A large step is moved by two threads, one
sending (started at the first such step and kept: starting one per step
cost about 90 us) and the caller receiving (and adding), each in blocking
calls that release the GIL: the kernel's copies in and out of the two
sockets and the arithmetic can run at once, on two cores. So only where the
process has two cores of its own (`threaded_bytes`): on one, two threads
took 1.15-1.5x as long as one (the bed's hosts, and 2 workers on 2 cores;
docs/benchmarks.md, "bf16 at 10 Gbit/s"). The bench times ``ring`` (as
shipped) beside ``ring_polled`` (every step in one thread) in every run.

Example::

  link = Link(left=left, right=right, left_rank=2, right_rank=1,
              timeout_s=300)
  link.exchange([lambda: b"abc"], [(buffer, on_full, -1)])
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time
from typing import Any, Callable, Sequence

from tfdist import _process

__all__ = ["PeerLost", "Link", "THREADED_BYTES", "threaded_bytes"]

_POLL_S = 0.5  # Longest wait in poll() between checks of the deadlines.
#: Steps receiving at least this many bytes are moved by two threads.
THREADED_BYTES = 1 << 20


def threaded_bytes() -> int:
  """`THREADED_BYTES` where this process has two cores or more of its own,
  else more than any step: its share is ``TF_NUM_INTRAOP_THREADS`` where
  set above 0 (`tfdist launch` gives each task of a node its share), else
  the cores it may run on."""
  share = os.environ.get(_process.INTRA_OP, "")
  cores = (share.isdigit() and int(share)) or _process.cores()
  return THREADED_BYTES if cores >= 2 else 1 << 62


#: What a step sends: callables returning the next buffer, called when the
#: previous one is written (so encoding happens just in time).
Sends = Sequence[Callable[[], Any]]
#: What a step receives: (buffer to fill, callback or None, after), in order.
Recvs = Sequence[tuple[Any, Callable[[], None] | None, int]]


class PeerLost(Exception):
  """A peer failed; ``rank`` says which (internal, becomes WorkerLostError)."""

  def __init__(self, rank: int, what: str):
    super().__init__(what)
    self.rank = rank
    self.what = what


class Link:
  """A process's two ring connections, ready for `exchange`.

  Args:
    left: the connected socket from the left neighbour.
    right: the connected socket to the right neighbour.
    left_rank: the left neighbour's rank, named when it fails.
    right_rank: the right neighbour's rank, named when it fails.
    timeout_s: a direction that moves nothing for this long has lost its
      peer.
    seal: what each step's sends and receives become before they move
      (e.g. `tfdist.ring.auth.Sealer.seal`, adding tags); as given
      when ``None``.
    threaded_bytes: steps receiving at least this many bytes are moved by
      a sending and a receiving thread; smaller ones by one polling thread.
  """

  def __init__(self, *, left: socket.socket, right: socket.socket,
               left_rank: int, right_rank: int, timeout_s: float,
               seal: Callable[[Sends, Recvs], tuple[Sends, Recvs]] | None
               = None, threaded_bytes: int = THREADED_BYTES):
    for s in (left, right):
      s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      s.setblocking(False)  # exchange() waits in poll(), with a deadline.
    self._left, self._right = left, right
    self._left_rank, self._right_rank = left_rank, right_rank
    self._timeout_s = timeout_s
    self._seal = seal
    self._threaded_bytes = threaded_bytes
    self._poll = select.poll()
    self._sender: _Sender | None = None  # Made at the first large step.

  def exchange(self, sends: Sends, recvs: Recvs) -> None:
    """One step: ``sends`` to the right neighbour, ``recvs`` from the left.

    Args:
      sends: callables returning the next buffer to send, called when the
        previous one is written (so encoding happens just in time).
      recvs: (buffer to fill, callback, after) in order; the callback runs
        once the buffer is full and ``sends[after]`` is written (so it may
        overwrite what that send read); ``after`` -1 waits for nothing.

    Raises:
      PeerLost: a peer closed, failed, or did not move for ``timeout_s``
        (or ``seal``'s check failed).
    """
    if self._seal is not None:
      sends, recvs = self._seal(sends, recvs)
    if (sum(memoryview(b).nbytes for b, _, _ in recvs)
        >= self._threaded_bytes):
      self._exchange_threaded(sends, recvs)
    else:
      self._exchange_polled(sends, recvs)

  def _exchange_polled(self, sends: Sends, recvs: Recvs) -> None:
    """`exchange` in this thread, with non-blocking sockets."""
    right, left = self._right, self._left
    right_rank, left_rank = self._right_rank, self._left_rank
    si = ri = soff = roff = 0
    sview = rview = None
    waiting: list[tuple[int, Callable[[], None]]] = []  # (after, callback)
    last_send = last_recv = time.monotonic()
    while si < len(sends) or ri < len(recvs) or waiting:
      moved = False
      if si < len(sends):
        if sview is None:
          sview, soff = memoryview(sends[si]()).cast("B"), 0
        if soff < len(sview):
          try:
            soff += right.send(sview[soff:])
            moved = True
            last_send = time.monotonic()
          except BlockingIOError:
            pass
          except OSError as e:
            raise PeerLost(right_rank, f"send failed: {e}") from None
        if soff >= len(sview):
          si, sview = si + 1, None
          moved = True
          while waiting and waiting[0][0] < si:
            waiting.pop(0)[1]()
      if ri < len(recvs):
        if rview is None:
          rview, roff = memoryview(recvs[ri][0]).cast("B"), 0
        if roff < len(rview):
          try:
            k = left.recv_into(rview[roff:])
          except BlockingIOError:
            k = -1
          except OSError as e:
            raise PeerLost(left_rank, f"receive failed: {e}") from None
          if k == 0:
            raise PeerLost(left_rank, "it closed the connection")
          if k > 0:
            roff += k
            moved = True
            last_recv = time.monotonic()
        if roff >= len(rview):
          _, done, after = recvs[ri]
          ri, rview = ri + 1, None
          if done is not None:
            if after < si and not waiting:
              done()
            else:
              waiting.append((after, done))
          moved = True
      if moved:
        continue
      # Nothing moved: wait for either socket, a bounded time.
      poll = self._poll
      for sock in (right, left):
        try:
          poll.unregister(sock)
        except KeyError:
          pass
      if si < len(sends):
        poll.register(right, select.POLLOUT)
      if ri < len(recvs):
        poll.register(left, select.POLLIN)
      if poll.poll(_POLL_S * 1000):
        continue
      now = time.monotonic()
      if ri < len(recvs) and now - last_recv > self._timeout_s:
        raise PeerLost(left_rank, f"no data for {self._timeout_s:.0f} s "
                       "(timeout_s)")
      if si < len(sends) and now - last_send > self._timeout_s:
        raise PeerLost(right_rank, f"it accepted no data for "
                       f"{self._timeout_s:.0f} s (timeout_s)")

  def _exchange_threaded(self, sends: Sends, recvs: Recvs) -> None:
    """`exchange` with a sending thread; this thread receives and adds.

    Both threads wait in socket calls of at most ``_POLL_S`` and check
    each other's failure in between, so one that fails stops the other
    within that time. A callback whose ``after`` send is not written yet
    waits, in order, while the receiving goes on (as in the polled loop).
    """
    right, left = self._right, self._left
    sent = [0]  # sends written so far
    failure: list[PeerLost] = []
    finished = [False]  # the sending is over, written or failed
    progress = threading.Condition()
    right.settimeout(_POLL_S)
    left.settimeout(_POLL_S)

    def send_all():
      try:
        for produce in sends:
          view = memoryview(produce()).cast("B")
          offset, last = 0, time.monotonic()
          while offset < len(view):
            if failure:
              return
            try:
              offset += right.send(view[offset:])
              last = time.monotonic()
            except TimeoutError:
              if time.monotonic() - last > self._timeout_s:
                raise PeerLost(self._right_rank, "it accepted no data for "
                               f"{self._timeout_s:.0f} s (timeout_s)")
            except OSError as e:
              raise PeerLost(self._right_rank, f"send failed: {e}") from None
          with progress:
            sent[0] += 1
            progress.notify()
      except PeerLost as e:
        failure.append(e)
      except BaseException as e:  # An encoder failed: the step is torn.
        failure.append(PeerLost(self._right_rank, f"send failed: {e!r}"))
      with progress:
        finished[0] = True
        progress.notify()

    if self._sender is None:
      self._sender = _Sender()
    self._sender.submit(send_all)
    try:
      self._receive_all(recvs, sent, failure, progress)
    except BaseException as e:
      failure.append(e if isinstance(e, PeerLost) else PeerLost(
          self._left_rank, f"the step was interrupted: {e!r}"))
      raise  # The sender stops within _POLL_S; the ring closes its sockets.
    with progress:  # The sender ends by itself or by a failure it meets.
      while not finished[0] and not failure:
        progress.wait(_POLL_S)
    if failure:
      raise failure[0]
    right.setblocking(False)
    left.setblocking(False)

  def _receive_all(self, recvs: Recvs, sent: list[int],
                   failure: list[PeerLost],
                   progress: threading.Condition) -> None:
    """The receiving half of `_exchange_threaded`."""
    left = self._left
    waiting: list[tuple[int, Callable[[], None]]] = []
    for buffer, done, after in recvs:
      view = memoryview(buffer).cast("B")
      offset, last = 0, time.monotonic()
      while offset < len(view):
        if failure:
          raise failure[0]
        try:
          k = left.recv_into(view[offset:])
        except TimeoutError:
          if time.monotonic() - last > self._timeout_s:
            raise PeerLost(self._left_rank, f"no data for "
                           f"{self._timeout_s:.0f} s (timeout_s)") from None
          continue
        except OSError as e:
          raise PeerLost(self._left_rank, f"receive failed: {e}") from None
        if k == 0:
          raise PeerLost(self._left_rank, "it closed the connection")
        offset, last = offset + k, time.monotonic()
      if done is not None:
        waiting.append((after, done))
      while waiting and waiting[0][0] < sent[0]:
        waiting.pop(0)[1]()
    # What waits on a send runs once it is written; the sender notifies
    # `progress` after each send and when it ends (failed or not).
    deadline = time.monotonic() + self._timeout_s
    while waiting:
      with progress:
        while not failure and waiting[0][0] >= sent[0]:
          if time.monotonic() > deadline:
            raise PeerLost(self._right_rank, "it accepted no data for "
                           f"{self._timeout_s:.0f} s (timeout_s)")
          progress.wait(_POLL_S)
      if failure:
        raise failure[0]
      waiting.pop(0)[1]()

  def close(self) -> None:
    """Closes both connections; peers mid-call see them close at once."""
    for s in (self._left, self._right):
      try:
        s.close()
      except OSError:
        pass
    if self._sender is not None:
      self._sender.close()


class _Sender:
  """The sending thread of large steps, kept from step to step.

  Starting and joining a thread costs about 90 us on the 2-vCPU machines
  the bench runs on, and every large step of every all-reduce needed one
  (two per all-reduce with 2 workers, ``2 (n - 1)`` with n). Jobs run one
  at a time, in order; `close` ends the thread once its job is done.
  """

  def __init__(self):
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=self._run, name="tfdist-ring-send",
                     daemon=True).start()

  def _run(self) -> None:
    while True:
      job = self._jobs.get()  # Idle between steps; `close` wakes it.
      if job is None:
        return
      job()

  def submit(self, job: Callable[[], None]) -> None:
    """Runs ``job`` in the thread (it reports its own end and errors)."""
    self._jobs.put(job)

  def close(self) -> None:
    self._jobs.put(None)
