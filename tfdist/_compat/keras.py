"""Narrow corrections that make Keras 3 `model.fit` work under tf.distribute.

Only corrections of upstream code live here; tfdist's own features on Keras
(`tfdist.strategy.keras_hooks`) are installed by the same `apply`, which
checks their Keras code the same way.

Keras's TensorFlow trainer (``keras/src/backend/tensorflow/trainer.py``) fails
under some strategies for reasons that are each a few lines long. `apply`
replaces the affected functions with wrappers that take the corrected path only
in the failing situation and otherwise call the original, so training without a
strategy, or with a strategy that already works, runs Keras's own code.

| fix                           | upstream code replaced                        | fails with            |
|-------------------------------|-----------------------------------------------|-----------------------|
| ``symbolic_build_reduce``     | ``TensorFlowTrainer._maybe_symbolic_build``   | MultiWorkerMirrored; Mirrored with a global batch that does not split evenly (7 on 2 replicas) |
| ``multi_worker_scalar_mean``  | ``reduce_per_replica``                        | MultiWorkerMirrored   |
| ``steps_per_execution``       | ``TensorFlowTrainer._make_function``          | Mirrored, spe > 1     |
| ``jit_compile_multi_replica`` | ``TensorFlowTrainer._make_function``          | (MultiWorker)Mirrored, ``jit_compile=True``: refused, see below |
| ``atomic_assign_add``         | ``Variable.assign_add`` / ``assign_sub``      | ParameterServer: lost increments |
| ``lazy_optimizer_build``      | ``BaseOptimizer.apply``                       | custom loops: optimizer built inside ``strategy.run`` on several replicas |
| ``scope_errors``              | ``TFOptimizer.__init__`` (records where), ``add_variable_from_reference``, ``BaseOptimizer.apply`` | not a bug: an optimizer created outside ``strategy.scope()`` fails with "Mixing different tf.distribute.Strategy objects" (plain SGD counts steps twice), a model so built with a bare ``AssertionError``: refused by `Host.refusal`, naming the line to move |
| ``distributed_input_autotune`` | TensorFlow's ``OwnedMultiDeviceIterator.__init__``, ``_create_device_dataset`` | MultiWorkerMirrored (measured): the end of each distributed iterator (of `fit`, `evaluate`) waits out tf.data's autotuning period, up to 60 s: see `_untuned` |

**Which Keras gets them: decided at run time from the code, not the version.**
Each correction records a fingerprint (`fingerprint`: a hash of the source
text) of every upstream function it replaces or relies on, as verified here.
`apply` installs a correction only where the installed Keras still has exactly
that code, so the bug is there and the correction fits it; where upstream
changed one of those functions (fixed the bug, or moved the code the wrapper
mirrors), it logs once which function changed and leaves Keras alone. The code
verified is that of Keras 3.15.1, identical in 3.13.2 through 3.15.1
(`VERIFIED_VERSIONS`); the tests also run Keras without the corrections and
fail the day upstream fixes a bug.

One setting cannot be corrected: ``jit_compile=True`` on several replicas of
a (MultiWorker)MirroredStrategy (XLA cannot compile a step whose gradient
all-reduce and variable updates span the replicas). The first `fit`,
`evaluate` or `predict` refuses it with the error `Host.refusal` builds
(`tfdist.ConfigError` from `make_strategy`), rather than training without XLA
behind the user's back.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import linecache
import sys
import textwrap
import threading
import weakref
from typing import Any, Callable, Iterable, Mapping

from absl import logging

from tfdist import _process

__all__ = [
    "CAUSE_ATTR",
    "FIXES",
    "Fix",
    "Host",
    "VERIFIED_VERSIONS",
    "apply",
    "applied_fixes",
    "changed_targets",
    "fingerprint",
    "needed_fixes",
    "restore",
]

#: Keras releases whose code the fingerprints below match (checked by
#: hashing each release's functions); the test suite runs on the last one.
VERIFIED_VERSIONS: tuple[str, ...] = ("3.13.2", "3.14.1", "3.15.0", "3.15.1")


@dataclasses.dataclass(frozen=True)
class Fix:
  """One correction of Keras's TensorFlow trainer.

  Attributes:
    name: short name, as `needed_fixes` and `apply` report it.
    verified: each upstream function the correction replaces or relies on,
      as ``module:qualname``, to its `fingerprint` in the code verified
      here, or to ``None`` where only its public signature matters.
    issue: the upstream issue that tracks the bug.
    install: for a hook defined elsewhere, each ``module:qualname`` it
      wraps to its wrapper maker; this module's corrections keep theirs, in
      the same form, in ``_INSTALLS``.
  """
  name: str
  verified: Mapping[str, str | None]
  issue: str
  install: Mapping[str, Callable] = dataclasses.field(
      default_factory=dict, compare=False)


_TRAINER = "keras.src.backend.tensorflow.trainer"
_OPTIMIZER = "keras.src.backend.tensorflow.optimizer"
_BASE_OPTIMIZER = "keras.src.optimizers.base_optimizer"
_LOSS_SCALE = "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer"
# TensorFlow's, not Keras's: the distributed input of every Keras `fit`
# (fingerprints of TensorFlow 2.21.0's code).
_MULTI_DEVICE = "tensorflow.python.data.ops.multi_device_iterator_ops"
_MAKE_FUNCTION = {f"{_TRAINER}:TensorFlowTrainer._make_function":
                  "93aaf1c139f8a7e7"}

#: Every correction this module knows, in the order `apply` installs them.
FIXES: tuple[Fix, ...] = (
    Fix("symbolic_build_reduce",
        {f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build":
         "b0ca9a63ed295fb9"},
        "keras-team/keras#20585"),
    Fix("multi_worker_scalar_mean",
        {f"{_TRAINER}:reduce_per_replica": "2e7d54b1e6edc29a"},
        "tensorflow/tensorflow#72388"),
    Fix("steps_per_execution", _MAKE_FUNCTION, "keras-team/keras#19246"),
    Fix("jit_compile_multi_replica", _MAKE_FUNCTION,
        "XLA cannot compile a whole multi-replica step (none filed)"),
    Fix("atomic_assign_add",
        {"keras.src.backend.common.variables:Variable.assign_add":
         "b8d4dc30c3d0e141",
         "keras.src.backend.common.variables:Variable.assign_sub":
         "f0a8e1295527cec2"},
        "keras-team/keras#18668"),
    Fix("lazy_optimizer_build",
        {f"{_BASE_OPTIMIZER}:BaseOptimizer.apply":
         "72c9ffc2e5a116a1",
         "keras.src.layers.layer:Layer._maybe_build": "2df515fff5375b76"},
        "keras-team/keras#19308"),
    Fix("loss_scale_agreement",
        {f"{_LOSS_SCALE}._tf_apply": "d492e03d6b8f7332",
         f"{_LOSS_SCALE}._common_apply": "74c3ab5ec707779c",
         f"{_LOSS_SCALE}.check_finite": "37893b552f63d2d2"},
        "none filed: each replica tests only its own gradients "
        "(keras-team/keras#18691 wrote the test)"),
    Fix("scope_errors",
        {f"{_OPTIMIZER}:TFOptimizer.__init__": "fba59c4d6803c945",
         f"{_OPTIMIZER}:TFOptimizer.add_variable_from_reference": None,
         f"{_BASE_OPTIMIZER}:BaseOptimizer.apply": None},
        "none: upstream names no fix"),
    Fix("distributed_input_autotune",
        {f"{_MULTI_DEVICE}:OwnedMultiDeviceIterator.__init__":
         "2d651340464343c6",
         f"{_MULTI_DEVICE}:_create_device_dataset": "ba5247af44bd3957"},
        "none filed: cancelling the iterator does not wake its autotuning "
        "thread (TensorFlow 2.21)"),
)


@dataclasses.dataclass(frozen=True)
class Host:
  """What the floors above hand the corrections; this floor imports nothing
  from tfdist, so `tfdist.make_strategy` passes them to `apply`.

  Attributes:
    refusal: builds the error raised for a setting that cannot run, called
      with the keywords ``field``, ``value``, ``expected``, ``source`` and
      ``hint`` (`tfdist.ConfigError` fits).
    hooks: tfdist's own hooks, installed after the corrections
      (`tfdist.strategy.keras_hooks.HOOKS`).
  """
  refusal: Callable[..., Exception]
  hooks: tuple[Fix, ...] = ()


def _value_error(*, field: str, value: Any, expected: str, source: str,
                 hint: str) -> Exception:
  return ValueError(f"{field}: received {value!r}; expected {expected} "
                    f"({source}). {hint}")


_host: list[Host] = [Host(refusal=_value_error)]

# On each wrapper: (upstream's function, the makers over it, the fixes' names).
_MARK = "__tfdist_keras_compat__"
_lock = threading.Lock()


def _keras_version_string() -> str:
  import keras  # pylint: disable=g-import-not-at-top
  return keras.__version__


def _resolve(target: str) -> tuple[Any, str]:
  """``"pkg.mod:Cls.attr"`` -> ``(pkg.mod.Cls, "attr")``."""
  module, qualname = target.split(":")
  *path, attr = qualname.split(".")
  owner = importlib.import_module(module)
  for part in path:
    owner = getattr(owner, part)
  return owner, attr


def fingerprint(target: str) -> str | None:
  """A hash of the upstream source of ``target`` (``module:qualname``).

  Keras's own function is read even where a correction replaced it. The
  first 16 hex digits of the SHA-256 of its dedented source text; ``None``
  when there is no such function or its source cannot be read.
  """
  try:
    source = textwrap.dedent(inspect.getsource(_marks(target)[0]))
  except (OSError, TypeError):  # None, or no source to read.
    return None
  return hashlib.sha256(source.encode()).hexdigest()[:16]


def changed_targets(fix: Fix) -> tuple[str, ...]:
  """The functions of ``fix`` whose code differs from the code verified."""
  return tuple(t for t, want in fix.verified.items()
               if (fingerprint(t) != want if want is not None
                   else _marks(t)[0] is None))


def _marks(target: str) -> tuple[Any, tuple[Callable, ...], frozenset[str]]:
  """`_MARK` at ``target``; ``(Keras's own function, (), frozenset())`` where
  nothing is installed, ``None`` for a missing one."""
  try:
    current = getattr(*_resolve(target))
  except (ImportError, AttributeError):
    return None, (), frozenset()
  return getattr(current, _MARK, (current, (), frozenset()))


def needed_fixes(fixes: Iterable[Fix] = FIXES) -> tuple[Fix, ...]:
  """The corrections whose upstream code is in the installed Keras.

  Args:
    fixes: the candidates; every correction this module knows by default.

  Returns:
    Those whose every verified function has its verified fingerprint.
  """
  return tuple(f for f in fixes if not changed_targets(f))


def applied_fixes() -> tuple[str, ...]:
  """Names of the corrections installed in this process."""
  return tuple(sorted(
      fix.name for fix in FIXES + _host[0].hooks
      if all(fix.name in _marks(target)[2] for target, _ in _installs(fix))))


def _installs(fix: Fix) -> Iterable[tuple[str, Callable]]:
  return (fix.install or _INSTALLS[fix.name]).items()


def apply(names: Iterable[str] | None = None, *,
          host: Host | None = None) -> tuple[str, ...]:
  """Installs the corrections the installed Keras needs; idempotent.

  Safe to call many times and from several threads. A correction whose
  upstream code changed is not installed, and the change is logged once.

  Args:
    names: install only these of the needed corrections (tests use it to show
      each upstream bug on its own); all of them by default.
    host: what tfdist's upper floors provide (`Host`), its hooks included;
      kept for later calls. Without one, errors are ``ValueError``.

  Returns:
    The names of the corrections and hooks in place after the call.
  """
  if host is not None:
    _host[0] = host
  every = FIXES + _host[0].hooks
  wanted = set(names) if names is not None else {f.name for f in every}
  with _lock:
    wanted -= set(applied_fixes())
    for fix in every:
      if fix.name not in wanted:
        continue
      changed = changed_targets(fix)
      if changed and _process.once((fix.name, changed)):
        _warn_changed(fix.name, changed)
      for target, make in () if changed else _installs(fix):
        _install(*_resolve(target), make, fix.name)
  return applied_fixes()


def restore() -> None:
  """Puts Keras's original functions back (for tests)."""
  with _lock:
    for fix in FIXES + _host[0].hooks:
      for target, _ in _installs(fix):
        original, makers, _ = _marks(target)
        if makers:
          setattr(*_resolve(target), original)


def _warn_changed(name: str, changed: tuple[str, ...]) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  logging.warning(
      "tfdist: %s changed in Keras %s / TensorFlow %s since the code "
      "tfdist's correction %r was verified on (Keras %s); the correction is "
      "not applied, and what it corrects may fail (see "
      "tfdist/_compat/keras.py). tfdist's tests tell whether it is still "
      "needed.", ", ".join(changed), _keras_version_string(), tf.__version__,
      name, ", ".join(VERIFIED_VERSIONS))


def _install(owner: Any, attr: str,
             make: Callable[[Callable[..., Any]], Callable[..., Any]],
             name: str) -> None:
  """Wraps ``owner.attr`` by ``make``, over any wrapper of another maker
  (``fit`` has two hooks)."""
  current = getattr(owner, attr)
  original, makers, names = getattr(current, _MARK, (current, (), frozenset()))
  if make not in makers:  # Else already ours: `apply` is idempotent.
    current, makers = make(current), (*makers, make)
    setattr(owner, attr, current)
  setattr(current, _MARK, (original, makers, names | {name}))


def _trainer():
  from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
  return trainer


def _is_multi_worker(strategy: Any) -> bool:
  return strategy is not None and _trainer()._collective_all_reduce_multi_worker(  # pylint: disable=protected-access
      strategy)


# --- symbolic_build_reduce --------------------------------------------------
# Upstream passes the whole (x, y, sample_weight) nest of PerReplica values to
# `strategy.reduce("MEAN", batch, axis=None)`. Collective all-reduce takes one
# tensor, not a nest: "Attempt to convert a value (PerReplica:...)". Under
# MirroredStrategy a first batch split unevenly (4 and 3 rows) cannot be
# averaged element-wise: "Inputs to operation AddN ... must have the same size
# and shape". The build only reads shapes and dtypes, so one local replica's
# batch is enough and no reduction is needed at all.
def _maybe_symbolic_build(original):
  def wrapper(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy  # pylint: disable=protected-access
    if iterator is None or strategy is None:
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
#   strategy); an explicit `jit_compile=True` is refused (`Host.refusal`).
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
    raise _host[0].refusal(
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


# --- loss_scale_agreement ------------------------------------------------------
# Keras's LossScaleOptimizer applies gradients, the all-reduce included, inside
# a `cond` on whether they are finite, but each replica tests its own, before
# the sum; under merge_call Keras takes replica 0's answer for the process. A
# worker whose gradients overflow skips the all-reduce the others wait in (a
# 2-worker run hung until killed), and in one process replica 1's infinities
# are summed into the weights. The replicas agree instead: one scalar
# all-reduce a step counts those that overflowed, and all apply or all skip.
def _agreed_apply(original):
  def wrapper(self, grads, trainable_variables=None):
    context = _in_replicas()
    if context is None:
      return original(self, grads, trainable_variables)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from keras.src import ops  # pylint: disable=g-import-not-at-top
    total = tf.distribute.ReduceOp.SUM

    def overflowed(g):  # 1.0 where this replica's gradients are not finite.
      return 1.0 - tf.cast(self.check_finite(g), tf.float32)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
      finite = context.all_reduce(total, overflowed(grads)) == 0
      ops.cond(finite, lambda: self._stateful_handle_finite_grads(
          grads, trainable_variables), self._stateful_handle_non_finite_grads)
      return

    def cross_replica(strategy, grads, trainable_variables):
      each = strategy.extended.call_for_each_replica(overflowed, args=(grads,))
      finite = strategy.reduce(total, each, axis=None) == 0
      # Keras's own structure: the cond in the cross-replica context.
      ops.cond(finite, lambda: strategy.extended.call_for_each_replica(
          self._stateful_handle_finite_grads,
          args=(grads, trainable_variables)),
               self._stateful_handle_non_finite_grads)
    context.merge_call(cross_replica, args=(grads, trainable_variables))
  return functools.wraps(original)(wrapper)


# An optimizer records the strategy it was created under, and works under no
# other. Created outside `strategy.scope()`, its slot variables fail with
# "Mixing different tf.distribute.Strategy objects: <...MirroredStrategy> is
# not <..._DefaultDistributionStrategy>"; without slots (plain SGD) it trains,
# counting `iterations` once per replica (8 for 4 steps on 2 replicas), which
# schedules read. A model built outside the scope, its optimizer inside, fails
# in `apply` with a bare AssertionError. Upstream's error is raised as a
# refusal that says what to move (`__cause__`: upstream's); where upstream
# goes on, `apply` refuses as it returns (in `fit`, while tracing: no step
# runs). Where it was created is kept off the optimizer, which Keras lists,
# compares and serializes.
_created_at: "weakref.WeakKeyDictionary[Any, tuple[str, int]]" = (
    weakref.WeakKeyDictionary())


def _record_creation(original):
  def wrapper(self, *args, **kwargs):
    original(self, *args, **kwargs)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame and frame.f_globals.get("__name__", "").split(".")[0] in (
        "keras", "tfdist"):
      frame = frame.f_back
    if frame and not tf.distribute.has_strategy():
      _created_at[self] = (frame.f_code.co_filename, frame.f_lineno)
  return functools.wraps(original)(wrapper)


def _scope_errors(original):
  def wrapper(self, *args, **kwargs):
    try:
      result = original(self, *args, **kwargs)
    except (RuntimeError, AssertionError) as e:
      refusal = _scope_refusal(self)
      if refusal is None:
        raise
      # Keras's traceback filter drops __cause__.
      setattr(refusal, CAUSE_ATTR, e)
      raise refusal from e
    refusal = _scope_refusal(self)
    if refusal is not None and _replicas(self) > 1:
      raise refusal  # Upstream went on (plain SGD, steps counted per replica).
    return result
  return functools.wraps(original)(wrapper)


#: The attribute of a refusal that holds upstream's error. The refusal is
#: tfdist's own error, so it carries it: in a weak map the cause, whose
#: traceback holds the refusal, would keep both alive, and the default
#: refusal (``ValueError``) has no weak references.
CAUSE_ATTR = "_tfdist_cause"


def _replicas(optimizer: Any) -> int:
  """The most replicas of the strategy ``optimizer`` was made under and the
  one it runs under: with one each, nothing is mixed (upstream is right)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return max(optimizer._distribution_strategy.num_replicas_in_sync,  # pylint: disable=protected-access
             tf.distribute.get_strategy().num_replicas_in_sync)


def _scope_refusal(optimizer: Any) -> Exception | None:
  """The refusal when ``optimizer`` runs under another strategy, else None."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  mine = getattr(optimizer, "_distribution_strategy", None)
  if mine is None or mine is tf.distribute.get_strategy():
    return None
  name = type(optimizer).__name__
  if not tf.distribute.has_strategy():  # The step runs outside the scope.
    return _host[0].refusal(
        field="model", value="variables created outside strategy.scope()",
        source="Model.fit", expected="variables created inside `with "
        f"strategy.scope():`, where its optimizer ({name}) was created",
        hint="Build and compile the model inside `with strategy.scope():`")
  path, line = _created_at.get(optimizer, (None, 0))
  code = linecache.getline(path, line).strip() if path else ""
  return _host[0].refusal(
      field="optimizer", value=name,
      source=f"created at {path}:{line}" if path else "created elsewhere",
      expected="an optimizer created inside `with strategy.scope():` of the "
               "strategy it trains under; this one was created outside it",
      hint=(f"Move `{code}` inside `with strategy.scope():`" if code else
            "Create the optimizer inside `with strategy.scope():`")
      + ", before model.compile")


def _untuned(dataset: Any) -> Any:
  """``dataset`` without tf.data's autotuning thread, unless its options ask.

  Destroying an iterator joins that thread, and under tf.distribute's
  multi-device iterator (TensorFlow 2.21) the thread is not woken: the join
  waits out its period, which doubles up to 60 s. Measured here on the
  README's 2-worker example (MultiWorkerMirroredStrategy): `fit` returned
  11-15 s late (on one worker or both) in each of 6 runs, and in none of 6
  with this correction. Untuning only the host pipeline, or only the
  per-device prefetch, was not enough (1 of 3, 3 of 4 runs still stalled).
  Without the thread, ``AUTOTUNE`` parallelism is the core count and
  prefetch buffers still grow; a dataset whose ``options.autotune.enabled``
  is set keeps its choice.
  """
  if dataset is None or dataset.options().autotune.enabled is not None:
    return dataset
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.with_options(options)


def _untuned_host(original):
  def wrapper(self, dataset=None, *args, **kwargs):
    return original(self, _untuned(dataset), *args, **kwargs)
  return functools.wraps(original)(wrapper)


def _untuned_device(original):
  def wrapper(*args, **kwargs):
    return _untuned(original(*args, **kwargs))
  return functools.wraps(original)(wrapper)


# name -> each ``module:qualname`` the fix wraps, to its wrapper maker (the
# form of `Fix.install`).
_INSTALLS: dict[str, dict[str, Callable]] = {
    "symbolic_build_reduce": {
        f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build":
        _maybe_symbolic_build},
    "multi_worker_scalar_mean": {
        f"{_TRAINER}:reduce_per_replica": _reduce_per_replica},
    "steps_per_execution": dict.fromkeys(_MAKE_FUNCTION, _make_function),
    "jit_compile_multi_replica": dict.fromkeys(_MAKE_FUNCTION, _make_function),
    "atomic_assign_add": {
        f"keras.src.backend.common.variables:Variable.{method}":
        functools.partial(_atomic_assign, method=method)
        for method in ("assign_add", "assign_sub")},
    "lazy_optimizer_build": {
        f"{_BASE_OPTIMIZER}:BaseOptimizer.apply": _lazy_apply,
        "keras.src.layers.layer:Layer._maybe_build": _lazy_layer_build},
    "loss_scale_agreement": {f"{_LOSS_SCALE}._tf_apply": _agreed_apply},
    "scope_errors": {
        f"{_OPTIMIZER}:TFOptimizer.__init__": _record_creation,
        f"{_OPTIMIZER}:TFOptimizer.add_variable_from_reference": _scope_errors,
        f"{_BASE_OPTIMIZER}:BaseOptimizer.apply": _scope_errors},
    "distributed_input_autotune": {
        f"{_MULTI_DEVICE}:OwnedMultiDeviceIterator.__init__": _untuned_host,
        f"{_MULTI_DEVICE}:_create_device_dataset": _untuned_device},
}
