"""Training steps, as the flight recorder sees them (`tfdist._flight`).

TensorFlow's collectives run inside a step's `tf.function`, where no Python
sees them: each step is recorded from Keras's batch hooks as one
``gradients`` collective (the gradients' and the metrics' all-reduce), its
step the optimizer's count. `FlightSteps` is the Keras callback; `peers`
names a strategy's collectives for `Runner` too.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

from tfdist import _flight
from tfdist.strategy import introspect

__all__ = ["FlightSteps", "peers", "gradient_bytes"]


def peers(strategy: Any) -> str:
  """Who a step's collectives wait for, e.g. ``worker:0-2``."""
  _, _, cluster = introspect.task_of(strategy)
  jobs = [f"{job}:0-{len(tasks) - 1}" if len(tasks) > 1 else f"{job}:0"
          for job, tasks in sorted(cluster.items())
          if job in ("chief", "worker")]
  return ", ".join(jobs) or "this process"


def gradient_bytes(variables: Any) -> int:
  """Bytes of the gradients of ``variables``."""
  return sum(math.prod(v.shape) * np.dtype(
      keras.backend.standardize_dtype(v.dtype)).itemsize for v in variables)


class FlightSteps(keras.callbacks.Callback):
  """Records each training step of ``fit``.

  Put it first: its batch end comes before the user's callbacks, which are
  no collective. A batch's end closes every step begun up to it: Keras
  calls batch begin with the first step of an execution and batch end with
  its last (``steps_per_execution``), and its asynchronous batch ends may
  come after the next batch began.
  """

  async_safe = True  # Keras: this callback may run off the main thread.

  def __init__(self):
    super().__init__()
    self._done: int | None = None  # Steps applied before this fit's next.
    self._epoch_base = 0
    self._open: dict[int, list] = {}  # Batch -> its record, until it ends.
    self._about: dict[str, Any] = {}

  def on_train_batch_begin(self, batch, logs=None):
    if self._done is None:  # After every on_train_begin: restores are done.
      model = self.model
      self._done = self._epoch_base = int(keras.ops.convert_to_numpy(
          model.optimizer.iterations))
      self._about = dict(
          transport="tensorflow", peers=peers(model.distribute_strategy),
          nbytes=gradient_bytes(model.trainable_variables))
      _flight.watch()
    _flight.begin_step(self._epoch_base + batch + 1)
    self._open[batch] = _flight.enter("gradients", **self._about)

  def on_train_batch_end(self, batch, logs=None):
    for begun in [b for b in self._open if b <= batch]:
      _flight.leave(self._open.pop(begun))
    self._done = self._epoch_base + batch + 1

  def on_epoch_begin(self, epoch, logs=None):
    self._open.clear()
    if self._done is not None:
      self._epoch_base = self._done

  def on_test_batch_end(self, batch, logs=None):
    _flight.progress()

  def on_predict_batch_end(self, batch, logs=None):
    _flight.progress()
