"""Gradient accumulation: k micro-batches per update, one all-reduce.

A step takes a per-replica batch of ``k * b`` examples, runs forward and
backward on each of its k micro-batches of ``b`` in turn (the memory of a
``b`` batch), sums their gradients in float32 on the replica, and applies
their mean once: one all-reduce per ``k * b`` examples instead of k. The
update is the one a ``k * b`` batch gives, exactly up to float32 rounding.

Keras's own ``gradient_accumulation_steps`` cannot do this under a
tf.distribute strategy on CPU: it all-reduces inside a ``tf.cond``, where a
``merge_call`` is not allowed. Here no synchronization is conditional.

`accumulating_step` is a `tfdist.Runner` step (with k = 1, the plain step
`tfdist.supervised_step` builds on); `with_accumulation` does the same for
``fit``.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["accumulating_step", "scaled_loss", "with_accumulation"]


def scaled_loss(per_example_loss: tf.Tensor, global_batch_size: int,
                regularization_losses: Sequence[tf.Tensor] = ()) -> tf.Tensor:
  """A replica's share of the global mean loss, ready for gradients.

  Summing it over replicas gives the mean over the global batch.
  """
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  loss = tf.nn.compute_average_loss(per_example_loss,
                                    global_batch_size=global_batch_size)
  if regularization_losses:
    loss += tf.add_n(list(regularization_losses)) / replicas
  return loss


def _check_steps(steps: Any, source: str) -> None:
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
    raise ConfigError(field="accumulation_steps", value=steps, source=source,
                      expected="a positive integer")


def _micro_batches(batch: Any, k: int) -> list[Any]:
  """``batch`` split into k equal parts along the first axis."""
  if k == 1:
    return [batch]
  parts = [tf.split(t, k) for t in tf.nest.flatten(batch)]
  return [tf.nest.pack_sequence_as(batch, [p[i] for p in parts])
          for i in range(k)]


def _sum_into(total: list[Any] | None, grads: Sequence[Any],
              k: int) -> list[Any]:
  """``total + grads``, summed in float32 when there are several to sum."""
  if k == 1:
    return list(grads)
  # float32 sums: a float16 model's gradients are widened before adding.
  grads = [None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
           for g in grads]
  if total is None:
    return grads
  return [a if g is None else (g if a is None else a + g)
          for a, g in zip(total, grads)]


def _apply(optimizer, total: Sequence[Any], variables: Sequence[Any]) -> None:
  """Applies the summed gradients, cast back to each variable's dtype."""
  optimizer.apply_gradients(zip(
      [None if g is None else tf.cast(g, v.dtype)
       for g, v in zip(total, variables)], variables))


def accumulating_step(model, optimizer, loss_fn, *, global_batch_size: int,
                      accumulation_steps: int, metrics: Sequence[Any] = ()
                      ) -> Callable[[Any], Mapping[str, tf.Tensor]]:
  """A `tfdist.Runner` step over ``accumulation_steps`` micro-batches.

  Args:
    model: a Keras model built under the strategy's scope.
    optimizer: a Keras optimizer (optionally with
      `tfdist.perf.with_gradient_options`).
    loss_fn: ``loss_fn(y, y_pred)`` of per-example losses.
    global_batch_size: examples per update over all replicas, i.e.
      ``accumulation_steps`` micro-batches on every replica.
    accumulation_steps: micro-batches per update; the per-replica batch must
      divide by it.
    metrics: Keras metrics updated with each micro-batch.

  Returns:
    A step returning ``{"loss": ...}`` scaled for summing over replicas, as
    `tfdist.supervised_step` does.
  """
  _check_steps(accumulation_steps, "accumulating_step")
  k = accumulation_steps

  def step(batch):
    total, loss_sum = None, None
    variables = model.trainable_variables
    for x, y in _micro_batches(batch, k):
      with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = scaled_loss(loss_fn(y, y_pred), global_batch_size,
                           [l / k for l in model.losses] if k > 1
                           else model.losses)
      total = _sum_into(total, tape.gradient(loss, variables), k)
      loss_sum = loss if loss_sum is None else loss_sum + loss
      for metric in metrics:
        metric.update_state(y, y_pred)
    _apply(optimizer, total, variables)
    return {"loss": loss_sum}
  return step


def with_accumulation(model, accumulation_steps: int):
  """Makes ``model.fit`` accumulate ``accumulation_steps`` micro-batches.

  Each batch ``fit`` draws is split into the micro-batches; the loss is the
  compiled loss of each, the update uses the mean of their gradients.
  Batch the data ``accumulation_steps`` times larger than the micro-batch.

  Args:
    model: a compiled or uncompiled Keras 3 model (TensorFlow backend).
    accumulation_steps: micro-batches per update.

  Returns:
    The same model, its ``train_step`` replaced on the instance.
  """
  _check_steps(accumulation_steps, "with_accumulation")
  # pylint: disable=g-import-not-at-top
  from keras.src.losses import loss as loss_module
  from keras.src.trainers.data_adapters import data_adapter_utils
  # pylint: enable=g-import-not-at-top
  unpack = data_adapter_utils.unpack_x_y_sample_weight
  unscale = loss_module.unscale_loss_for_distribution
  k = accumulation_steps

  def train_step(self, data):
    total = None
    variables = self.trainable_variables
    logs = {}
    for micro in _micro_batches(data, k):
      x, y, sample_weight = unpack(micro)
      with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        # As Keras's own TensorFlow train_step (keras 3.15).
        # pylint: disable=protected-access
        loss = self._compute_loss(x=x, y=y, y_pred=y_pred,
                                  sample_weight=sample_weight, training=True)
        self._loss_tracker.update_state(
            unscale(loss), sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        # pylint: enable=protected-access
        loss = self.optimizer.scale_loss(loss) / k
      total = _sum_into(total, tape.gradient(loss, variables), k)
      logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    _apply(self.optimizer, total, variables)
    return logs

  object.__setattr__(model, "train_step", types.MethodType(train_step, model))
  return model
