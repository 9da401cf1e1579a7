"""tfdist's own hooks on Keras: features, not corrections of upstream bugs.

`make_strategy` installs them with the corrections (`tfdist._compat.keras`,
which checks each hook's Keras code by its fingerprint the same way and
puts Keras's own back on `restore`).

| hook                      | Keras code wrapped                             | what it adds |
|---------------------------|------------------------------------------------|--------------|
| ``chief_aware_callbacks`` | ``TensorFlowTrainer.fit``, ``evaluate``, ``predict`` (their callbacks) | every worker wrote ModelCheckpoint, BackupAndRestore, TensorBoard and CSVLogger paths and drew the progress bar: the chief alone does (`tfdist.strategy.keras_callbacks`) |
| ``strategy_transport``    | ``TFOptimizer._all_reduce_sum_gradients``      | gradients take the transport `make_strategy` chose, or the optimizer's `GradientOptions` ask for (`transport.keras_all_reduce`) |
| ``transport_errors``      | ``TensorFlowTrainer.fit``, ``evaluate``, ``predict`` (their errors) | the ring's error (a lost peer, named) came out of ``tf.numpy_function`` as TensorFlow's ``UnknownError``: it is raised as itself; a collective's timeout or lost peer dumps the flight record first (`tfdist._flight`) |
| ``flight_steps``          | ``TensorFlowTrainer.fit`` (its callbacks)      | the flight recorder sees each training step (`tfdist.strategy.flight_steps`) |
"""

from __future__ import annotations

import functools
import inspect

from tfdist import _flight
from tfdist._compat import keras as keras_compat
from tfdist.errors import ConfigError
from tfdist.strategy import flight_steps
from tfdist.strategy import introspect
from tfdist.strategy import keras_callbacks
from tfdist.strategy import transport as transport_lib

__all__ = ["HOOKS"]

_TRAINER = "keras.src.backend.tensorflow.trainer"
_OPTIMIZER = "keras.src.backend.tensorflow.optimizer"


# One writer per path (`keras_callbacks.one_writer`); with ``verbose="auto"``
# only the chief draws the progress bar.
def _chief_aware(original):
  signature = inspect.signature(original)

  def wrapper(self, *args, **kwargs):
    strategy = self._distribute_strategy  # pylint: disable=protected-access
    if strategy is None:
      return original(self, *args, **kwargs)
    bound = signature.bind(self, *args, **kwargs)
    chief = introspect.is_chief(strategy)
    if not chief and bound.arguments.get("verbose", "auto") == "auto":
      bound.arguments["verbose"] = 0
    callbacks = bound.arguments.get("callbacks") or ()
    with keras_callbacks.one_writer(
        getattr(callbacks, "callbacks", callbacks),  # A CallbackList, too.
        chief=chief, refusal=ConfigError):
      return original(*bound.args, **bound.kwargs)
  return functools.wraps(original)(wrapper)


# When a run fails and a transport of the model's strategy has failed, the
# transport's error is raised instead of TensorFlow's UnknownError.
def _transport_errors(original):
  def wrapper(self, *args, **kwargs):
    try:
      return original(self, *args, **kwargs)
    except Exception as e:
      # A refusal's cause, which Keras's traceback filter dropped.
      e.__cause__ = e.__cause__ or getattr(e, keras_compat.CAUSE_ATTR, None)
      strategy = self._distribute_strategy  # pylint: disable=protected-access
      failure = (transport_lib.failure_of(strategy) if strategy is not None
                 else None)
      _flight.failed(failure or e)
      if failure is None or failure is e:
        raise
      raise failure.with_traceback(None) from e
  return functools.wraps(original)(wrapper)


# The flight recorder sees each step of `fit` from a callback put first
# (`flight_steps.FlightSteps`). A CallbackList of the user's is left as it is.
def _flight_steps(original):
  signature = inspect.signature(original)

  def wrapper(self, *args, **kwargs):
    bound = signature.bind(self, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks")
    if (self._distribute_strategy is not None  # pylint: disable=protected-access
        and _flight.recording()
        and isinstance(callbacks, (list, tuple, type(None)))):
      bound.arguments["callbacks"] = [flight_steps.FlightSteps(),
                                      *(callbacks or ())]
    return original(*bound.args, **bound.kwargs)
  return functools.wraps(original)(wrapper)


# Every Keras optimizer on TensorFlow sums its gradients here.
def _all_reduce_sum_gradients(original):
  def wrapper(self, grads_and_vars):
    grads_and_vars = list(grads_and_vars)
    summed = transport_lib.keras_all_reduce(self, grads_and_vars)
    return original(self, grads_and_vars) if summed is None else summed
  return functools.wraps(original)(wrapper)


_PUBLIC_RUNS = {f"{_TRAINER}:TensorFlowTrainer.{run}": None
                for run in ("fit", "evaluate", "predict")}  # Two hooks each.
_ALL_REDUCE = f"{_OPTIMIZER}:TFOptimizer._all_reduce_sum_gradients"

#: Every hook, in the order `make_strategy` installs them after the
#: corrections.
HOOKS: tuple[keras_compat.Fix, ...] = (
    keras_compat.Fix(
        "chief_aware_callbacks",
        {**_PUBLIC_RUNS, **keras_callbacks.VERIFIED},
        "tensorflow/tensorflow#38635 (every worker saves to one path)",
        install=dict.fromkeys(_PUBLIC_RUNS, _chief_aware)),
    keras_compat.Fix(
        "strategy_transport",
        {_ALL_REDUCE: None,
         # The caller, which hands it a list of every (gradient, variable).
         f"{_OPTIMIZER}:TFOptimizer._backend_update_step": "9be20bff479173f6"},
        "none: Keras sums gradients by the strategy's collectives only",
        install={_ALL_REDUCE: _all_reduce_sum_gradients}),
    keras_compat.Fix(
        "flight_steps", {f"{_TRAINER}:TensorFlowTrainer.fit": None},
        "none: TensorFlow's collectives say only that they timed out",
        install={f"{_TRAINER}:TensorFlowTrainer.fit": _flight_steps}),
    keras_compat.Fix(
        "transport_errors", _PUBLIC_RUNS,
        "none: an error raised in tf.numpy_function becomes UnknownError",
        install=dict.fromkeys(_PUBLIC_RUNS, _transport_errors)),
)
