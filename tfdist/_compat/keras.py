"""Narrow corrections that make Keras 3 `model.fit` work under tf.distribute.

Keras 3.15's TensorFlow trainer (``keras/src/backend/tensorflow/trainer.py``)
fails under some strategies for reasons that are each a few lines long. `apply`
replaces the affected functions with wrappers that take the corrected path only
in the failing situation and otherwise call the original, so training without a
strategy, or with a strategy that already works, runs Keras's own code.

| fix                           | upstream code (keras 3.15.1)                  | fails with            |
|-------------------------------|-----------------------------------------------|-----------------------|
| ``symbolic_build_reduce``     | ``TensorFlowTrainer._maybe_symbolic_build``   | MultiWorkerMirrored   |
| ``multi_worker_scalar_mean``  | ``reduce_per_replica``                        | MultiWorkerMirrored   |
| ``steps_per_execution``       | ``TensorFlowTrainer._make_function``          | Mirrored, spe > 1     |
| ``jit_compile_multi_replica`` | ``TensorFlowTrainer._make_function``          | (MultiWorker)Mirrored, ``jit_compile=True``: refused, see below |
| ``atomic_assign_add``         | ``Variable.assign_add`` / ``assign_sub``      | ParameterServer: lost increments |
| ``lazy_optimizer_build``      | ``BaseOptimizer.apply``                       | custom loops: optimizer built inside ``strategy.run`` on several replicas |

The corrections are applied only to the Keras versions they were verified on
(`TESTED_RANGE`) and never to a version at or past a fix's ``fixed_in``.
`tfdist.make_strategy` calls `apply`, so users need not.

One setting cannot be corrected: ``jit_compile=True`` on several replicas of
a (MultiWorker)MirroredStrategy (XLA cannot compile a step whose gradient
all-reduce and variable updates span the replicas). The first `fit`,
`evaluate` or `predict` refuses it with the error `apply` was given
(`tfdist.ConfigError` from `make_strategy`), rather than training without XLA
behind the user's back.

Example:
  >>> from tfdist._compat import keras as keras_compat
  >>> keras_compat.apply()
  ('symbolic_build_reduce', 'multi_worker_scalar_mean', ...)
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
from typing import Any, Callable, Iterable

from absl import logging

__all__ = [
    "FIXES",
    "Fix",
    "TESTED_RANGE",
    "apply",
    "applied_fixes",
    "keras_version",
    "needed_fixes",
    "restore",
]

#: Keras versions the corrections were verified on: ``low <= version < high``.
TESTED_RANGE: tuple[str, str] = ("3.15.0", "3.16.0")


@dataclasses.dataclass(frozen=True)
class Fix:
  """One correction of Keras's TensorFlow trainer.

  Attributes:
    name: short name, as `needed_fixes` and `apply` report it.
    target: the upstream function replaced, as ``module:qualname``.
    issue: the upstream issue that tracks the bug.
    fixed_in: the first Keras version that no longer needs the correction, or
      ``None`` while upstream is still broken.
  """
  name: str
  target: str
  issue: str
  fixed_in: str | None = None


_TRAINER = "keras.src.backend.tensorflow.trainer"

#: Every correction this module knows, in the order `apply` installs them.
FIXES: tuple[Fix, ...] = (
    Fix("symbolic_build_reduce",
        f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build",
        "keras-team/keras#20585"),
    Fix("multi_worker_scalar_mean", f"{_TRAINER}:reduce_per_replica",
        "tensorflow/tensorflow#72388"),
    Fix("steps_per_execution", f"{_TRAINER}:TensorFlowTrainer._make_function",
        "keras-team/keras#19246"),
    Fix("jit_compile_multi_replica",
        f"{_TRAINER}:TensorFlowTrainer._make_function",
        "XLA cannot compile a whole multi-replica step (none filed)"),
    Fix("atomic_assign_add",
        "keras.src.backend.common.variables:Variable.assign_add",
        "keras-team/keras#18668"),
    Fix("lazy_optimizer_build",
        "keras.src.optimizers.base_optimizer:BaseOptimizer.apply",
        "keras-team/keras#19308"),
)

_MARK = "__tfdist_keras_compat__"
_lock = threading.Lock()
# (owner, attribute) -> the upstream value it had before `apply`.
_originals: dict[tuple[Any, str], Any] = {}


def _keras_version_string() -> str:
  import keras  # pylint: disable=g-import-not-at-top
  return keras.__version__


def keras_version() -> tuple[int, ...]:
  """The installed Keras version as integers, e.g. ``(3, 15, 1)``."""
  import keras  # pylint: disable=g-import-not-at-top
  return _parse(keras.__version__)


def _parse(version: str) -> tuple[int, ...]:
  """``"3.16.0rc1"`` -> ``(3, 16, 0)``: the leading numeric release."""
  match = re.match(r"\d+(?:\.\d+)*", version.strip())
  return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def needed_fixes(version: str | None = None) -> tuple[Fix, ...]:
  """The corrections the given (by default the installed) Keras version needs.

  Args:
    version: a Keras version string; the installed one when omitted.

  Returns:
    The `Fix` records that apply: none outside `TESTED_RANGE`, and none whose
    ``fixed_in`` is at or below the version.
  """
  have = _parse(version) if version is not None else keras_version()
  low, high = (_parse(v) for v in TESTED_RANGE)
  if not low <= have < high:
    return ()
  return tuple(f for f in FIXES
               if f.fixed_in is None or have < _parse(f.fixed_in))


def applied_fixes() -> tuple[str, ...]:
  """Names of the corrections installed in this process."""
  with _lock:
    return tuple(sorted(_applied_names))


_applied_names: set[str] = set()


def _value_error(*, field: str, value: Any, expected: str, source: str,
                 hint: str) -> Exception:
  return ValueError(f"{field}: received {value!r}; expected {expected} "
                    f"({source}). {hint}")


# Builds the error for a setting Keras cannot run under a strategy. This floor
# imports nothing from tfdist, so the floor that owns tfdist's errors hands
# its class to `apply` (`tfdist.make_strategy` passes `ConfigError`).
_refusal: list[Callable[..., Exception]] = [_value_error]


def apply(names: Iterable[str] | None = None, *,
          refusal: Callable[..., Exception] | None = None) -> tuple[str, ...]:
  """Installs the corrections the installed Keras needs; idempotent.

  Safe to call many times and from several threads. Outside `TESTED_RANGE` it
  logs once and changes nothing.

  Args:
    names: install only these of the needed corrections (tests use it to show
      each upstream bug on its own); all of them by default.
    refusal: builds the error raised for a setting that cannot run, called
      with the keywords ``field``, ``value``, ``expected``, ``source`` and
      ``hint`` (`tfdist.ConfigError` fits); a ``ValueError`` by default.

  Returns:
    The names of the corrections in place after the call.
  """
  if refusal is not None:
    _refusal[0] = refusal
  fixes = needed_fixes()
  if not fixes:
    _warn_untested_once()
    return applied_fixes()
  wanted = set(names) if names is not None else {f.name for f in FIXES}
  with _lock:
    for fix in fixes:
      if fix.name in wanted:
        for owner, attr, make in _INSTALLS[fix.name]():
          _install(owner, attr, make)
        _applied_names.add(fix.name)
  return applied_fixes()


def restore() -> None:
  """Puts Keras's original functions back (for tests)."""
  with _lock:
    for (owner, attr), original in _originals.items():
      setattr(owner, attr, original)
    _originals.clear()
    _applied_names.clear()


@functools.lru_cache(maxsize=None)
def _warn_untested_once() -> None:
  import keras  # pylint: disable=g-import-not-at-top
  logging.warning(
      "tfdist: Keras %s is outside the versions its Keras corrections were "
      "tested on (%s <= version < %s); none applied. Keras fit may fail under "
      "MultiWorkerMirroredStrategy.", keras.__version__, *TESTED_RANGE)


def _install(owner: Any, attr: str,
             make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
  current = getattr(owner, attr)
  if getattr(current, _MARK, False):
    return  # Already ours: `apply` is idempotent.
  _originals[(owner, attr)] = current
  wrapper = make(current)
  setattr(wrapper, _MARK, True)
  setattr(owner, attr, wrapper)


def _trainer():
  from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
  return trainer


def _variable_class():
  from keras.src.backend.common import variables  # pylint: disable=g-import-not-at-top
  return variables.Variable


def _is_multi_worker(strategy: Any) -> bool:
  return strategy is not None and _trainer()._collective_all_reduce_multi_worker(  # pylint: disable=protected-access
      strategy)


# --- symbolic_build_reduce --------------------------------------------------
# Upstream passes the whole (x, y, sample_weight) nest of PerReplica values to
# `strategy.reduce("MEAN", batch, axis=None)`. Collective all-reduce takes one
# tensor, not a nest: "Attempt to convert a value (PerReplica:...)". The build
# only reads shapes and dtypes, so one local replica's batch is enough and no
# collective is needed at all.
def _maybe_symbolic_build(original):
  def wrapper(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy  # pylint: disable=protected-access
    if iterator is None or not _is_multi_worker(strategy):
      return original(self, iterator=iterator, data_batch=data_batch)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from keras.src import tree  # pylint: disable=g-import-not-at-top
    for _, _, it in iterator:
      batch = next(it)
      distributed = tree.map_structure(
          lambda v: isinstance(v, tf.distribute.DistributedValues), batch)
      if all(tree.flatten(distributed)):
        batch = tree.map_structure(
            lambda v: strategy.experimental_local_results(v)[0], batch)
      data_batch = batch
      break
    return original(self, iterator=None, data_batch=data_batch)
  return functools.wraps(original)(wrapper)


# --- multi_worker_scalar_mean -----------------------------------------------
# Upstream reduces every log with `strategy.reduce("MEAN", v, axis=0)` under
# multi-worker collectives; logs are scalars, and a reduction along axis 0 of a
# scalar fails: "Invalid reduction dimension 0 for input with 0 dimensions".
# For scalars the mean across replicas is `axis=None`, which is also what the
# single-worker path computes. Other ranks keep the upstream behaviour.
def _reduce_per_replica(original):
  def wrapper(values, strategy, reduction):
    if reduction not in ("auto", "mean") or not _is_multi_worker(strategy):
      return original(values, strategy, reduction)
    from keras.src import tree  # pylint: disable=g-import-not-at-top

    def reduce_one(v):
      if strategy.experimental_local_results(v)[0].shape.rank == 0:
        return strategy.reduce("MEAN", v, axis=None)
      return original(v, strategy, "mean")
    return tree.map_structure(reduce_one, values)
  return functools.wraps(original)(wrapper)


# --- steps_per_execution, jit_compile_multi_replica ---------------------------
# Upstream wraps `strategy.run(step)` in a `tf.function(jit_compile=...)`:
# - Called from the `tf.cond` inside the `tf.while_loop` that runs
#   `steps_per_execution > 1` steps, that nested `tf.function` under
#   MirroredStrategy leaves a placeholder unfed: "You must feed a value for
#   placeholder tensor 'while/body/.../while/cond/Placeholder'". Calling
#   `strategy.run` directly inside the (already compiled) loop works.
# - With `jit_compile=True` the XLA cluster holds the whole `strategy.run`.
#   MirroredStrategy: it is placed on one device and fails with "Trying to
#   access resource .../replica_1/... located in device CPU:1 from device
#   CPU:0". MultiWorkerMirroredStrategy: the collective all-reduce has no XLA
#   kernel on CPU (UnimplementedError, then the process aborts). Compiling only
#   the per-replica step (as tf_keras did) fails the same way, because the
#   optimizer's cross-replica update runs inside it. So the step is built
#   without XLA only when asked (`jit_compile="auto"` decides so under a
#   strategy); an explicit `jit_compile=True` is refused (`_refusal`).
def _own_loop_needed(model: Any) -> bool:
  strategy = model._distribute_strategy  # pylint: disable=protected-access
  if strategy is None or model.run_eagerly:
    return False
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not isinstance(strategy, (tf.distribute.MirroredStrategy,
                               tf.distribute.MultiWorkerMirroredStrategy)):
    return False
  names = applied_fixes()
  return ((model.steps_per_execution > 1 and "steps_per_execution" in names) or
          (model.jit_compile and strategy.num_replicas_in_sync > 1 and
           "jit_compile_multi_replica" in names))


def _make_function(original):
  def wrapper(self, step_function):
    if not _own_loop_needed(self):
      return original(self, step_function)
    return _make_distributed_function(self, step_function)
  return functools.wraps(original)(wrapper)


def _make_distributed_function(model: Any, step_function: Callable[..., Any]
                               ) -> Callable[..., Any]:
  """Keras 3.15's `_make_function` with the two corrections above."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  trainer = _trainer()
  strategy = model.distribute_strategy
  replica_step = step_function
  if model.jit_compile:
    # Compiling only the replica's step would not help: the gradient
    # all-reduce and the variable updates of every replica run inside it.
    # MultiWorkerMirroredStrategy's class is named CollectiveAllReduceStrategy.
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    kind = ("MultiWorkerMirroredStrategy" if multi_worker
            else type(strategy).__name__)
    raise _refusal[0](
        field="jit_compile", value=True, source="Model.compile",
        expected=(f"False or 'auto' under {kind} with "
                  f"{strategy.num_replicas_in_sync} replicas: XLA cannot "
                  f"compile a step whose gradient all-reduce and variable "
                  f"updates span replicas (Keras {_keras_version_string()})"),
        hint=("Compile with jit_compile='auto' (Keras's default, which turns "
              "XLA off under a strategy); XLA stays available without a "
              "strategy, on one replica, and on TPUs"))

  @tf.autograph.experimental.do_not_convert
  def one_step_on_data(data):
    outputs = strategy.run(replica_step, args=(data,))
    # Looked up at call time so the multi-worker correction applies.
    return trainer.reduce_per_replica(outputs, strategy, reduction="auto")

  # Inside the loop below `strategy.run` is called directly (the loop is
  # compiled already); everywhere else through a `tf.function`, as upstream.
  compiled_step = model._autoconvert_optionals(  # pylint: disable=protected-access
      tf.function(one_step_on_data, reduce_retracing=True))
  one_step_on_data = model._autoconvert_optionals(one_step_on_data)  # pylint: disable=protected-access

  @tf.autograph.experimental.do_not_convert
  def multi_step_on_iterator(iterator):
    steps = model.steps_per_execution
    if steps == 1:
      return tf.experimental.Optional.from_value(
          compiled_step(iterator.get_next()))
    # As upstream: the Optional's spec is set while `tf.while_loop` traces.
    empty_outputs = tf.experimental.Optional.empty(None)

    def cond(execution_step, unused_outputs, next_inputs):
      return tf.logical_and(tf.less(execution_step, steps),
                            next_inputs.has_value())

    def body(execution_step, optional_outputs, next_inputs):
      def has_next():
        outputs = tf.experimental.Optional.from_value(
            one_step_on_data(next_inputs.get_value()))
        empty_outputs._element_spec = outputs.element_spec  # pylint: disable=protected-access
        return outputs

      def no_has_next():
        optional_outputs._element_spec = empty_outputs._element_spec  # pylint: disable=protected-access
        return optional_outputs

      next_outputs = tf.cond(
          tf.logical_and(tf.less(execution_step, steps),
                         next_inputs.has_value()),
          has_next, no_has_next)
      return (execution_step + 1, next_outputs,
              tf.cond(tf.less(execution_step + 1, steps),
                      iterator.get_next_as_optional, lambda: next_inputs))

    _, final_outputs, _ = tf.while_loop(
        cond, body,
        loop_vars=[tf.constant(0), empty_outputs,
                   iterator.get_next_as_optional()])
    final_outputs._element_spec = empty_outputs.element_spec  # pylint: disable=protected-access
    return final_outputs

  multi_step_on_iterator = tf.function(multi_step_on_iterator,
                                       reduce_retracing=True)

  def function(iterator):
    if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
      optional_outputs = multi_step_on_iterator(iterator)
      if not optional_outputs.has_value():
        raise StopIteration
      return optional_outputs.get_value()
    outputs = None
    for _, data in zip(range(model.steps_per_execution), iterator):
      outputs = compiled_step(data)
    return outputs

  return function


# --- atomic_assign_add ---------------------------------------------------------
# Keras's `Variable.assign_add(v)` is `self.assign(self + v)`: a read, then a
# write. Under ParameterServerStrategy the variables live on the ps tasks and
# the workers run steps at once, so two steps read the same value and one
# increment is lost: `optimizer.iterations` counted 75 for 96 steps on 2
# workers, and learning-rate schedules read that count. TensorFlow's own
# `assign_add` is one op on the ps, which applies it atomically.
def _atomic_assign(original, method: str):
  def wrapper(self, value):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from keras.src.backend.common import stateless_scope  # pylint: disable=g-import-not-at-top
    if (stateless_scope.in_stateless_scope()
        or not isinstance(self._value, tf.Variable)  # pylint: disable=protected-access
        or not isinstance(tf.distribute.get_strategy(),
                          tf.distribute.experimental.ParameterServerStrategy)):
      return original(self, value)
    value = tf.cast(self._convert_to_tensor(value, dtype=self._dtype),  # pylint: disable=protected-access
                    self._value.dtype)  # pylint: disable=protected-access
    if not value.shape.is_compatible_with(self._value.shape):  # pylint: disable=protected-access
      return original(self, value)  # Keras raises its own shape error.
    return getattr(self._value, method)(value)  # pylint: disable=protected-access
  return functools.wraps(original)(wrapper)


# --- lazy_optimizer_build -----------------------------------------------------
# The custom-training-loop tutorial builds the optimizer on its first
# `apply_gradients`, inside `strategy.run`. Keras 3 then creates the slot
# variables in the replica context, inside a `tf.cond` of its own, and with 2+
# replicas TensorFlow fails with "You must feed a value for placeholder tensor
# 'cond/else/.../Placeholder'". Building in the cross-replica context (one
# `merge_call`, as tf_keras's optimizer did) and out of the traced function
# (`init_scope`) before Keras's own code runs creates them eagerly as
# mirrored variables, once. A model without `keras.Input` built on its first
# call inside `strategy.run` fails the same way: its layers are built so too.
def _lazy_apply(original):
  def wrapper(self, grads, trainable_variables=None):
    context = (None if self.built or trainable_variables is None
               else _in_replicas())
    if context is not None:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      variables = list(trainable_variables)

      def build(strategy):
        del strategy
        with tf.init_scope():  # Created eagerly, not in the traced step.
          if not self.built:
            self.build(variables)
      context.merge_call(build)
      trainable_variables = variables
    return original(self, grads, trainable_variables)
  return functools.wraps(original)(wrapper)


def _in_replicas() -> Any:
  """The replica context of a step on 2+ replicas, else ``None``."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  context = tf.distribute.get_replica_context()
  if (tf.distribute.has_strategy() and context is not None
      and context.num_replicas_in_sync > 1):
    return context
  return None


def _lazy_layer_build(original):
  def wrapper(self, call_spec):
    context = None if self.built else _in_replicas()
    if context is None:
      return original(self, call_spec)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    def build(strategy):
      del strategy
      with tf.init_scope():  # The layer's variables, eagerly, mirrored.
        original(self, call_spec)
    context.merge_call(build)
  return functools.wraps(original)(wrapper)


def _layer_class():
  from keras.src.layers import layer  # pylint: disable=g-import-not-at-top
  return layer.Layer


def _optimizer_class():
  from keras.src.optimizers import base_optimizer  # pylint: disable=g-import-not-at-top
  return base_optimizer.BaseOptimizer


# name -> the (owner, attribute, wrapper maker) triples the fix installs.
_INSTALLS: dict[str, Callable[[], list[tuple[Any, str, Callable]]]] = {
    "symbolic_build_reduce": lambda: [
        (_trainer().TensorFlowTrainer, "_maybe_symbolic_build",
         _maybe_symbolic_build)],
    "multi_worker_scalar_mean": lambda: [
        (_trainer(), "reduce_per_replica", _reduce_per_replica)],
    "steps_per_execution": lambda: [
        (_trainer().TensorFlowTrainer, "_make_function", _make_function)],
    "jit_compile_multi_replica": lambda: [
        (_trainer().TensorFlowTrainer, "_make_function", _make_function)],
    "atomic_assign_add": lambda: [
        (_variable_class(), method,
         functools.partial(_atomic_assign, method=method))
        for method in ("assign_add", "assign_sub")],
    "lazy_optimizer_build": lambda: [
        (_optimizer_class(), "apply", _lazy_apply),
        (_layer_class(), "_maybe_build", _lazy_layer_build)],
}
