"""What each strategy accepts, written once and read by flags and factory.

`CATALOG` holds one `StrategySpec` per `make_strategy` name: its options
dataclass, its other ``--strategy`` spellings, and what it accepts from the
flags (``--num_gpus``, ``--all_reduce_alg``, ``--worker_hosts``,
``--slurm_roles``, ``--tpu``). `tfdist.flags` validates and maps flags with
it; `tfdist.strategy.factory` takes its names and options from it and keeps
only the builders, which need TensorFlow. This module imports none, so
``tfdist --help`` and flag parsing stay light.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

from tfdist.errors import ConfigError
from tfdist.strategy import options as opts

__all__ = ["StrategySpec", "GpuRule", "CATALOG", "STRATEGY_NAMES",
           "BUILT_NAMES", "STRATEGY_CHOICES", "ALL_REDUCE_ALGS", "ROLE_RULES",
           "lookup", "gpu_devices", "option_fields"]

#: ``--slurm_roles`` acceptance: ``any``; ``ps`` (the roles must include ps
#: tasks); ``no_ps`` (they must not); ``""`` (the flag is not accepted).
ROLE_RULES = ("any", "ps", "no_ps", "")


def gpu_devices(num_gpus: int) -> tuple[str, ...]:
  """GPUs 0..num_gpus-1 as device names; ``("/cpu:0",)`` for 0."""
  return tuple(f"/gpu:{i}" for i in range(num_gpus)) or ("/cpu:0",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuRule:
  """How ``--num_gpus`` maps to a strategy's options.

  Attributes:
    options: ``--num_gpus`` -> keyword options of the options dataclass.
    most: the largest ``--num_gpus`` accepted; ``None``: any.
  """
  options: Callable[[int], Mapping[str, Any]]
  most: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategySpec:
  """What one strategy accepts.

  Attributes:
    name: the `make_strategy` name.
    options: its options dataclass; ``None`` for ``auto``, which builds
      another entry and takes any entry's options.
    aliases: other ``--strategy`` spellings of it (Model Garden's ``off``).
    one_process: the builder refuses to run inside a multi-task cluster.
    gpus: how ``--num_gpus`` maps to options; ``None``: not accepted.
    all_reduce: ``--all_reduce_alg`` value -> ``(option field, value)``.
    max_hosts: the most ``--worker_hosts`` entries; ``None``: any number.
    no_hosts_reason: why ``--worker_hosts`` does not apply, when
      ``max_hosts`` is 0.
    roles: ``--slurm_roles`` acceptance, one of `ROLE_RULES`.
    tpu: ``--tpu`` accepted.
  """
  name: str
  options: type | None
  aliases: tuple[str, ...] = ()
  one_process: bool = False
  gpus: GpuRule | None = None
  all_reduce: Mapping[str, tuple[str, str]] = dataclasses.field(
      default_factory=lambda: types.MappingProxyType({}))
  max_hosts: int | None = 1
  no_hosts_reason: str = ""
  roles: str = ""
  tpu: bool = False

  def __post_init__(self):
    if self.roles not in ROLE_RULES:
      raise ConfigError(field="roles", value=self.roles,
                        expected=f"one of {list(ROLE_RULES)}",
                        source=f"StrategySpec({self.name!r})")


def _all_reduce(field: str, values: tuple[str, ...]
                ) -> Mapping[str, tuple[str, str]]:
  return types.MappingProxyType({v: (field, v) for v in values})


_SPECS = (
    StrategySpec(name="auto", options=None, max_hosts=None, roles="any",
                 tpu=True),
    StrategySpec(name="default", options=opts.DefaultOptions,
                 aliases=("off",),
                 gpus=GpuRule(options=lambda n: {}, most=1)),
    StrategySpec(name="one_device", options=opts.OneDeviceOptions,
                 one_process=True,
                 gpus=GpuRule(options=lambda n: {"device": gpu_devices(n)[0]},
                              most=1)),
    StrategySpec(name="mirrored", options=opts.MirroredOptions,
                 one_process=True,
                 gpus=GpuRule(options=lambda n: {"num_gpus": n}),
                 all_reduce=_all_reduce("cross_device_ops",
                                        opts.CROSS_DEVICE_OPS)),
    StrategySpec(name="central_storage", options=opts.CentralStorageOptions,
                 one_process=True,
                 gpus=GpuRule(
                     options=lambda n: {"compute_devices": gpu_devices(n)})),
    StrategySpec(name="multi_worker_mirrored",
                 options=opts.MultiWorkerMirroredOptions, max_hosts=None,
                 roles="no_ps",
                 # "auto" is the option's default, not an algorithm to ask for.
                 all_reduce=_all_reduce("implementation", tuple(
                     a for a in opts.COLLECTIVE_IMPLEMENTATIONS
                     if a != "auto"))),
    StrategySpec(name="parameter_server", options=opts.ParameterServerOptions,
                 max_hosts=0, roles="ps",
                 no_hosts_reason=("it needs ps and chief tasks too; use "
                                  "TF_CONFIG, tfdist launch or --slurm_roles")),
    StrategySpec(name="tpu", options=opts.TPUOptions, max_hosts=0, tpu=True,
                 no_hosts_reason="a TPU strategy has no worker hosts"),
)

#: `make_strategy` name -> its `StrategySpec`.
CATALOG: Mapping[str, StrategySpec] = types.MappingProxyType(
    {spec.name: spec for spec in _SPECS})
_ALIASES: Mapping[str, str] = types.MappingProxyType(
    {alias: spec.name for spec in _SPECS for alias in spec.aliases})

#: Every name `make_strategy` accepts, sorted (``auto`` first).
STRATEGY_NAMES = tuple(sorted(CATALOG))
#: The names with a builder of their own: all but ``auto``.
BUILT_NAMES = tuple(n for n in STRATEGY_NAMES if CATALOG[n].options)
#: Every ``--strategy`` value, Model Garden's ``off`` included.
STRATEGY_CHOICES = tuple(sorted([*CATALOG, *_ALIASES]))
#: Every ``--all_reduce_alg`` value; which ones apply depends on --strategy.
ALL_REDUCE_ALGS = tuple(sorted({a for s in _SPECS for a in s.all_reduce}))


def lookup(name: str) -> StrategySpec:
  """The spec of a name or alias in `STRATEGY_CHOICES`.

  Raises:
    KeyError: ``name`` is neither.
  """
  return CATALOG[_ALIASES.get(name, name)]


def option_fields(name: str) -> frozenset[str]:
  """The option names ``name`` accepts; for ``auto``, every builder's."""
  specs = [lookup(name)] if lookup(name).options else [
      CATALOG[n] for n in BUILT_NAMES]
  return frozenset(f.name for s in specs
                   for f in dataclasses.fields(s.options))
