"""Communication options for gradients, given to a Keras optimizer.

`with_gradient_options` attaches `GradientOptions`
(`tfdist.strategy.gradient_options`: compression, packing, transport) to a
Keras optimizer; the one hook tfdist installs on every Keras optimizer
(`tfdist.strategy.transport.keras_all_reduce`) reads them, so the optimizer
serves Keras ``fit``, `tfdist.fit`, `tfdist.Runner` and custom loops alike.
Gradient accumulation lives in `tfdist.perf.accumulation`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.strategy import factory
from tfdist.strategy import transport as transport_lib
from tfdist.strategy.gradient_options import GradientOptions
from tfdist.strategy.gradient_options import gradient_options_of

__all__ = ["GradientOptions", "with_gradient_options", "gradient_options_of"]


def with_gradient_options(optimizer: Any,
                          options: GradientOptions) -> Any:
  """Makes ``optimizer`` communicate its gradients as ``options`` say.

  Args:
    optimizer: a Keras 3 optimizer (TensorFlow backend); a
      ``LossScaleOptimizer`` passes them on to the optimizer it wraps.
    options: `GradientOptions`.

  Returns:
    The same optimizer, its options attached.

  Raises:
    ConfigError: an optimizer without the TensorFlow all-reduce hook, one
      given options twice, or ``transport="socket"`` under a strategy it
      cannot serve (checked here inside a strategy's scope, else at the
      first step).
  """
  if not hasattr(optimizer, "_all_reduce_sum_gradients"):
    raise ConfigError(
        field="optimizer", value=type(optimizer).__name__,
        source="with_gradient_options",
        expected="a Keras 3 optimizer on the TensorFlow backend")
  if gradient_options_of(optimizer) is not None:
    raise ConfigError(field="optimizer", value=type(optimizer).__name__,
                      source="with_gradient_options",
                      expected="an optimizer not given options before")
  if options.transport == "socket" and tf.distribute.has_strategy():
    transport_lib.check_strategy(tf.distribute.get_strategy())
  # The hook alone, for a strategy tfdist did not build.
  factory.install_keras_hooks(("strategy_transport",))
  options.attach(optimizer)
  inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer:
  if inner is not None and gradient_options_of(inner) is None:  # it sums
    options.attach(inner)  # through the optimizer it wraps.
  return optimizer
