"""A custom-loop runner in the spirit of Orbit's Controller and StandardTrainer.

You write a per-replica step; `Runner` runs it under any strategy:
``strategy.run`` inside one `tf.function` of ``steps_per_loop`` steps, or
``ClusterCoordinator.schedule`` under ParameterServerStrategy. It counts steps
on the host (under ParameterServerStrategy the optimizer's ``iterations`` races
between workers), keeps checkpoints and TensorBoard summaries written by the
chief only, and restores the latest checkpoint when it starts.

Reduction: a step returns a dict of scalars; each is **summed over replicas**
and averaged over the steps of a loop. Return losses scaled by the global
batch, as `tf.nn.compute_average_loss` (or `tfdist.scaled_loss`) does, and the
sum is the global mean. Keras metrics passed in ``metrics`` aggregate themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from tfdist import _flight
from tfdist.data import feed
from tfdist.data.feed import DatasetFn
from tfdist.errors import ConfigError
from tfdist.strategy import flight_steps
from tfdist.strategy import introspect
from tfdist.training import _input
from tfdist.training import _worker_errors
from tfdist.training import checkpoints as checkpoints_lib
from tfdist.training import chief as chief_lib
from tfdist.training import ownership
from tfdist.training import preemption as preemption_lib
from tfdist.training.steps import StepFn

__all__ = ["Runner", "RunnerOptions"]

_SOURCE = "Runner options"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerOptions:
  """How `Runner` loops, saves and logs.

  Attributes:
    steps_per_loop: steps run inside one `tf.function` call (or one scheduled
      closure under ParameterServerStrategy).
    checkpoint_dir: where the chief keeps checkpoints; ``None`` keeps none.
      A relative path is read against the working directory when the
      `Runner` is made. It belongs to one job: the chief records the
      architecture and variables of the models among ``checkpoint_items``
      and the cluster there, and a directory of another job's or of other
      files is refused.
    checkpoint_every: save every this many steps (rounded up to whole
      loops); 0 saves only when `train` returns.
    max_to_keep: checkpoints kept.
    summary_dir: where the chief writes TensorBoard summaries; ``None``
      writes none.
    ps_synchronous: under ParameterServerStrategy, wait for each loop before
      scheduling the next (one worker at a time, reproducible); by default
      loops are scheduled ahead and run on all workers at once, at least once
      each.
  """
  steps_per_loop: int = 1
  checkpoint_dir: str | None = None
  checkpoint_every: int = 0
  max_to_keep: int = 3
  summary_dir: str | None = None
  ps_synchronous: bool = False

  def __post_init__(self):
    for name, low in (("steps_per_loop", 1), ("checkpoint_every", 0),
                      ("max_to_keep", 1)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(field=name, value=value, source=_SOURCE,
                          expected=f"an integer >= {low}")


class Runner:
  """Runs per-replica train and eval steps under a strategy.

  With a ``checkpoint_dir``, SIGTERM and SIGUSR1 are handled from
  construction until `close`: a signal is acted on at the next loop end of
  `train` (every worker saves at the same step and `tfdist.PreemptedError`,
  exit code 42, is raised). See docs/fault_tolerance.md.
  """

  def __init__(self, *, strategy: tf.distribute.Strategy, train_step: StepFn,
               train_data: DatasetFn, eval_step: StepFn | None = None,
               eval_data: DatasetFn | None = None,
               checkpoint_items: Mapping[str, Any] | None = None,
               metrics: Sequence[Any] = (),
               options: RunnerOptions = RunnerOptions()):
    """Creates the runner and restores the latest checkpoint, if any.

    Args:
      strategy: the strategy the model and optimizer were built under.
      train_step: per-replica step taking one batch.
      train_data: ``dataset_fn(input_context)`` giving per-replica batches.
      eval_step: per-replica evaluation step.
      eval_data: ``dataset_fn`` for evaluation.
      checkpoint_items: trackables to checkpoint, e.g. model and optimizer.
      metrics: Keras metrics the steps update; reported and reset per call.
      options: `RunnerOptions`.
    """
    if not callable(train_data) or isinstance(train_data, tf.data.Dataset):
      raise ConfigError(
          field="train_data", value=train_data, source="Runner",
          expected="a function input_context -> tf.data.Dataset",
          hint="Wrap the dataset: lambda ctx: dataset.shard("
               "ctx.num_input_pipelines, ctx.input_pipeline_id)")
    self._strategy = strategy
    self._peers = flight_steps.peers(strategy)  # For the flight recorder.
    _flight.watch()
    self._options = options
    self._directory = (chief_lib.absolute(options.checkpoint_dir)
                       if options.checkpoint_dir else None)
    train_data = feed.checked(train_data, field="train_data", source="Runner")
    if eval_data is not None:
      eval_data = feed.checked(eval_data, field="eval_data", source="Runner")
    self._metrics = list(metrics)
    self._coordinator = None
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
      self._coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    self._eval_data = eval_data
    self._train_loop = self._loop_fn(train_step)
    self._eval_loop = self._loop_fn(eval_step) if eval_step else None
    self._global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                    name="tfdist_global_step")
    self._items = dict(checkpoint_items or {})
    self._checkpoint = tf.train.Checkpoint(step=self._global_step,
                                           **self._items)
    self._step = 0
    self._saved_step = -1
    self._restore()
    # With somewhere to save, SIGTERM/SIGUSR1 save and stop at a loop end.
    self._watcher = None
    if options.checkpoint_dir:
      self._watcher = preemption_lib.PreemptionWatcher(strategy).__enter__()
    self._train_iter = self._iterator(train_data, skip_steps=self._step)
    self._writer = (tf.summary.create_file_writer(options.summary_dir)
                    if options.summary_dir and introspect.is_chief(strategy)
                    else None)

  @property
  def step(self) -> int:
    """Steps trained so far, counted on this host."""
    return self._step

  def close(self) -> None:
    """Gives SIGTERM and SIGUSR1 back their previous handlers."""
    if self._watcher is not None:
      self._watcher.__exit__(None, None, None)
      self._watcher = None

  def _check_preemption(self, join: Callable[[], None] | None = None) -> None:
    """Saves and raises PreemptedError once any worker got a signal."""
    if self._watcher is not None and self._watcher.should_stop():
      if join is not None:
        join()
      self.save()
      self._watcher.exit(self._step, self._directory)

  def train(self, num_steps: int) -> dict[str, float]:
    """Trains until `step` reaches ``num_steps``; returns the last loop's logs.

    Raises:
      PreemptedError: SIGTERM or SIGUSR1 came (with a ``checkpoint_dir``):
        every worker saved at the same step.
      WorkerLostError: a peer died, stopped or stopped answering (as in
        `tfdist.fit`).
    """
    with _worker_errors.worker_errors(self._strategy):
      return self._train(num_steps)

  def _train(self, num_steps: int) -> dict[str, float]:
    self._check_preemption()
    if self._coordinator is not None and not self._options.ps_synchronous:
      return self._train_scheduled(num_steps)
    logs: dict[str, float] = {}
    while self._step < num_steps:
      n = min(self._options.steps_per_loop, num_steps - self._step)
      for metric in self._metrics:
        metric.reset_state()
      _flight.begin_step(self._step + 1)
      with _flight.recorded("gradients" if n == 1 else f"gradients, {n} steps",
                            transport="tensorflow", peers=self._peers):
        logs = self._run(self._train_loop, self._train_iter, n)
      self._advance(n)
      self._write_summaries("train", logs)
      self._check_preemption()
    if self._options.checkpoint_dir:
      self.save()
    return logs

  def _train_scheduled(self, num_steps: int) -> dict[str, float]:
    """ParameterServerStrategy: schedule loops ahead; join to save and end."""
    for metric in self._metrics:
      metric.reset_state()
    remotes = []
    while self._step < num_steps:
      n = min(self._options.steps_per_loop, num_steps - self._step)
      remotes.append((n, self._coordinator.schedule(
          self._train_loop, args=(self._train_iter, tf.constant(n)))))
      self._advance(n, join=self._coordinator.join)
      self._check_preemption(join=self._coordinator.join)
    self._coordinator.join()
    steps = sum(n for n, _ in remotes)
    logs: dict[str, float] = {}
    for n, remote in remotes:  # Step-weighted mean over every loop.
      for k, v in remote.fetch().items():
        logs[k] = logs.get(k, 0.0) + float(v) * n / steps
    logs.update({m.name: float(m.result()) for m in self._metrics})
    self._write_summaries("train", logs)
    if self._options.checkpoint_dir:
      self.save()
    return logs

  def _advance(self, n: int, join: Callable[[], None] | None = None) -> None:
    """Counts ``n`` steps and saves when a checkpoint interval is crossed."""
    every = self._options.checkpoint_every
    before, self._step = self._step, self._step + n
    if every and self._step // every > before // every:
      if join is not None:
        join()
      self.save()

  def evaluate(self, num_steps: int) -> dict[str, float]:
    """Runs ``num_steps`` eval steps on a fresh eval iterator."""
    if self._eval_loop is None or self._eval_data is None:
      raise ConfigError(field="eval_step", value=None, source="Runner",
                        expected="eval_step and eval_data given to Runner")
    for metric in self._metrics:
      metric.reset_state()
    iterator = self._iterator(self._eval_data)
    logs: dict[str, float] = {}
    done = 0
    while done < num_steps:
      n = min(self._options.steps_per_loop, num_steps - done)
      logs = self._run(self._eval_loop, iterator, n)
      done += n
    self._write_summaries("eval", logs)
    return logs

  def save(self) -> str | None:
    """Writes a checkpoint at the current step; returns the chief's path."""
    if not self._directory or self._saved_step == self._step:
      return None
    self._global_step.assign(self._step)
    path = checkpoints_lib.save(
        self._checkpoint, self._directory,
        strategy=self._strategy, max_to_keep=self._options.max_to_keep,
        number=self._step)
    self._saved_step = self._step
    return path

  def _restore(self) -> None:
    """Claims ``checkpoint_dir`` and restores; every worker at one step."""
    if not self._directory:
      return
    restored = checkpoints_lib.agreed(
        self._strategy, self._restore_here, directory=self._directory,
        field="checkpoint_dir", source=_SOURCE)
    if restored is not None:
      self._step = self._saved_step = restored[0]

  def _restore_here(self) -> tuple[int] | None:
    items = [item for _, item in sorted(self._items.items())]
    ownership.claim(self._directory,
                    ownership.owner_of(items, self._strategy),
                    strategy=self._strategy, field="checkpoint_dir",
                    source=_SOURCE)
    latest = checkpoints_lib.restore_latest(self._checkpoint, self._directory,
                                            strict=False)
    return (int(self._global_step.numpy()),) if latest else None

  def _iterator(self, dataset_fn: DatasetFn, skip_steps: int = 0):
    """A distributed iterator; resumes ``skip_steps`` steps into the data.

    Under ParameterServerStrategy (at-least-once) the data starts over.
    """
    if self._coordinator is not None:
      return _input.per_worker_iterator(self._coordinator, self._strategy,
                                        dataset_fn)
    return iter(self._strategy.distribute_datasets_from_function(
        _input.skipping(dataset_fn, skip_steps)))

  def _loop_fn(self, step_fn: StepFn):
    strategy = self._strategy

    def reduce(outputs):
      if self._coordinator is not None:  # Sum this worker's replicas.
        return {k: tf.add_n(list(strategy.experimental_local_results(v)))
                for k, v in outputs.items()}
      return {k: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None)
              for k, v in outputs.items()}

    @tf.function
    def loop(iterator, n):
      total = reduce(strategy.run(step_fn, args=(next(iterator),)) or {})
      for _ in tf.range(n - 1):
        out = reduce(strategy.run(step_fn, args=(next(iterator),)) or {})
        total = {k: total[k] + out[k] for k in total}
      return {k: v / tf.cast(n, v.dtype) for k, v in total.items()}
    return loop

  def _run(self, loop, iterator, n: int) -> dict[str, float]:
    n_t = tf.constant(n)
    if self._coordinator is not None:
      remote = self._coordinator.schedule(loop, args=(iterator, n_t))
      self._coordinator.join()
      values = remote.fetch()
    else:
      values = loop(iterator, n_t)
    logs = {k: float(v) for k, v in values.items()}
    for metric in self._metrics:
      logs[metric.name] = float(metric.result())
    return logs

  def _write_summaries(self, prefix: str, logs: Mapping[str, float]) -> None:
    if self._writer is None:
      return
    with self._writer.as_default(step=self._step):
      for name, value in logs.items():
        tf.summary.scalar(f"{prefix}/{name}", value)
