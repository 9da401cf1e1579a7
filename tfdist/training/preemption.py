"""Stop signals: every worker saves at one step and exits with the signal's code.

TensorFlow catches SIGTERM in multi-worker processes and carries on training,
and knows nothing of SLURM's USR1. `PreemptionWatcher` installs Python handlers
for `tfdist.errors.STOP_SIGNALS` (replacing TensorFlow's) and only records that
a signal came. At each step boundary the loop asks
`PreemptionWatcher.should_stop`: under MultiWorkerMirroredStrategy the workers
agree with one all-reduce of their flags (a few ms, so about once per
``check_seconds``, the interval derived from one summed figure so it is the
same on every worker); elsewhere the local flag decides.

The loop then saves at that step and raises `tfdist.PreemptedError`: 42 for
SIGTERM and SIGUSR1, 130 for SIGINT, 42 winning when workers got different
signals. After a signal, a SIGINT ends the process at once; a second SIGTERM or
SIGUSR1 is only logged. A signal that came after the last agreement is raised
when the watcher is left. With ``TFDIST_SLURM_REQUEUE=1`` the chief requeues
its SLURM job after a save for SIGTERM or SIGUSR1 (`tfdist.cluster.requeue`).
Used by ``tfdist.fit`` and `tfdist.Runner`; docs/fault_tolerance.md shows a
custom loop.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Sequence

from absl import logging
import tensorflow as tf

from tfdist.cluster import requeue as requeue_lib
from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import PREEMPTION_SIGNALS
from tfdist.errors import STOP_SIGNALS
from tfdist.errors import PreemptedError
from tfdist.strategy import introspect
from tfdist.strategy import startup

__all__ = ["PreemptionWatcher", "PREEMPTION_SIGNALS", "PREEMPTED_EXIT_CODE",
           "STOP_SIGNALS"]

#: How often, in training time, MultiWorkerMirrored workers agree by default.
DEFAULT_CHECK_SECONDS = 1.0
#: The most steps between two agreements, however fast the steps.
MAX_CHECK_INTERVAL = 1000
# The exit codes in the order they win an agreement: preemption first.
_CODES = tuple(sorted(set(STOP_SIGNALS.values())))


def next_interval(previous: int, seconds_per_call: float | None,
                  check_seconds: float) -> int:
  """Calls to the next agreement: about ``check_seconds`` of training.

  Args:
    previous: the calls between the last two agreements.
    seconds_per_call: the mean time per call since the last agreement;
      ``None`` or 0 when not measured yet (the first agreement).
    check_seconds: the wanted time between agreements.

  Returns:
    At least 1, at most twice ``previous`` and at most `MAX_CHECK_INTERVAL`.
  """
  if not seconds_per_call or seconds_per_call <= 0:
    return 1
  return max(1, min(MAX_CHECK_INTERVAL, 2 * previous,
                    int(check_seconds / seconds_per_call)))


class PreemptionWatcher:
  """Records preemption signals; agrees across workers when to stop.

  Use it as a context manager around training: handlers are installed on
  entry (main thread only) and the previous ones restored on exit. Every
  worker must call `should_stop` at the same steps.
  """

  def __init__(self, strategy: tf.distribute.Strategy, *,
               signals: Sequence[int] = tuple(STOP_SIGNALS),
               check_seconds: float = DEFAULT_CHECK_SECONDS,
               requeue: requeue_lib.RequeueOptions | None = None):
    """Creates the watcher.

    Args:
      strategy: the strategy training runs under.
      signals: the signals that mean "save and stop", among `STOP_SIGNALS`.
      check_seconds: across workers, agree about this often (in training
        time); a signal is acted on within about this long plus one step.
        0 agrees at every step.
      requeue: whether the chief requeues its SLURM job after a preempted
        save (`tfdist.cluster.requeue`); read from ``TFDIST_SLURM_REQUEUE``
        and ``TFDIST_SLURM_MAX_REQUEUES`` by default.

    Raises:
      ConfigError: those variables are malformed (before training starts).
    """
    self._requeue = (requeue_lib.options_from_environ() if requeue is None
                     else requeue)
    self._strategy = strategy
    self._signals = tuple(signals)
    self._received: int | None = None
    self._stop = False
    self._code = PREEMPTED_EXIT_CODE
    self._previous: dict[int, object] = {}
    self._agree_fn = None
    self._collective = isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
            introspect.num_workers(strategy) > 1)
    self._check_seconds = check_seconds
    self._interval = 1  # Calls between the last two agreements.
    self._until_check = 1  # Calls to the next agreement; the first is next.
    self._since_check = 0
    self._last_check: float | None = None  # None: no agreement yet.

  def __enter__(self) -> "PreemptionWatcher":
    if threading.current_thread() is threading.main_thread():
      for signum in self._signals:
        self._previous[signum] = signal.signal(signum, self._on_signal)
    return self

  def __exit__(self, exc_type=None, *exc) -> None:
    if self._stop:
      # Stopping: the process is on its way out with the signal's code. A
      # second SIGTERM/SIGUSR1 (srun, a launcher stopping the other tasks)
      # is only logged, so it cannot turn that exit into "killed by SIGTERM".
      return
    for signum, previous in self._previous.items():
      if isinstance(previous, startup.StopBeforeTraining):
        previous = previous.previous  # What was there before tfdist.
      # A handler TensorFlow set in C++ reads as None: fall back to the
      # default action, which at least ends the process.
      signal.signal(signum, previous if previous is not None
                    else signal.SIG_DFL)
    self._previous.clear()
    if self._received is not None and exc_type is None:
      # Training ended before the workers agreed on the signal: its
      # contract still holds, with nothing more saved.
      name = signal.Signals(self._received).name
      error = PreemptedError(
          step=None, signal_name=name,
          where="it came after the last agreed step; training had finished "
                "and its own saves stand")
      logging.warning("tfdist: %s", error)
      raise error

  @property
  def signal_name(self) -> str:
    """The signal that stopped training (a peer's, when it was not ours)."""
    if self._received:
      return signal.Signals(self._received).name
    return "a peer's signal"

  def _on_signal(self, signum, frame) -> None:
    del frame
    if self._received is None:
      logging.warning("tfdist: %s received: saving at the next step, then "
                      "exiting with code %d", signal.Signals(signum).name,
                      STOP_SIGNALS.get(signum, PREEMPTED_EXIT_CODE))
      self._received = signum
    elif STOP_SIGNALS.get(signum) == PREEMPTED_EXIT_CODE:
      self._received = signum  # Preemption wins over an earlier SIGINT.
    if signal.SIGINT in self._signals:
      # From now on Ctrl-C ends the process at once, killed by SIGINT (130
      # in a shell), without waiting for the save.
      signal.signal(signal.SIGINT, signal.SIG_DFL)

  def should_stop(self) -> bool:
    """Call once per step: True once any worker got a signal.

    Every worker gets the same answer at the same step (under
    MultiWorkerMirroredStrategy it comes from an agreement every few calls).
    """
    if self._stop:
      return True
    if not self._collective:
      if self._received is not None:
        self._stop = True
        self._code = STOP_SIGNALS.get(self._received, PREEMPTED_EXIT_CODE)
      return self._stop
    self._since_check += 1
    self._until_check -= 1
    if self._until_check > 0:
      return False
    now = time.monotonic()
    per_call = (None if self._last_check is None
                else (now - self._last_check) / self._since_check)
    flags = [0.0] * len(_CODES)
    if self._received is not None:
      flags[_CODES.index(STOP_SIGNALS.get(self._received,
                                          PREEMPTED_EXIT_CODE))] = 1.0
    *counts, seconds = self._all_workers_sum([*flags, per_call or 0.0])
    agreed = [code for code, n in zip(_CODES, counts) if n > 0]
    if agreed:
      self._stop, self._code = True, agreed[0]
    # The same summed figure on every worker gives the same interval (each
    # replica added its worker's time per call; 0 before any was measured).
    mean = seconds / self._strategy.num_replicas_in_sync
    self._interval = next_interval(self._interval, mean if per_call is not None
                                   else None, self._check_seconds)
    self._until_check = self._interval
    self._since_check, self._last_check = 0, now
    return self._stop

  def exit(self, step: int, directory: str | None = None) -> None:
    """Raises `PreemptedError` for ``step`` (call it after saving).

    The line it logs names ``directory``, where the chief saved, when given:
    ``tfdist launch`` says it once the tasks ended.

    On the chief, after a preemption (42), first requeues the SLURM job when
    in-process requeue is on; that never raises nor hangs.
    """
    where = f" in {directory}" if directory else ""
    logging.warning("tfdist: checkpoint saved at step %d%s; exiting with code "
                    "%d", step, where, self._code)
    if (self._code == PREEMPTED_EXIT_CODE and self._requeue.enabled
        and introspect.is_chief(self._strategy)):
      line = requeue_lib.requeue_after_save(self._requeue)
      if line:
        logging.warning("tfdist: %s", line)
    raise PreemptedError(step=int(step), signal_name=self.signal_name,
                         code=self._code, directory=directory)

  def _all_workers_sum(self, values: list[float]) -> list[float]:
    """Sums ``values`` over the workers in one all-reduce."""
    strategy = self._strategy
    if self._agree_fn is None:
      @tf.function
      def agree(value):
        per_replica = strategy.run(tf.identity, args=(value,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                               axis=None)
      self._agree_fn = agree
    total = self._agree_fn(tf.constant(values, tf.float64)).numpy()
    return [float(v) for v in total]
