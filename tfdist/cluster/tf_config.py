"""Reads and checks TF_CONFIG, the JSON that multi-worker TensorFlow reads.

TensorFlow checks almost nothing (a missing port fails in C++, a duplicated
address hangs), so this module checks the whole document up front and raises one
`tfdist.errors.ConfigError` naming the field. It imports no TensorFlow.

The rules, in the order they are checked:

* The text is valid, non-empty JSON (the error gives line and column) with no
  key repeated in one object (JSON keeps the last one silently; the error
  names the key, not its path). Integers of thousands of digits and nesting
  deeper than Python's recursion limit are errors too, not tracebacks.
* The top level is an object whose keys are among ``cluster``, ``task``,
  ``rpc_layer``, ``environment`` and ``session_master``: the keys TensorFlow
  reads (``session_master`` only by TF1's ``TFConfigClusterResolver.master``).
  Any other key is rejected: it is almost always a typo.
* ``cluster`` is present and a non-empty object. Its job names are ``chief``,
  ``worker`` or ``ps``. ``evaluator`` is a task type only: the side-car
  evaluator is not part of the training cluster, so it may not be a job.
* Each job is a non-empty list of address strings. TensorFlow also accepts a
  dict ``{index: address}``; a dense one (keys exactly ``0`` .. ``n-1``) is
  read as a list, a sparse one is rejected, because tfdist's strategies need
  every task of a job.
* Every address is ``host:port``: the port is decimal in 1..65535, the host a
  DNS name (letters, digits, ``-`` and ``_``, labels of at most 63 characters),
  an IPv4 address, or an IPv6 address in brackets (``[::1]:2222``). No scheme
  (``grpc://``): the protocol goes in ``rpc_layer``.
* No address appears twice in the cluster (hosts compared case-insensitively
  and without a trailing dot, ports as numbers): two tasks on one address
  hang TensorFlow. Different spellings of one machine (``localhost`` and
  ``127.0.0.1``) are not detected.
* There is at most one chief. The cluster has a chief or a worker; a cluster
  with ``ps`` has at least one ``worker``, as ``ParameterServerStrategy``
  requires.
* ``task`` is present and an object with only the keys ``type`` and ``index``.
* ``task.type`` is a string naming a job in ``cluster``, or ``evaluator``.
* ``task.index`` is a non-negative integer below the number of tasks in that
  job (0 for the evaluator, as there is at most one). TensorFlow calls
  ``int()`` on it, so a string of decimal digits such as ``"1"`` is accepted
  and converted; booleans, floats and other strings are rejected.
* ``rpc_layer``, when given, is a non-empty protocol name such as ``grpc``;
  it defaults to ``grpc``. ``environment`` and ``session_master``, when given,
  are strings; they are checked but not kept.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any, Mapping

from tfdist.cluster.info import ClusterInfo
from tfdist.errors import ConfigError

__all__ = ["ENV_VAR", "TOP_LEVEL_KEYS", "CLUSTER_JOBS", "TASK_TYPES",
           "parse_tf_config", "from_environ", "dump_tf_config"]

#: The environment variable TensorFlow reads.
ENV_VAR = "TF_CONFIG"

#: Top-level keys TensorFlow reads from TF_CONFIG.
TOP_LEVEL_KEYS = ("cluster", "task", "rpc_layer", "environment",
                  "session_master")

#: Job names allowed in ``cluster``.
CLUSTER_JOBS = ("chief", "worker", "ps")

#: Values allowed for ``task.type``: the jobs, plus the side-car evaluator.
TASK_TYPES = CLUSTER_JOBS + ("evaluator",)

_TASK_KEYS = ("type", "index")
_DEFAULT_RPC_LAYER = "grpc"
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")
_PORT = re.compile(r"[0-9]{1,5}\Z")
_DECIMAL = re.compile(r"(0|[1-9][0-9]{0,17})\Z")  # Short: int() has limits.
_RPC_LAYER = re.compile(r"[a-z][a-z0-9+._-]*\Z")

_Config = Mapping[str, Any]


def parse_tf_config(config: str | Mapping[str, Any], *,
                    source: str = "TF_CONFIG from the environment",
                    explicit: bool = False) -> ClusterInfo:
  """Checks a TF_CONFIG document and returns the cluster it describes.

  Args:
    config: the JSON text, or the already-decoded dict.
    source: where the config came from, in words, for error messages; kept as
      `ClusterInfo.origin`.
    explicit: whether the caller passed the config explicitly (then
      `ClusterInfo.source` is ``"explicit"``, else ``"tf_config"``).

  Returns:
    A `ClusterInfo` with the cluster (job to a tuple of addresses), the task
    type and index, and the RPC layer.

  Raises:
    ConfigError: if the config breaks any rule in this module's docstring. Its
      ``field`` names the offending part, e.g. ``"TF_CONFIG task.index"``.
  """
  if isinstance(config, str):
    config = _decode(config, source)
  if not isinstance(config, Mapping):
    raise ConfigError(
        field=ENV_VAR, value=config, expected="a JSON object (a dict)",
        source=source,
        hint='Write it as {"cluster": {...}, "task": {...}}')
  _check_top_level_keys(config, source)
  cluster = _check_cluster(config, source)
  task_type, task_id = _check_task(config, cluster, source)
  rpc_layer = _check_rpc_layer(config, source)
  for key in ("environment", "session_master"):
    if key in config and not isinstance(config[key], str):
      raise ConfigError(field=f"{ENV_VAR} {key}", value=config[key],
                        expected="a string", source=source)
  return ClusterInfo(
      source="explicit" if explicit else "tf_config",
      cluster=cluster,
      task_type=task_type,
      task_id=task_id,
      rpc_layer=rpc_layer,
      origin=source)


def from_environ(environ: Mapping[str, str] | None = None
                ) -> ClusterInfo | None:
  """Reads TF_CONFIG from an environment mapping.

  Args:
    environ: the environment to read; `os.environ` when ``None``. It is never
      written.

  Returns:
    The parsed `ClusterInfo`, or ``None`` when TF_CONFIG is not set at all.

  Raises:
    ConfigError: if TF_CONFIG is set but invalid (empty is invalid).
  """
  if environ is None:
    import os  # Deferred so that the default is read at call time.
    environ = os.environ
  text = environ.get(ENV_VAR)
  if text is None:
    return None
  return parse_tf_config(text, source="TF_CONFIG from the environment")


def dump_tf_config(info: ClusterInfo) -> str:
  """The TF_CONFIG JSON text for one task of a cluster, for launchers.

  The text is parsed back before it is returned, so a launcher never hands a
  task a TF_CONFIG that tfdist (or TensorFlow) would refuse.

  Args:
    info: the cluster and the task to describe; it needs a ``task_type`` and a
      ``task_id``.

  Returns:
    Compact JSON with ``cluster``, ``task`` and, when it is not ``grpc``,
    ``rpc_layer``.

  Raises:
    ConfigError: if `info` has no task or describes an invalid cluster.
  """
  source = f"dump_tf_config of a cluster from {info.origin}"
  if info.task_type is None or info.task_id is None:
    raise ConfigError(
        field="ClusterInfo.task_type", value=info.task_type,
        expected="a task type and a task id to write into TF_CONFIG",
        source=source,
        hint="A single local process needs no TF_CONFIG")
  config: dict[str, Any] = {
      "cluster": {job: list(addrs) for job, addrs in info.cluster.items()},
      "task": {"type": info.task_type, "index": info.task_id},
  }
  if info.rpc_layer != _DEFAULT_RPC_LAYER:
    config["rpc_layer"] = info.rpc_layer
  text = json.dumps(config)
  parse_tf_config(text, source=source)
  return text


def _decode(text: str, source: str) -> Any:
  if not text.strip():
    raise ConfigError(
        field=ENV_VAR, value=text, expected="a JSON object, not empty text",
        source=source,
        hint="Unset TF_CONFIG for a single process, or set it to the cluster")
  try:
    return json.loads(text, object_pairs_hook=_no_duplicate_keys(source))
  except json.JSONDecodeError as e:
    raise ConfigError(
        field=ENV_VAR, value=text,
        expected=(f"valid JSON; {e.msg} at line {e.lineno} column {e.colno} "
                  f"(character {e.pos})"),
        source=source) from None
  except ConfigError:
    raise  # A repeated key, from the hook (ConfigError is a ValueError).
  except (ValueError, RecursionError) as e:
    # An integer of thousands of digits; arrays or objects nested too deep.
    raise ConfigError(
        field=ENV_VAR, value=text, source=source,
        expected=f"JSON that Python can read ({str(e).split(';')[0]})",
        hint="TF_CONFIG needs small numbers and two levels of nesting"
    ) from None


def _no_duplicate_keys(source: str):
  def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
      if key in seen:
        raise ConfigError(
            field=f"{ENV_VAR} key {key!r}", value=key,
            expected="each key at most once in a JSON object",
            source=source,
            hint="JSON would silently keep only the last value")
      seen[key] = value
    return seen
  return hook


def _check_top_level_keys(config: _Config, source: str) -> None:
  for key in config:
    if key not in TOP_LEVEL_KEYS:
      raise ConfigError(
          field=f"{ENV_VAR} key {key!r}", value=key,
          expected=f"one of the keys {', '.join(TOP_LEVEL_KEYS)}",
          source=source, hint="TensorFlow would silently ignore it")


def _check_cluster(config: _Config,
                   source: str) -> dict[str, tuple[str, ...]]:
  """Checks ``cluster`` and returns it as job -> tuple of addresses."""
  field = f"{ENV_VAR} cluster"
  if "cluster" not in config:
    raise ConfigError(field=field, source=source,
                      expected="an object mapping jobs to addresses")
  raw = config["cluster"]
  if not isinstance(raw, Mapping):
    raise ConfigError(field=field, value=raw,
                      expected="an object mapping jobs to addresses",
                      source=source)
  if not raw:
    raise ConfigError(field=field, value=raw, expected="at least one job",
                      source=source)
  cluster: dict[str, tuple[str, ...]] = {}
  for job, tasks in raw.items():
    if job == "evaluator":
      raise ConfigError(
          field=f"{field}.evaluator", value=tasks,
          expected="no evaluator job in cluster", source=source,
          hint=('The evaluator is a task type only: give it the training '
                'cluster and task {"type": "evaluator", "index": 0}'))
    if job not in CLUSTER_JOBS:
      raise ConfigError(
          field=f"{field}.{job}", value=job, source=source,
          expected=f"a job name, one of {', '.join(CLUSTER_JOBS)}")
    cluster[job] = _check_job(job, tasks, source)
  _check_duplicates(cluster, source)
  if len(cluster.get("chief", ())) > 1:
    raise ConfigError(field=f"{field}.chief", value=list(cluster["chief"]),
                      expected="at most one chief address", source=source,
                      hint="Make the others workers")
  if "ps" in cluster and "worker" not in cluster:
    raise ConfigError(
        field=f"{field}.worker", expected="at least one worker in a cluster "
        "with ps tasks, as ParameterServerStrategy requires", source=source)
  if "chief" not in cluster and "worker" not in cluster:
    raise ConfigError(field=f"{field}.worker",
                      expected="a chief or worker job to train on",
                      source=source)
  return cluster


def _check_job(job: str, tasks: Any, source: str) -> tuple[str, ...]:
  """Checks one job's tasks and returns its addresses in task order."""
  field = f"{ENV_VAR} cluster.{job}"
  if isinstance(tasks, Mapping):
    tasks = _dense_list(field, tasks, source)
  elif not isinstance(tasks, (list, tuple)):
    raise ConfigError(field=field, value=tasks,
                      expected='a list of "host:port" strings', source=source)
  if not tasks:
    raise ConfigError(field=field, value=tasks,
                      expected='at least one "host:port" address',
                      source=source, hint="Remove the job if it has no tasks")
  for i, address in enumerate(tasks):
    _check_address(f"{field}[{i}]", address, source)
  return tuple(tasks)


def _dense_list(field: str, tasks: Mapping[Any, Any], source: str) -> list:
  """A ``{index: address}`` job as a list, if its indices are 0..n-1."""
  by_index: dict[int, Any] = {}
  for key, address in tasks.items():
    if isinstance(key, bool) or not (
        isinstance(key, int) or (isinstance(key, str) and _DECIMAL.match(key))):
      raise ConfigError(field=f"{field} index", value=key,
                        expected="a task index (a non-negative integer)",
                        source=source)
    by_index[int(key)] = address
  if sorted(by_index) != list(range(len(by_index))):
    raise ConfigError(
        field=field, value=dict(tasks),
        expected=f"task indices 0 to {len(by_index) - 1} without gaps",
        source=source,
        hint="Sparse jobs are not supported; list every task's address")
  return [by_index[i] for i in range(len(by_index))]


def _check_address(field: str, address: Any, source: str) -> None:
  """Checks that `address` is ``host:port`` with a valid host and port."""
  expected = '"host:port" with a port in 1..65535'
  if not isinstance(address, str):
    raise ConfigError(field=field, value=address,
                      expected=f"a string {expected}", source=source)
  if "://" in address:
    raise ConfigError(field=field, value=address,
                      expected=f"{expected}, without a scheme", source=source,
                      hint='Put the protocol in "rpc_layer"')
  if address.startswith("["):
    host, sep, port = address[1:].partition("]:")
    if not sep or not _is_ipv6(host):
      raise ConfigError(field=field, value=address,
                        expected=f"{expected}, an IPv6 host as [address]:port",
                        source=source)
  else:
    host, sep, port = address.rpartition(":")
    if not sep:
      raise ConfigError(field=field, value=address,
                        expected=f"{expected}; there is no port",
                        source=source)
    if ":" in host:
      raise ConfigError(
          field=field, value=address, source=source,
          expected=f"{expected}: one colon, IPv6 hosts in brackets",
          hint="Write e.g. [::1]:2222")
    if not _is_hostname(host):
      raise ConfigError(
          field=field, value=address,
          expected=(f"{expected}; {host!r} is not a valid host name or "
                    "IPv4 address"),
          source=source)
  if not _PORT.match(port) or not 1 <= int(port) <= 65535:
    raise ConfigError(field=field, value=address,
                      expected=f"{expected}; the port is {port!r}",
                      source=source)


def _is_ipv6(host: str) -> bool:
  try:
    ipaddress.IPv6Address(host)
  except ValueError:
    return False
  return True


def _is_hostname(host: str) -> bool:
  if not host or len(host) > 253:
    return False
  labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
  if all(label.isdigit() for label in labels):
    # All-numeric names are IPv4 addresses and must be well formed.
    try:
      ipaddress.IPv4Address(host)
    except ValueError:
      return False
    return True
  return all(_LABEL.match(label) for label in labels)


def _check_duplicates(cluster: Mapping[str, tuple[str, ...]],
                      source: str) -> None:
  seen: dict[str, str] = {}
  for job, addresses in cluster.items():
    for i, address in enumerate(addresses):
      key = _normalized(address)
      where = f"cluster.{job}[{i}]"
      if key in seen:
        raise ConfigError(
            field=f"{ENV_VAR} {where}", value=address,
            expected=f"an address not already used by {seen[key]}",
            source=source,
            hint="Two tasks on one address make TensorFlow hang")
      seen[key] = where


def _normalized(address: str) -> str:
  """A checked address compared for duplicates: ``W0.:02222`` is ``w0:2222``."""
  host, _, port = address.rpartition(":")
  return f"{host.lower().rstrip('.')}:{int(port)}"


def _check_task(config: _Config, cluster: Mapping[str, tuple[str, ...]],
                source: str) -> tuple[str, int]:
  """Checks ``task`` and returns its type and index."""
  field = f"{ENV_VAR} task"
  expected_task = 'an object like {"type": "worker", "index": 0}'
  if "task" not in config:
    raise ConfigError(field=field, expected=expected_task, source=source)
  task = config["task"]
  if not isinstance(task, Mapping):
    raise ConfigError(field=field, value=task, expected=expected_task,
                      source=source)
  for key in task:
    if key not in _TASK_KEYS:
      raise ConfigError(field=f"{field} key {key!r}", value=key,
                        expected="only the keys type and index",
                        source=source)
  if "type" not in task:
    raise ConfigError(field=f"{field}.type", source=source,
                      expected=f"one of {', '.join(TASK_TYPES)}")
  task_type = task["type"]
  if not isinstance(task_type, str) or task_type not in TASK_TYPES:
    raise ConfigError(field=f"{field}.type", value=task_type, source=source,
                      expected=f"one of {', '.join(TASK_TYPES)}")
  if task_type != "evaluator" and task_type not in cluster:
    raise ConfigError(
        field=f"{field}.type", value=task_type, source=source,
        expected=f"a job in cluster ({', '.join(cluster)}) or evaluator")
  if "index" not in task:
    raise ConfigError(field=f"{field}.index", source=source,
                      expected="a non-negative integer")
  index = task["index"]
  if isinstance(index, str) and _DECIMAL.match(index):
    index = int(index)  # TensorFlow calls int() on it, so accept "1" too.
  if isinstance(index, bool) or not isinstance(index, int) or index < 0:
    raise ConfigError(field=f"{field}.index", value=task["index"],
                      expected="a non-negative integer", source=source)
  if task_type == "evaluator":
    if index != 0:
      raise ConfigError(field=f"{field}.index", value=task["index"],
                        expected="0, as there is at most one evaluator",
                        source=source)
  elif index >= len(cluster[task_type]):
    count = len(cluster[task_type])
    raise ConfigError(
        field=f"{field}.index", value=task["index"], source=source,
        expected=(f"an index below {count}, the number of entries in "
                  f"cluster.{task_type}"))
  return task_type, index


def _check_rpc_layer(config: _Config, source: str) -> str:
  if "rpc_layer" not in config:
    return _DEFAULT_RPC_LAYER
  rpc_layer = config["rpc_layer"]
  if not isinstance(rpc_layer, str) or not _RPC_LAYER.match(rpc_layer):
    raise ConfigError(field=f"{ENV_VAR} rpc_layer", value=rpc_layer,
                      expected='a protocol name such as "grpc"',
                      source=source)
  return rpc_layer
