"""Per-replica training steps for `tfdist.Runner` and custom loops.

A step takes one per-replica batch and returns a dict of scalars that the
Runner sums over replicas. `scaled_loss` scales a per-example loss so that
sum is the global mean; `supervised_step` is the standard ``(x, y)`` step.

Both are `tfdist.perf.accumulation`'s arithmetic with one micro-batch:
training composes perf, and `tfdist.perf.accumulating_step` is the same step
over k micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.perf import accumulation
from tfdist.perf.accumulation import scaled_loss

__all__ = ["StepFn", "scaled_loss", "supervised_step"]

#: A per-replica step: one batch in, a dict of scalars (or nothing) out.
StepFn = Callable[[Any], Mapping[str, tf.Tensor] | None]


def supervised_step(model, optimizer, loss_fn, *, global_batch_size: int,
                    metrics: Sequence[Any] = ()) -> StepFn:
  """A standard per-replica step for ``(x, y)`` batches.

  Args:
    model: a built Keras model, created under the strategy's scope.
    optimizer: a Keras optimizer created under the scope; built here if it
      is not yet (its variables cannot be created inside a replica step).
    loss_fn: ``loss_fn(y, y_pred)`` returning per-example losses (e.g. a Keras
      loss with ``reduction=None``).
    global_batch_size: the batch over all replicas.
    metrics: Keras metrics updated with ``(y, y_pred)``.

  Returns:
    A step returning ``{"loss": ...}`` scaled for summing over replicas.

  Raises:
    ConfigError: the model has no variables yet.
  """
  if not optimizer.built:
    if not model.trainable_variables:
      raise ConfigError(
          field="model", value=getattr(model, "name", model),
          source="supervised_step", expected="a built model",
          hint="Give the model a keras.Input or call model.build(shape) "
               "under strategy.scope()")
    with model.distribute_strategy.scope():
      optimizer.build(model.trainable_variables)
  return accumulation.accumulating_step(
      model, optimizer, loss_fn, global_batch_size=global_batch_size,
      accumulation_steps=1, metrics=metrics)
