"""`make_strategy`: a registry of strategy builders and the ``auto`` rule.

``auto`` picks a strategy from the resolved cluster and the local devices:

| cluster                                   | local devices | strategy                |
|-------------------------------------------|---------------|-------------------------|
| a TPU (``tpu=`` or detected)              | any           | ``tpu``                 |
| has ``ps`` tasks (not on the evaluator)   | any           | ``parameter_server``    |
| more than one chief/worker task           | any           | ``multi_worker_mirrored`` |
| one process                               | 2 or more GPUs| ``mirrored``            |
| one process                               | 1 GPU         | ``one_device`` (GPU 0)  |
| one process                               | CPU only      | ``default``             |

The evaluator task is one process beside the training cluster: it gets a
one-process row, and `tfdist.is_chief` is False there (it never writes
training state).

The names and the options each builder takes come from `catalog.CATALOG`;
this module holds the builders, which need TensorFlow.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from absl import logging
import tensorflow as tf

from tfdist import _flight
from tfdist import _process
from tfdist._compat import keras as keras_compat
from tfdist.cluster import local as local_lib
from tfdist.cluster import names as names_lib
from tfdist.cluster import resolve as resolve_lib
from tfdist.cluster import resolver as resolver_lib
from tfdist.cluster.info import ClusterInfo
from tfdist.errors import ConfigError, StartupTimeoutError
from tfdist.strategy import catalog
from tfdist.strategy import clean_exit
from tfdist.strategy import introspect
from tfdist.strategy import keras_hooks
from tfdist.strategy import options as opts
from tfdist.strategy import server as server_lib
from tfdist.strategy import startup as startup_lib
from tfdist.strategy import tpu as tpu_builder
from tfdist.strategy import transport as transport_lib
from tfdist.strategy.catalog import STRATEGY_NAMES

__all__ = ["make_strategy", "choose_strategy", "options_for", "STRATEGY_NAMES",
           "install_keras_hooks"]

Strategy = tf.distribute.Strategy
#: Builds a strategy from its options dataclass and the resolved cluster.
_Builder = Callable[[Any, ClusterInfo], Strategy]


def _build_default(o: opts.DefaultOptions, info: ClusterInfo) -> Strategy:
  del o, info
  return tf.distribute.get_strategy()


def _build_one_device(o: opts.OneDeviceOptions, info: ClusterInfo) -> Strategy:
  del info
  gpus = local_lib.local_devices().get("GPU", 0)
  device = o.device or catalog.gpu_devices(gpus)[0]
  _check_devices("device", [device])
  return tf.distribute.OneDeviceStrategy(device)


def _build_mirrored(o: opts.MirroredOptions, info: ClusterInfo) -> Strategy:
  del info
  devices = o.devices
  if o.num_gpus is not None:
    have = local_lib.local_devices().get("GPU", 0)
    if o.num_gpus > have:
      raise ConfigError(field="num_gpus", value=o.num_gpus,
                        expected=f"at most {have}, the GPUs this machine has",
                        source="make_strategy options")
    devices = catalog.gpu_devices(o.num_gpus)
  if devices:
    _check_devices("devices", devices)
  cross_device_ops = {
      None: lambda: None,
      "nccl": lambda: tf.distribute.NcclAllReduce(num_packs=o.num_packs),
      "hierarchical_copy":
          lambda: tf.distribute.HierarchicalCopyAllReduce(num_packs=o.num_packs),
      "reduction_to_one_device": tf.distribute.ReductionToOneDevice,
  }[o.cross_device_ops]()
  return _MirroredStrategy(
      devices=list(devices) if devices else None,
      cross_device_ops=cross_device_ops)


class _MirroredStrategy(tf.distribute.MirroredStrategy):
  """MirroredStrategy whose collectives never meet another instance's.

  Every `tf.distribute.MirroredStrategy` numbers its collective groups from
  the same base, so a second strategy in one process (a notebook, a test
  suite) reuses the first one's group and instance keys: its all-reduces
  then fail with "Shape mismatch in the collective instance" and abort all
  later collectives of the process. Each instance built here gets its own
  key range, as TensorFlow's own tests arrange with `_collective_key_base`.
  """

  def __init__(self, *args, **kwargs):
    self._collective_key_base = _process.number("mirrored", start=1) * 100_000
    super().__init__(*args, **kwargs)


def _build_central_storage(o: opts.CentralStorageOptions,
                           info: ClusterInfo) -> Strategy:
  del info
  devices = list(o.compute_devices or ())
  if o.parameter_device:
    devices.append(o.parameter_device)
  _check_devices("compute_devices", devices)
  return tf.distribute.experimental.CentralStorageStrategy(
      compute_devices=list(o.compute_devices) if o.compute_devices else None,
      parameter_device=o.parameter_device)


_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


def _choose_transport(strategy: Strategy,
                      o: opts.MultiWorkerMirroredOptions) -> None:
  """Records what carries ``strategy``'s gradients (said at the first step:
  `transport.announce`)."""
  choice = transport_lib.choose(
      strategy, o.transport,
      connect_timeout_s=o.startup_timeout_seconds or 300.0,
      timeout_s=o.timeout_seconds or 300.0)
  if strategy.num_replicas_in_sync > 1:
    transport_lib.agree(strategy, choice,
                        timeout_s=o.startup_timeout_seconds or 300.0)
  transport_lib.record(strategy, choice)


def _build_multi_worker_mirrored(o: opts.MultiWorkerMirroredOptions,
                                 info: ClusterInfo) -> Strategy:
  if info.num_ps:
    raise ConfigError(
        field="cluster.ps", value=list(info.cluster["ps"]), source=info.origin,
        expected="no ps tasks for multi_worker_mirrored",
        hint="Use make_strategy('parameter_server') for a cluster with ps tasks")
  if o.num_workers is not None and o.num_workers != max(info.num_workers, 1):
    raise ConfigError(
        field="num_workers", value=o.num_workers, source=info.origin,
        expected=(f"the number of chief and worker tasks in the cluster, "
                  f"{max(info.num_workers, 1)}"),
        hint="Start every worker with its own TF_CONFIG (tfdist launch does "
             "it) or run the tasks under srun")
  communication = tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=o.bytes_per_pack, timeout_seconds=o.timeout_seconds,
      implementation=_IMPLEMENTATIONS[o.implementation])
  info = names_lib.resolve_names(info)  # Seconds, not the start-up bound.
  try:
    with startup_lib.bounded_startup(info, o.startup_timeout_seconds):
      strategy = tf.distribute.MultiWorkerMirroredStrategy(
          cluster_resolver=resolver_lib.resolver_for(info),
          communication_options=communication)
    introspect.record_of(strategy).clean_exit = clean_exit.arm(
        info, o.exit_timeout_seconds)
    _choose_transport(strategy, o)
    return strategy
  except tf.errors.UnavailableError as e:
    # The leader ended (its own start-up bound, a crash) while this task
    # waited for the cluster: name what is missing, as the bound would.
    raise StartupTimeoutError(
        startup_lib.leader_lost_message(info, str(e))) from None
  except tf.errors.OpError as e:
    if "grpc server" not in str(e).lower():
      raise
    raise ConfigError(
        field=f"cluster.{info.task_type}[{info.task_id}]", value=info.address,
        source=info.origin,
        expected="an address whose port this task can listen on",
        hint=f"Another program holds the port, or the host is not this "
             f"machine: pick free ports ({str(e).splitlines()[0][:160]})"
    ) from None
  except RuntimeError as e:
    if "program startup" not in str(e):
      raise
    raise ConfigError(
        field="multi_worker_mirrored", value="built after TensorFlow started",
        expected="make_strategy called before any other TensorFlow op",
        source="this process",
        hint="Build the strategy first thing in the program "
             "(tensorflow/tensorflow#55178)") from None


def _build_parameter_server(o: opts.ParameterServerOptions,
                            info: ClusterInfo) -> Strategy:
  for job in ("ps", "worker", "chief"):
    if not info.cluster.get(job):
      raise ConfigError(
          field=f"cluster.{job}", value=dict(info.cluster), source=info.origin,
          expected=f"at least one {job} task for parameter_server",
          hint=("Start the cluster with tfdist launch --ps N --chief, or give "
                "SLURM roles such as {'chief': 1, 'ps': 1, 'worker': 2}"))
  info = names_lib.resolve_names(info)
  if info.task_type in ("ps", "worker"):
    # The same script runs on every task: these serve the chief, then end.
    logging.info("tfdist: %s:%s serves the chief until it finishes",
                 info.task_type, info.task_id)
    server_lib.serve(info)
    server_lib.end_served(info)
  if info.task_type != "chief":
    raise ConfigError(
        field="task.type", value=info.task_type, source=info.origin,
        expected="chief, ps or worker for parameter_server")
  num_ps = info.num_ps
  partitioners = tf.distribute.experimental.partitioners
  partitioner = {
      "none": lambda: None,
      "min_size": lambda: partitioners.MinSizePartitioner(
          min_shard_bytes=o.min_shard_bytes, max_shards=o.max_shards or num_ps),
      "max_size": lambda: partitioners.MaxSizePartitioner(
          max_shard_bytes=o.max_shard_bytes, max_shards=o.max_shards),
      "fixed": lambda: partitioners.FixedShardsPartitioner(o.num_shards),
  }[o.variable_partitioner]()
  strategy = tf.distribute.experimental.ParameterServerStrategy(
      resolver_lib.resolver_for(info), variable_partitioner=partitioner)
  server_lib.linger_at_exit()  # So every ps and worker sees it come and go.
  return strategy


#: `catalog.BUILT_NAMES` -> builder; the options come from the catalog.
_BUILDERS: Mapping[str, _Builder] = {
    "default": _build_default,
    "one_device": _build_one_device,
    "mirrored": _build_mirrored,
    "multi_worker_mirrored": _build_multi_worker_mirrored,
    "central_storage": _build_central_storage,
    "parameter_server": _build_parameter_server,
    "tpu": tpu_builder.build_tpu,
}


def choose_strategy(info: ClusterInfo,
                    devices: Mapping[str, int] | None = None) -> tuple[str, str]:
  """Applies the ``auto`` table.

  Args:
    info: the resolved cluster.
    devices: local device counts; read from this machine by default.

  Returns:
    ``(name, why)``: the builder's name and the table row that chose it.
  """
  if info.source == "tpu":
    return "tpu", f"a TPU was found: {info.origin}"
  if info.num_ps and info.task_type != "evaluator":
    return "parameter_server", f"the cluster has {info.num_ps} ps task(s)"
  if info.num_workers > 1 and info.task_type in ("chief", "worker"):
    return ("multi_worker_mirrored",
            f"the cluster has {info.num_workers} chief/worker tasks")
  gpus = (local_lib.local_devices() if devices is None else devices).get("GPU", 0)
  if gpus > 1:
    return "mirrored", f"one process with {gpus} GPUs"
  if gpus == 1:
    return "one_device", "one process with 1 GPU"
  return "default", "one process with no GPU"


def options_for(name: str, values: Mapping[str, Any]) -> Any:
  """Builds the options dataclass of builder ``name`` from keyword values."""
  spec = _spec(name)
  _check_options(name, values)
  return spec.options(**values)


def install_keras_hooks(names: tuple[str, ...] | None = None) -> None:
  """Installs tfdist's corrections and hooks on Keras (idempotent): the
  chief rule, refusals as `tfdist.ConfigError`, gradients by the strategy's
  transport and the optimizer's `GradientOptions`; all, or those ``names``
  (`tfdist._compat.keras.FIXES`, `tfdist.strategy.keras_hooks.HOOKS`)."""
  keras_compat.apply(names, host=keras_compat.Host(
      refusal=ConfigError, hooks=keras_hooks.HOOKS))


def make_strategy(name: str = "auto", *,
                  cluster: resolve_lib.ClusterLike | None = None,
                  **options: Any) -> Strategy:
  """Builds a `tf.distribute.Strategy` for wherever this process runs.

  Args:
    name: one of `STRATEGY_NAMES`; ``auto`` follows the table in this
      module's docstring.
    cluster: the cluster; resolved with `tfdist.resolve_cluster` when omitted
      (explicit > TF_CONFIG > SLURM > TPU > local).
    **options: fields of the chosen builder's options dataclass (e.g.
      ``timeout_seconds=`` for ``multi_worker_mirrored``). With ``auto``,
      options that belong to a builder ``auto`` did not choose are ignored.

  Returns:
    The strategy. Never ``None``: with nothing to distribute over it is the
    default strategy.

  Raises:
    ConfigError: an unknown name or option, a cluster that cannot serve
      the strategy (e.g. ``parameter_server`` without ps tasks), or an
      unusable ``TFDIST_TRANSPORT`` or ``TFDIST_RING_PORTS``.
    TpuUnavailableError: ``tpu`` was asked for and no TPU answered.

  Example:
    >>> strategy = make_strategy("auto")
    >>> with strategy.scope():
    ...   model = build_model()
  """
  # Every strategy tfdist builds runs Keras 3's trainer with its corrections;
  # what cannot be corrected is refused with a ConfigError, and Keras's
  # writing callbacks write from the chief that tfdist's one rule names.
  install_keras_hooks()
  _flight.watch()  # Where tfdist launch asked: dumps while the rest waits.
  # From here until training watches signals, nothing can be saved: SIGTERM
  # and SIGUSR1 exit 42 at once, saying so.
  startup_lib.install_stop_handlers()
  if name not in STRATEGY_NAMES:
    raise ConfigError(field="strategy", value=name, source="make_strategy",
                      expected=f"one of {list(STRATEGY_NAMES)}")
  problems = transport_lib.environment_problems()
  if problems:  # Whatever the strategy: the user meant something by them.
    raise next(iter(problems.values()))
  info = resolve_lib.resolve_cluster(cluster)
  if name == "auto":
    _check_options(name, options)
    name, _ = choose_strategy(info)
    fields = catalog.option_fields(name)
    options = {k: v for k, v in options.items() if k in fields}
  built = options_for(name, options)
  if catalog.CATALOG[name].one_process:
    _single_process_only(name, info)
  strategy = _BUILDERS[name](built, info)
  startup_lib.install_stop_handlers()  # TensorFlow may have set its own.
  introspect.record_task(strategy, info)
  return strategy


def _spec(name: str) -> catalog.StrategySpec:
  if name not in catalog.BUILT_NAMES:
    raise ConfigError(field="strategy", value=name, source="make_strategy",
                      expected=f"one of {sorted(catalog.BUILT_NAMES)}")
  return catalog.CATALOG[name]


def _check_options(name: str, values: Mapping[str, Any]) -> None:
  fields = catalog.option_fields(name)
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(
        field="option", value=unknown[0], source=f"make_strategy({name!r})",
        expected=(f"one of {sorted(fields)}" if fields else
                  f"no options: {name} takes none"))


def _single_process_only(name: str, info: ClusterInfo) -> None:
  """Refuses a `catalog` ``one_process`` strategy inside a cluster.

  The evaluator is one process beside the training cluster: any fits it.
  """
  if info.task_type != "evaluator" and (info.num_workers > 1 or info.num_ps):
    raise ConfigError(
        field="strategy", value=name, source=info.origin,
        expected="a single-process strategy only without a multi-task cluster",
        hint="This process belongs to a cluster of "
             f"{dict((k, len(v)) for k, v in info.cluster.items())} tasks: use "
             "multi_worker_mirrored or parameter_server, or 'default' to "
             "opt out")


def _check_devices(field: str, devices) -> None:
  """Rejects device names this process does not have."""
  have = {(d.device_type, _index(d.name)) for d in tf.config.list_logical_devices()}
  for device in devices:
    try:
      spec = tf.DeviceSpec.from_string(device)
    except ValueError:
      spec = None
    if spec is None or (spec.device_type or "").upper() not in ("CPU", "GPU", "TPU"):
      raise ConfigError(field=field, value=device, source="make_strategy options",
                        expected="a device name such as '/gpu:0' or '/cpu:1'")
    key = (spec.device_type.upper(), spec.device_index or 0)
    if key not in have:
      raise ConfigError(
          field=field, value=device, source="make_strategy options",
          expected=f"one of this process's devices {sorted(f'/{t.lower()}:{i}' for t, i in have)}")


def _index(name: str) -> int:
  return int(name.rsplit(":", 1)[1])
