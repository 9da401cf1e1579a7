"""Preemption: on SIGTERM or SIGUSR1, every worker saves at one step and exits.

TensorFlow catches SIGTERM in multi-worker processes and carries on training
(measured with TensorFlow 2.21: a worker sent SIGTERM mid-fit ignored it and
trained to the end), and SLURM's ``--signal=USR1@N`` is nothing it knows.
`PreemptionWatcher` installs Python handlers for both signals once the strategy
exists (replacing TensorFlow's), and only records that a signal came. At each
step boundary the training loop asks `PreemptionWatcher.should_stop`:

* under MultiWorkerMirroredStrategy the workers agree with one all-reduce of
  their flags, so they all see the signal at the same step, even when only one
  worker got it (SLURM signals every task; a cloud preemption may hit one
  node). That all-reduce costs a few milliseconds (6 ms measured on loopback,
  as much as a small model's step), so it runs about once per
  ``check_seconds`` (1 s), not every step: each agreement also averages the
  workers' step times, and every worker derives the same number of steps to
  the next agreement from that one figure;
* elsewhere (one process, or the ParameterServerStrategy coordinator) the
  local flag decides.

The loop then saves its checkpoint at that step and raises
`tfdist.PreemptedError`, a `SystemExit` with code 42
(`tfdist.errors.PREEMPTED_EXIT_CODE`): uncaught, the process ends with that
code and no traceback, and a restart resumes at the saved step.

``tfdist.fit`` (with ``backup_dir``) and `tfdist.Runner` (with a
``checkpoint_dir``) use it; a custom loop can too::

    with PreemptionWatcher(strategy) as watcher:
      for step in range(start, num_steps):
        train_step()
        if watcher.should_stop():
          manager.save(step + 1)
          watcher.exit(step + 1)
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Sequence

from absl import logging
import tensorflow as tf

from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import PREEMPTION_SIGNALS
from tfdist.errors import PreemptedError
from tfdist.strategy import introspect

__all__ = ["PreemptionWatcher", "PREEMPTION_SIGNALS", "PREEMPTED_EXIT_CODE"]

#: How often, in training time, MultiWorkerMirrored workers agree by default.
DEFAULT_CHECK_SECONDS = 1.0
#: The most steps between two agreements, however fast the steps.
MAX_CHECK_INTERVAL = 1000


class PreemptionWatcher:
  """Records preemption signals; agrees across workers when to stop.

  Use it as a context manager around training: handlers are installed on
  entry (main thread only) and the previous ones restored on exit. Every
  worker must call `should_stop` at the same steps.
  """

  def __init__(self, strategy: tf.distribute.Strategy, *,
               signals: Sequence[int] = PREEMPTION_SIGNALS,
               check_seconds: float = DEFAULT_CHECK_SECONDS):
    """Creates the watcher.

    Args:
      strategy: the strategy training runs under.
      signals: the signals that mean "save and stop".
      check_seconds: across workers, agree about this often (in training
        time); a signal is acted on within about this long plus one step.
        0 agrees at every step.
    """
    self._strategy = strategy
    self._signals = tuple(signals)
    self._received: int | None = None
    self._stop = False
    self._previous: dict[int, object] = {}
    self._agree_fn = None
    self._collective = isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
            introspect.num_workers(strategy) > 1)
    self._check_seconds = check_seconds
    self._until_check = 1  # Steps to the next agreement; the first is next.
    self._since_check = 0
    self._last_check = time.monotonic()

  def __enter__(self) -> "PreemptionWatcher":
    if threading.current_thread() is threading.main_thread():
      for signum in self._signals:
        self._previous[signum] = signal.signal(signum, self._on_signal)
    return self

  def __exit__(self, *exc) -> None:
    if self._stop:
      # Preempted: the process is on its way out with code 42. A second
      # signal (srun, a launcher stopping the other tasks) is only logged,
      # so it cannot turn that exit into "killed by SIGTERM".
      return
    for signum, previous in self._previous.items():
      # A handler TensorFlow set in C++ reads as None: fall back to the
      # default action, which at least ends the process.
      signal.signal(signum, previous if previous is not None
                    else signal.SIG_DFL)
    self._previous.clear()

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
                      PREEMPTED_EXIT_CODE)
    self._received = signum

  def should_stop(self) -> bool:
    """Call once per step: True once any worker got a signal.

    Every worker gets the same answer at the same step (under
    MultiWorkerMirroredStrategy it comes from an agreement every few steps).
    """
    if self._stop:
      return True
    if not self._collective:
      self._stop = bool(self._received)
      return self._stop
    self._since_check += 1
    self._until_check -= 1
    if self._until_check > 0:
      return False
    now = time.monotonic()
    step_seconds = (now - self._last_check) / self._since_check
    flags, seconds = self._all_workers_sum(1 if self._received else 0,
                                           step_seconds)
    self._stop = flags > 0
    # The same summed figure on every worker gives the same interval (each
    # replica added its worker's step time).
    mean = seconds / self._strategy.num_replicas_in_sync
    self._until_check = max(1, min(MAX_CHECK_INTERVAL, int(
        self._check_seconds / mean) if mean > 0 else 1))
    self._since_check, self._last_check = 0, now
    return self._stop

  def exit(self, step: int) -> None:
    """Raises `PreemptedError` for ``step`` (call it after saving)."""
    logging.warning("tfdist: checkpoint saved at step %d; exiting with code "
                    "%d", step, PREEMPTED_EXIT_CODE)
    raise PreemptedError(step=int(step), signal_name=self.signal_name)

  def _all_workers_sum(self, flag: int, seconds: float) -> tuple[int, float]:
    """Sums ``(flag, seconds)`` over the workers in one all-reduce."""
    strategy = self._strategy
    if self._agree_fn is None:
      @tf.function
      def agree(value):
        per_replica = strategy.run(tf.identity, args=(value,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                               axis=None)
      self._agree_fn = agree
    total = self._agree_fn(tf.constant([flag, seconds], tf.float64)).numpy()
    return int(round(total[0])), float(total[1])
