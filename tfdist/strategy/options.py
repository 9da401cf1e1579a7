"""Typed, frozen options for each strategy builder.

Every field is keyword-only and validated on construction, so a typo or an
impossible value fails before TensorFlow starts anything. Which strategy takes
which dataclass is written in `tfdist.strategy.catalog`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist.cluster import tpu as tpu_lib
from tfdist.errors import ConfigError
from tfdist.strategy.gradient_options import TRANSPORTS as GRADIENT_TRANSPORTS

__all__ = ["DefaultOptions", "OneDeviceOptions", "MirroredOptions",
           "MultiWorkerMirroredOptions", "ParameterServerOptions",
           "CentralStorageOptions", "TPUOptions", "CROSS_DEVICE_OPS",
           "COLLECTIVE_IMPLEMENTATIONS", "GRADIENT_TRANSPORTS",
           "VARIABLE_PARTITIONERS"]

_SOURCE = "make_strategy options"

#: MirroredStrategy's cross-device reductions.
CROSS_DEVICE_OPS = ("nccl", "hierarchical_copy", "reduction_to_one_device")
#: MultiWorkerMirroredStrategy's collective implementations.
COLLECTIVE_IMPLEMENTATIONS = ("auto", "ring", "nccl")
#: ParameterServerStrategy's variable partitioners.
VARIABLE_PARTITIONERS = ("none", "min_size", "fixed", "max_size")


def _one_of(field: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected=f"one of {sorted(choices)}")


def _positive_int(field: str, value: Any, *, allow_zero: bool = False) -> None:
  ok = isinstance(value, int) and not isinstance(value, bool)
  if not ok or value < (0 if allow_zero else 1):
    raise ConfigError(
        field=field, value=value, source=_SOURCE,
        expected="a non-negative integer" if allow_zero else
        "a positive integer")


def _devices(field: str, value: Any) -> tuple[str, ...] | None:
  if value is None:
    return None
  if isinstance(value, str) or not all(isinstance(d, str) and d for d in value):
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected="a list of device names such as ['/gpu:0']")
  if not value:
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected="at least one device")
  return tuple(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DefaultOptions:
  """The default strategy takes no options."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneDeviceOptions:
  """Options for `tf.distribute.OneDeviceStrategy`.

  Attributes:
    device: the device; the first GPU if there is one, else ``/cpu:0``.
  """
  device: str | None = None

  def __post_init__(self):
    if self.device is not None and not (isinstance(self.device, str)
                                        and self.device):
      raise ConfigError(field="device", value=self.device, source=_SOURCE,
                        expected="a device name such as '/gpu:0'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MirroredOptions:
  """Options for `tf.distribute.MirroredStrategy`.

  Attributes:
    devices: the replicas' devices; all GPUs (or the CPU) by default.
    num_gpus: use GPUs 0..num_gpus-1; exclusive with ``devices``.
    cross_device_ops: one of `CROSS_DEVICE_OPS`; TensorFlow picks by default
      (NCCL on GPUs).
    num_packs: gradient packs for nccl and hierarchical_copy.
  """
  devices: tuple[str, ...] | None = None
  num_gpus: int | None = None
  cross_device_ops: str | None = None
  num_packs: int = 1

  def __post_init__(self):
    object.__setattr__(self, "devices", _devices("devices", self.devices))
    if self.num_gpus is not None:
      _positive_int("num_gpus", self.num_gpus, allow_zero=True)
      if self.devices is not None:
        raise ConfigError(field="num_gpus", value=self.num_gpus,
                          source=_SOURCE,
                          expected="num_gpus or devices, not both")
    if self.cross_device_ops is not None:
      _one_of("cross_device_ops", self.cross_device_ops, CROSS_DEVICE_OPS)
    _positive_int("num_packs", self.num_packs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiWorkerMirroredOptions:
  """Options for `tf.distribute.MultiWorkerMirroredStrategy`.

  Attributes:
    implementation: collective implementation, one of
      `COLLECTIVE_IMPLEMENTATIONS`.
    bytes_per_pack: pack gradients into all-reduces of about this size;
      0 lets TensorFlow decide.
    timeout_seconds: fail a collective that takes longer than this, with a
      `tfdist.WorkerLostError` naming it, instead of hanging on a stopped or
      straggling peer. ``None`` waits forever (TensorFlow's default).
    num_workers: the number of workers you expect; a cluster of another size
      is an error rather than a silent single-replica run.
    startup_timeout_seconds: how long building the strategy may wait for
      every task to join; past it the process prints the tasks not answering
      and their addresses and is killed (SIGKILL, status 137). ``None`` waits
      forever.
    exit_timeout_seconds: at a clean end (exit status 0) every task waits
      for the others, at most this long, so that none leaves while another
      still talks to the coordination service (`tfdist.strategy.clean_exit`);
      any other end leaves at once. ``None`` always leaves at once.
    transport: what carries the gradients of Keras optimizers (``fit``,
      `tfdist.fit`, `tfdist.Runner`), one of `GRADIENT_TRANSPORTS`:
      ``collective`` (TensorFlow's), ``socket`` (tfdist's ring over TCP), or
      ``auto``, the rule of `tfdist.strategy.transport` (the socket ring
      for CPU workers with a job secret). ``auto`` defers to the
      ``TFDIST_TRANSPORT`` environment variable when it is set.
  """
  implementation: str = "auto"
  bytes_per_pack: int = 0
  timeout_seconds: float | None = 300.0
  num_workers: int | None = None
  startup_timeout_seconds: float | None = 300.0
  exit_timeout_seconds: float | None = 60.0
  transport: str = "auto"

  def __post_init__(self):
    _one_of("implementation", self.implementation, COLLECTIVE_IMPLEMENTATIONS)
    _one_of("transport", self.transport, GRADIENT_TRANSPORTS)
    _positive_int("bytes_per_pack", self.bytes_per_pack, allow_zero=True)
    for name in ("timeout_seconds", "startup_timeout_seconds",
                 "exit_timeout_seconds"):
      value = getattr(self, name)
      if value is not None and not (
          isinstance(value, (int, float)) and not isinstance(value, bool)
          and value > 0):
        raise ConfigError(field=name, value=value, source=_SOURCE,
                          expected="a positive number of seconds or None")
    if self.num_workers is not None:
      _positive_int("num_workers", self.num_workers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParameterServerOptions:
  """Options for `tf.distribute.experimental.ParameterServerStrategy`.

  Attributes:
    variable_partitioner: one of `VARIABLE_PARTITIONERS`: ``min_size``
      shards variables into pieces of at least ``min_shard_bytes``,
      ``max_size`` into pieces of at most ``max_shard_bytes``, ``fixed``
      into ``num_shards``.
    min_shard_bytes: for ``min_size``.
    max_shard_bytes: for ``max_size``.
    max_shards: upper bound on shards for ``min_size`` and ``max_size``;
      by default the number of ps tasks.
    num_shards: for ``fixed``.
  """
  variable_partitioner: str = "none"
  min_shard_bytes: int = 256 << 10
  max_shard_bytes: int = 256 << 20
  max_shards: int | None = None
  num_shards: int = 1

  def __post_init__(self):
    _one_of("variable_partitioner", self.variable_partitioner,
            VARIABLE_PARTITIONERS)
    _positive_int("min_shard_bytes", self.min_shard_bytes)
    _positive_int("max_shard_bytes", self.max_shard_bytes)
    _positive_int("num_shards", self.num_shards)
    if self.max_shards is not None:
      _positive_int("max_shards", self.max_shards)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CentralStorageOptions:
  """Options for `tf.distribute.experimental.CentralStorageStrategy`.

  Attributes:
    compute_devices: where replicas compute; all GPUs (or the CPU) by default.
    parameter_device: where variables live; the CPU by default when there
      are several compute devices.
  """
  compute_devices: tuple[str, ...] | None = None
  parameter_device: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "compute_devices",
                       _devices("compute_devices", self.compute_devices))
    if self.parameter_device is not None and not (
        isinstance(self.parameter_device, str) and self.parameter_device):
      raise ConfigError(field="parameter_device", value=self.parameter_device,
                        source=_SOURCE, expected="a device name such as '/cpu:0'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPUOptions:
  """Options for `tf.distribute.TPUStrategy`.

  Attributes:
    tpu: ``local`` on a TPU VM (Colab, Kaggle), a TPU name, or
      ``grpc://host:port``; detected from the environment by default.
    zone: the Cloud zone of a named TPU.
    project: the Cloud project of a named TPU.
    connect_timeout_seconds: how long to wait for a remote TPU's address to
      accept a connection before giving up.
  """
  tpu: str | None = None
  zone: str | None = None
  project: str | None = None
  connect_timeout_seconds: float = 10.0

  def __post_init__(self):
    if self.tpu is not None:
      object.__setattr__(self, "tpu", tpu_lib.normalize_tpu(self.tpu))
    if not (isinstance(self.connect_timeout_seconds, (int, float))
            and self.connect_timeout_seconds > 0):
      raise ConfigError(field="connect_timeout_seconds",
                        value=self.connect_timeout_seconds, source=_SOURCE,
                        expected="a positive number of seconds")
