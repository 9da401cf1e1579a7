"""`Courier`: a ring's thread that runs queued work in the order given
(`SocketRing.courier`; the gradient buckets, `tfdist.strategy.buckets`)."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any, Callable

from tfdist.errors import StartupTimeoutError

__all__ = ["Courier"]


class Courier:
  """A thread that runs work one item after another, in the order queued.

  Args:
    failure: the ring's first error (`SocketRing.failure`), if any: work
      that fails reports it rather than its own, which is often only its
      echo.
  """

  def __init__(self, failure: Callable[[], BaseException | None]):
    self._failure = failure
    self._inbox: "queue.Queue[tuple[int, Callable]]" = queue.Queue()
    self._done: dict[int, Any] = {}
    self._cv = threading.Condition()
    self._tickets = itertools.count()
    threading.Thread(target=self._run, daemon=True,
                     name="tfdist-buckets").start()

  def start(self, work: Callable[[], Any]) -> int:
    """Queues ``work``; returns the ticket `finish` takes."""
    ticket = next(self._tickets)
    self._inbox.put((ticket, work))
    return ticket

  def finish(self, ticket: int, bound_s: float) -> Any:
    """What ``ticket``'s work returned, or the error it raised."""
    deadline = time.monotonic() + bound_s
    with self._cv:
      while ticket not in self._done:
        left = deadline - time.monotonic()
        if left <= 0:
          raise StartupTimeoutError(
              f"socket transport: a gradient bucket was not summed within "
              f"{bound_s:.0f} s")
        self._cv.wait(left)
      result = self._done.pop(ticket)
    if isinstance(result, BaseException):
      raise result
    return result

  def _run(self) -> None:
    while True:
      ticket, work = self._inbox.get()
      try:
        result = work()
      except BaseException as e:  # pylint: disable=broad-except
        result = self._failure() or e
      with self._cv:
        self._done[ticket] = result
        self._cv.notify_all()
