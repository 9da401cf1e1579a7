"""Preemption: on SIGTERM or SIGUSR1, every worker saves at one step and exits.

TensorFlow catches SIGTERM in multi-worker processes and carries on training
(UPSTREAM.md, "Faults"), and SLURM's ``--signal=USR1@N`` is nothing it knows.
`PreemptionWatcher` installs Python handlers for both signals once the strategy
exists (replacing TensorFlow's), and only records that a signal came. At each
step boundary the training loop asks `PreemptionWatcher.should_stop`:

* under MultiWorkerMirroredStrategy the workers agree with one all-reduce of
  their flags, so they all see the signal at the same step, even when only one
  worker got it (SLURM signals every task; a cloud preemption may hit one
  node);
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
from typing import Sequence

from absl import logging
import tensorflow as tf

from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import PreemptedError

__all__ = ["PreemptionWatcher", "PREEMPTION_SIGNALS", "PREEMPTED_EXIT_CODE"]

#: The signals that mean "save and stop": SIGTERM (schedulers, Kubernetes,
#: ``kill``) and SIGUSR1 (SLURM's ``--signal=USR1@N``, forwarded by tfdist's
#: sbatch templates).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
  """Records preemption signals; agrees across workers when to stop.

  Use it as a context manager around training: handlers are installed on
  entry (main thread only) and the previous ones restored on exit. Every
  worker must call `should_stop` at the same steps.
  """

  def __init__(self, strategy: tf.distribute.Strategy, *,
               signals: Sequence[int] = PREEMPTION_SIGNALS):
    self._strategy = strategy
    self._signals = tuple(signals)
    self._received: int | None = None
    self._stop = False
    self._previous: dict[int, object] = {}
    self._agree_fn = None
    self._collective = isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
            _num_workers(strategy) > 1)

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
    """True once any worker got a signal; the same answer on every worker."""
    if not self._stop:
      local = 1 if self._received else 0
      self._stop = bool(self._all_workers_sum(local) if self._collective
                        else local)
    return self._stop

  def exit(self, step: int) -> None:
    """Raises `PreemptedError` for ``step`` (call it after saving)."""
    logging.warning("tfdist: checkpoint saved at step %d; exiting with code "
                    "%d", step, PREEMPTED_EXIT_CODE)
    raise PreemptedError(step=int(step), signal_name=self.signal_name)

  def _all_workers_sum(self, flag: int) -> int:
    strategy = self._strategy
    if self._agree_fn is None:
      @tf.function
      def agree(value):
        per_replica = strategy.run(tf.identity, args=(value,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                               axis=None)
      self._agree_fn = agree
    return int(self._agree_fn(tf.constant(float(flag), tf.float32)))


def _num_workers(strategy: tf.distribute.Strategy) -> int:
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None:
    return 1
  spec = resolver.cluster_spec().as_dict()
  return len(spec.get("chief", ())) + len(spec.get("worker", ()))
