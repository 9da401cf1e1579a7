"""The strategy flags Model Garden users know, for absl programs.

`define_flags` defines them on a `flags.FlagValues` (``flags.FLAGS`` by
default) with validators, so a combination that cannot work fails at parse
time with a message naming the flag; `strategy_from_flags` builds the
strategy with `tfdist.make_strategy`. Nothing here writes ``os.environ`` or
changes a flag's value. Every flag Model Garden defines is accepted at its
default (``--num_packs=1``, ``--tpu=''``, ``--task_index=-1``,
``--dtype=fp32``) with Model Garden's meaning; a value Model Garden's
``get_distribution_strategy`` ignores is ignored too, said in one
``tfdist: note:`` line on stderr. What each ``--strategy`` accepts is read from
`tfdist.strategy.catalog`, the table the factory reads too.
The flags and an example are in the README.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from typing import Any, Callable, Mapping, Sequence

from absl import flags

from tfdist.cluster import tpu as tpu_lib
from tfdist.cluster.slurm import parse_roles
from tfdist.cluster.tf_config import parse_tf_config
from tfdist.errors import ConfigError
from tfdist.errors import TpuUnavailableError
from tfdist.strategy import catalog
from tfdist.strategy.catalog import ALL_REDUCE_ALGS
from tfdist.strategy.catalog import STRATEGY_CHOICES

__all__ = ["FlagHolders", "StrategyConfig", "TrainingOptions",
           "STRATEGY_CHOICES", "ALL_REDUCE_ALGS", "MIXED_PRECISION_POLICIES",
           "DTYPES", "define_flags", "parse_flags", "run", "strategy_config",
           "cluster_from_flags", "strategy_from_flags", "training_options",
           "apply_mixed_precision"]

FlagValues = flags.FlagValues
_FLAGS = flags.FLAGS

#: The specs that take ``--all_reduce_alg``, in `STRATEGY_CHOICES` order.
_ALL_REDUCE_SPECS = tuple(s for s in catalog.CATALOG.values()
                          if s.all_reduce)

#: --mixed_precision value -> Keras policy (None: leave the policy alone).
MIXED_PRECISION_POLICIES: Mapping[str, str | None] = types.MappingProxyType({
    "none": None, "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"})
#: Model Garden's ``--dtype`` -> ``--mixed_precision``.
DTYPES: Mapping[str, str] = types.MappingProxyType({
    "fp32": "none", "fp16": "float16", "bf16": "bfloat16"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlagHolders:
  """The holders `define_flags` returns; read them with ``.value``."""
  strategy: flags.FlagHolder
  num_gpus: flags.FlagHolder
  all_reduce_alg: flags.FlagHolder
  tpu: flags.FlagHolder
  worker_hosts: flags.FlagHolder
  task_index: flags.FlagHolder
  slurm_roles: flags.FlagHolder
  mixed_precision: flags.FlagHolder
  jit_compile: flags.FlagHolder
  steps_per_execution: flags.FlagHolder


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyConfig:
  """What `strategy_from_flags` passes to `tfdist.make_strategy`.

  Attributes:
    name: the `make_strategy` name (``off`` becomes ``default``).
    options: keyword options for the builder's options dataclass.
    cluster: the TF_CONFIG-shaped JSON from ``--worker_hosts`` and
      ``--task_index``, or ``None`` to resolve the cluster as usual.
    slurm_roles: SLURM roles in rank order, or ``None``.
  """
  name: str
  options: Mapping[str, Any]
  cluster: str | None = None
  slurm_roles: Mapping[str, int] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingOptions:
  """The training flags, as values for the training code.

  Attributes:
    mixed_precision: ``none``, ``float16`` or ``bfloat16``.
    jit_compile: compile steps with XLA.
    steps_per_execution: training steps per ``tf.function`` call.
  """
  mixed_precision: str = "none"
  jit_compile: bool = False
  steps_per_execution: int = 1
  loss_scale: str | None = None

  def loss_scale_optimizer(self, optimizer):
    """``optimizer`` wrapped for ``--loss_scale``, or as it is.

    Keras 3 wraps the optimizer of a ``mixed_float16`` model in a dynamic
    ``LossScaleOptimizer`` by itself, so ``dynamic`` (and no flag) changes
    nothing. A number N starts the scale at N and never raises it; Keras 3
    has no fixed loss scale, so it still halves on a step whose gradients
    overflow (Model Garden's fixed scale would skip nothing).
    """
    if self.loss_scale in (None, "dynamic"):
      return optimizer
    import keras  # pylint: disable=g-import-not-at-top
    return keras.optimizers.LossScaleOptimizer(
        optimizer, initial_scale=float(self.loss_scale),
        dynamic_growth_steps=2**31 - 1)

  @property
  def policy(self) -> str | None:
    """The Keras mixed-precision policy, or ``None`` for ``none``."""
    return MIXED_PRECISION_POLICIES[self.mixed_precision]

  def compile_kwargs(self) -> dict[str, Any]:
    """``jit_compile`` and ``steps_per_execution`` for ``Model.compile``."""
    return {"jit_compile": self.jit_compile,
            "steps_per_execution": self.steps_per_execution}


def define_flags(flag_values: FlagValues = _FLAGS, *,
                 default_strategy: str = "auto") -> FlagHolders:
  """Defines the strategy and training flags, with their validators.

  Args:
    flag_values: where to define them; tests pass a fresh
      ``flags.FlagValues()``.
    default_strategy: ``--strategy``'s default, one of `STRATEGY_CHOICES`;
      a script written for one strategy names it, so a cluster that does not
      fit fails clearly instead of running another strategy.

  Returns:
    The `FlagHolders`.

  Raises:
    flags.DuplicateFlagError: the flags are already defined there.
  """
  fv = flag_values
  holders = FlagHolders(
      strategy=flags.DEFINE_enum(
          "strategy", default_strategy, STRATEGY_CHOICES,
          "Distribution strategy; 'auto' picks one from the cluster (TF_CONFIG,"
          " SLURM, TPU) and the local devices, 'off' is the default strategy.",
          flag_values=fv, case_sensitive=False),
      num_gpus=flags.DEFINE_integer(
          "num_gpus", None, "GPUs to use (one_device: 0 or 1; mirrored, "
          "central_storage: 0..N, 0 meaning the CPU; -1 or unset: all). "
          "Multi-worker, parameter-server and TPU strategies use every "
          "device a task sees and ignore it, as Model Garden does.",
          lower_bound=-1, flag_values=fv),
      all_reduce_alg=flags.DEFINE_enum(
          "all_reduce_alg", None, ALL_REDUCE_ALGS,
          "Gradient all-reduce. " + "; ".join(
              f"{s.name}: {', '.join(s.all_reduce)}"
              for s in _ALL_REDUCE_SPECS) + ". Default: TensorFlow's choice.",
          flag_values=fv),
      tpu=flags.DEFINE_string(
          "tpu", None, "TPU: 'local' (or '', as in Model Garden) on a TPU VM, "
          "a TPU name, or grpc://host:port; ignored by non-TPU strategies.",
          flag_values=fv),
      worker_hosts=flags.DEFINE_string(
          "worker_hosts", None, "Comma-separated host:port of every worker; "
          "an explicit cluster instead of TF_CONFIG or SLURM.",
          flag_values=fv),
      task_index=flags.DEFINE_integer(
          "task_index", None, "This worker's index in --worker_hosts "
          "(0 when there is one host; -1, Model Garden's default: unset).",
          flag_values=fv),
      slurm_roles=flags.DEFINE_string(
          "slurm_roles", None, "Roles of the srun step's ranks in rank order,"
          " e.g. chief=1,ps=1,worker=2. Default: every rank is a worker.",
          flag_values=fv),
      mixed_precision=flags.DEFINE_enum(
          "mixed_precision", "none", tuple(MIXED_PRECISION_POLICIES),
          "Keras mixed precision, set by apply_mixed_precision().",
          flag_values=fv),
      jit_compile=flags.DEFINE_bool(
          "jit_compile", False, "Compile training steps with XLA.",
          flag_values=fv),
      steps_per_execution=flags.DEFINE_integer(
          "steps_per_execution", 1, "Training steps per tf.function call.",
          lower_bound=1, flag_values=fv),
  )
  flags.DEFINE_enum(
      "dtype", None, tuple(DTYPES),
      "Model Garden's precision flag: fp16 and bf16 set the mixed-precision "
      "policy as --mixed_precision=float16 / bfloat16 do.", flag_values=fv)
  flags.DEFINE_string(
      "loss_scale", None, "fp16 only: 'dynamic' (Keras's default) or a "
      "positive starting loss scale.", flag_values=fv)
  flags.DEFINE_integer(
      "num_packs", 1, "Gradient packs of mirrored's nccl or "
      "hierarchical_copy all-reduce; ignored elsewhere, as in Model Garden.",
      lower_bound=1, flag_values=fv)
  flags.DEFINE_string("tpu_zone", None, "The Cloud zone of a named --tpu.",
                      flag_values=fv)
  flags.DEFINE_string("tpu_project", None,
                      "The Cloud project of a named --tpu.", flag_values=fv)
  flags.DEFINE_alias("distribution_strategy", "strategy", flag_values=fv)
  flags.DEFINE_alias("tpu_gcp_project", "tpu_project", flag_values=fv)
  flags.DEFINE_alias("enable_xla", "jit_compile", flag_values=fv)
  _register_validators(fv)
  return holders


# ------------------------------------------------------------ validators.


def _hosts(raw: str | None) -> list[str]:
  return [] if raw is None else [h.strip() for h in raw.split(",")]


def _worker_cluster(hosts: Sequence[str], index: int) -> dict[str, Any]:
  return {"cluster": {"worker": list(hosts)},
          "task": {"type": "worker", "index": index}}


def _check_worker_hosts(raw: str | None) -> bool:
  if raw is None:
    return True
  if not all(_hosts(raw)):
    raise flags.ValidationError(
        f"--worker_hosts={raw!r} has an empty entry; expected "
        "host:port,host:port")
  try:
    parse_tf_config(_worker_cluster(_hosts(raw), 0), source="--worker_hosts",
                    explicit=True)
  except ConfigError as e:
    raise flags.ValidationError(f"--worker_hosts={raw!r}: {e}") from None
  return True


def _check_task_index(values: Mapping[str, Any]) -> bool:
  raw, index = values["worker_hosts"], _task_index(values["task_index"])
  if raw is None:
    if index is not None:
      raise flags.ValidationError(
          f"--task_index={index} needs --worker_hosts: it is an index into "
          "that list")
    return True
  count = len(_hosts(raw))
  if index is None and count > 1:
    raise flags.ValidationError(
        f"--worker_hosts lists {count} hosts: set --task_index to this "
        f"process's index, 0..{count - 1}")
  if index is not None and not 0 <= index < count:
    raise flags.ValidationError(
        f"--task_index={index} is out of range: --worker_hosts lists "
        f"{count} host(s), so it must be 0..{count - 1}")
  return True


def _task_index(index: int | None) -> int | None:
  """``--task_index``, with Model Garden's -1 read as unset."""
  return None if index == -1 else index


def _check_tpu(raw: str | None) -> bool:
  if raw:  # '' is Model Garden's "no TPU named".
    try:
      tpu_lib.normalize_tpu(raw, source="--tpu")
    except ConfigError as e:
      raise flags.ValidationError(f"--tpu={raw!r}: {e}") from None
  return True


def _check_slurm_roles(raw: str | None) -> bool:
  if raw is not None:
    try:
      parse_roles(raw, field="--slurm_roles", source="flags")
    except ConfigError as e:
      raise flags.ValidationError(str(e)) from None
  return True


def _check_num_gpus(values: Mapping[str, Any]) -> bool:
  rule, n = catalog.lookup(values["strategy"]).gpus, values["num_gpus"]
  if n is None or n == -1 or rule is None:
    return True  # All GPUs; or ignored with a note (`strategy_config`).
  if rule.most is not None and n > rule.most:
    raise flags.ValidationError(
        f"--num_gpus={n} is too many for --strategy={values['strategy']}, "
        f"which uses at most {rule.most}; use --strategy=mirrored")
  return True


def _check_precision(values: Mapping[str, Any]) -> bool:
  dtype, policy = values["dtype"], values["mixed_precision"]
  if dtype is not None and policy != "none" and DTYPES[dtype] != policy:
    raise flags.ValidationError(
        f"--dtype={dtype} and --mixed_precision={policy} disagree; give one "
        f"of them (--dtype={dtype} means --mixed_precision={DTYPES[dtype]})")
  scale = values["loss_scale"]
  if scale is None:
    return True
  if scale != "dynamic":
    try:
      ok = float(scale) > 0 and float(scale) != float("inf")
    except ValueError:
      ok = False
    if not ok:
      raise flags.ValidationError(
          f"--loss_scale={scale!r}: expected 'dynamic' or a positive number")
  return True  # Without fp16 it is ignored, with a note (`_ignored`).


def _check_tpu_place(values: Mapping[str, Any]) -> bool:
  for flag in ("tpu_zone", "tpu_project"):
    if values[flag] is not None and values["tpu"] is None:
      raise flags.ValidationError(
          f"--{flag}={values[flag]!r} names where a TPU named by --tpu is; "
          "add --tpu=NAME")
  return True


def _check_all_reduce_alg(values: Mapping[str, Any]) -> bool:
  spec, alg = catalog.lookup(values["strategy"]), values["all_reduce_alg"]
  # A strategy that takes none ignores it, with a note (`_ignored`).
  if alg is not None and spec.all_reduce and alg not in spec.all_reduce:
    raise flags.ValidationError(
        f"--all_reduce_alg={alg} does not apply to "
        f"--strategy={values['strategy']}; it takes "
        + ", ".join(sorted(spec.all_reduce)))
  return True


def _check_strategy_tpu(values: Mapping[str, Any]) -> bool:
  if not values["tpu"] or not catalog.lookup(values["strategy"]).tpu:
    return True  # Ignored by the others, with a note (`_ignored`).
  if values["worker_hosts"] is not None or values["slurm_roles"] is not None:
    raise flags.ValidationError(
        "--tpu names the whole cluster; drop --worker_hosts and "
        "--slurm_roles")
  return True


def _check_strategy_hosts(values: Mapping[str, Any]) -> bool:
  raw, name = values["worker_hosts"], values["strategy"]
  spec = catalog.lookup(name)
  limit = spec.max_hosts
  if raw is None or limit is None or len(_hosts(raw)) <= limit:
    return True
  if limit == 0:
    raise flags.ValidationError(
        f"--worker_hosts does not apply to --strategy={name}: "
        f"{spec.no_hosts_reason}")
  raise flags.ValidationError(
      f"--worker_hosts lists {len(_hosts(raw))} hosts but --strategy={name} "
      "runs in one process; use --strategy=multi_worker_mirrored or auto")


def _check_roles(values: Mapping[str, Any]) -> bool:
  raw, name = values["slurm_roles"], values["strategy"]
  if raw is None:
    return True
  if values["worker_hosts"] is not None:
    raise flags.ValidationError(
        "--slurm_roles and --worker_hosts both describe the cluster; give "
        "one of them")
  try:
    has_ps = bool(parse_roles(raw).get("ps"))
  except ConfigError:
    return True  # _check_slurm_roles reports it.
  takers = [s.name for s in catalog.CATALOG.values() if s.roles]
  why = {
      "": "it runs in one process; --slurm_roles is for "
          f"{', '.join(takers[:-1])} and {takers[-1]}",
      "ps": "" if has_ps else "parameter_server needs ps tasks, e.g. "
            "chief=1,ps=1,worker=2",
      "no_ps": "ps tasks need --strategy=parameter_server or auto"
               if has_ps else "",
      "any": "",
  }[catalog.lookup(name).roles]
  if why:
    raise flags.ValidationError(
        f"--slurm_roles={raw!r} does not fit --strategy={name}: {why}")
  return True


def _register_validators(fv: FlagValues) -> None:
  for name, checker in (("worker_hosts", _check_worker_hosts),
                        ("tpu", _check_tpu),
                        ("slurm_roles", _check_slurm_roles)):
    flags.register_validator(name, checker, flag_values=fv)
  for names, checker in (
      (("worker_hosts", "task_index"), _check_task_index),
      (("strategy", "num_gpus"), _check_num_gpus),
      (("strategy", "all_reduce_alg"), _check_all_reduce_alg),
      (("strategy", "tpu", "worker_hosts", "slurm_roles"),
       _check_strategy_tpu),
      (("strategy", "worker_hosts"), _check_strategy_hosts),
      (("strategy", "slurm_roles", "worker_hosts"), _check_roles),
      (("dtype", "mixed_precision", "loss_scale"), _check_precision),
      (("tpu", "tpu_zone", "tpu_project"), _check_tpu_place)):
    flags.register_multi_flags_validator(list(names), checker, flag_values=fv)


# ------------------------------------------------------------ from flags.


def parse_flags(argv: Sequence[str], flag_values: FlagValues = _FLAGS
                ) -> list[str]:
  """Parses ``argv``; a bad flag prints one ``tfdist: ...`` line, exits 2.

  For ``app.run(main, flags_parser=tfdist.flags.parse_flags)``.

  Returns:
    The arguments that are not flags, program name first.
  """
  try:
    return flag_values(list(argv))
  except flags.Error as e:
    print(f"tfdist: {e}", file=sys.stderr)
    sys.exit(2)


def run(main: Callable[[list[str]], Any]) -> None:
  """``app.run(main)`` with tfdist's answers to bad input.

  A bad flag (`parse_flags`), and a `ConfigError` or `TpuUnavailableError`
  from ``main`` (a malformed TF_CONFIG or SLURM variable, a strategy that
  does not fit the cluster, a TPU that is not there), print one line
  ``tfdist: ...`` on stderr and exit with code 2, as the ``tfdist`` command
  does. Other errors keep their traceback.

  Args:
    main: the program's ``main(argv)``.
  """
  def guarded(argv):
    try:
      return main(argv)
    except (ConfigError, TpuUnavailableError) as e:
      print("tfdist: " + " ".join(str(e).split()), file=sys.stderr)
      sys.exit(2)

  from absl import app  # pylint: disable=g-import-not-at-top
  app.run(guarded, flags_parser=parse_flags)


def _ignored(fv: FlagValues, spec: catalog.StrategySpec) -> list[str]:
  """The flags given a value that ``spec`` ignores, as Model Garden's
  ``get_distribution_strategy`` does, each in one line."""
  alg, packs, tpu = (fv["all_reduce_alg"].value, fv["num_packs"].value,
                     fv["tpu"].value)
  gpus, scale = fv["num_gpus"].value, fv["loss_scale"].value
  precision = training_options(fv).mixed_precision
  ignored = {
      f"--num_gpus={gpus}": gpus not in (None, -1) and spec.gpus is None,
      f"--all_reduce_alg={alg}": alg is not None and not spec.all_reduce,
      f"--num_packs={packs}": packs != 1 and (
          spec.name != "mirrored" or alg not in ("nccl", "hierarchical_copy")),
      f"--tpu={tpu!r}": bool(tpu) and not spec.tpu,
      f"--loss_scale={scale}": scale is not None and precision != "float16",
  }
  return [f"{flag} is ignored by --strategy={fv['strategy'].value}"
          + (" (it applies to fp16 only)" if "loss_scale" in flag else "")
          for flag, yes in ignored.items() if yes]


def strategy_config(flag_values: FlagValues = _FLAGS) -> StrategyConfig:
  """Maps the parsed flags to a `make_strategy` call, without building it.

  A flag the strategy ignores, as Model Garden's ``get_distribution_strategy``
  does (``--num_packs`` without mirrored's nccl or hierarchical_copy, ``--tpu``
  without a TPU strategy, ...), is said in one ``tfdist: note:`` line.
  """
  fv = flag_values
  spec = catalog.lookup(fv["strategy"].value)
  for line in _ignored(fv, spec):
    print(f"tfdist: note: {line}, as in Model Garden", file=sys.stderr)
  options: dict[str, Any] = {}
  gpus = fv["num_gpus"].value
  if gpus not in (None, -1) and spec.gpus is not None:  # -1: all.
    options.update(spec.gpus.options(gpus))
  alg = fv["all_reduce_alg"].value
  if alg is not None and spec.all_reduce:
    field, value = spec.all_reduce[alg]
    options[field] = value
    if (spec.name == "mirrored" and alg in ("nccl", "hierarchical_copy")
        and fv["num_packs"].value != 1):  # 1: the options' default.
      options["num_packs"] = fv["num_packs"].value
  builder = spec.name
  tpu = fv["tpu"].value
  if spec.tpu and (tpu or (tpu == "" and spec.name == "tpu")):
    builder = "tpu"  # --tpu with auto means a TPU.
    options["tpu"] = tpu or "local"  # '': Model Garden's local TPU.
    for flag, field in (("tpu_zone", "zone"), ("tpu_project", "project")):
      if fv[flag].value is not None:
        options[field] = fv[flag].value
  cluster = None
  if fv["worker_hosts"].value is not None:
    hosts = _hosts(fv["worker_hosts"].value)
    cluster = json.dumps(_worker_cluster(
        hosts, _task_index(fv["task_index"].value) or 0))
  roles = fv["slurm_roles"].value
  return StrategyConfig(
      name=builder, options=types.MappingProxyType(options), cluster=cluster,
      slurm_roles=(types.MappingProxyType(parse_roles(roles))
                   if roles is not None else None))


def cluster_from_flags(flag_values: FlagValues = _FLAGS):
  """The cluster the flags describe, resolved with `tfdist.resolve_cluster`.

  ``--worker_hosts`` wins; otherwise TF_CONFIG, then the srun step (with
  ``--slurm_roles``), then the local machine. ps and worker tasks of a
  parameter-server job pass it to `tfdist.serve`.

  Returns:
    A `tfdist.ClusterInfo`.
  """
  return _resolve(strategy_config(flag_values))


def _resolve(config: StrategyConfig):
  from tfdist.cluster import resolve  # pylint: disable=g-import-not-at-top
  return resolve.resolve_cluster(config.cluster, tpu=config.options.get("tpu"),
                                 slurm_roles=config.slurm_roles)


def strategy_from_flags(flag_values: FlagValues = _FLAGS):
  """Builds the `tf.distribute.Strategy` the flags ask for.

  Call it first thing in ``main``: multi-worker strategies must be built
  before any other TensorFlow op.

  Returns:
    The strategy, from `tfdist.make_strategy`.

  Raises:
    ConfigError: the cluster or machine cannot serve the strategy.
    TpuUnavailableError: a TPU was asked for and none answered.
  """
  from tfdist.strategy import factory  # pylint: disable=g-import-not-at-top
  config = strategy_config(flag_values)
  return factory.make_strategy(config.name, cluster=_resolve(config),
                               **config.options)


def training_options(flag_values: FlagValues = _FLAGS) -> TrainingOptions:
  """``--mixed_precision`` (or ``--dtype``), ``--loss_scale``,
  ``--jit_compile`` and ``--steps_per_execution``."""
  dtype = flag_values["dtype"].value
  return TrainingOptions(
      mixed_precision=(DTYPES[dtype] if dtype is not None
                       else flag_values["mixed_precision"].value),
      loss_scale=flag_values["loss_scale"].value,
      jit_compile=flag_values["jit_compile"].value,
      steps_per_execution=flag_values["steps_per_execution"].value)


def apply_mixed_precision(flag_values: FlagValues = _FLAGS) -> str:
  """Sets Keras's global policy from ``--mixed_precision``; returns its name.

  ``none`` leaves the policy as it is. Call it before building the model;
  parsing the flags alone changes nothing.
  """
  import keras  # pylint: disable=g-import-not-at-top
  policy = training_options(flag_values).policy
  if policy is not None:
    keras.mixed_precision.set_global_policy(policy)
  return keras.mixed_precision.global_policy().name
