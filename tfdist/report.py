"""The report on where this process runs, which ``tfdist info`` prints.

What a bug report needs, like ``accelerate env``: the system (OS, CPUs,
CUDA and cuDNN as TensorFlow was built, GPUs and their driver), versions,
devices, the resolved cluster, the strategy ``auto`` would build and why, and
pre-flight checks (this task's port is free, and who can reach it; an sbatch
allocation that is not an srun step; ``TFDIST_TRANSPORT`` and
``TFDIST_RING_PORTS`` hold usable values). The cluster is resolved before
TensorFlow loads, so a bad configuration fails fast. Where TensorFlow or
Keras cannot be imported, a failed check names the error and the report
gives everything else.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
from typing import Any, Mapping

from tfdist import _net
from tfdist.cluster import local as local_lib
from tfdist.cluster import resolve as resolve_lib
from tfdist.cluster import slurm as slurm_lib
from tfdist.cluster.info import ClusterInfo
from tfdist.errors import ConfigError

__all__ = ["gather", "format_report"]

_PACKAGES = ("tfdist", "tensorflow", "keras", "tensorflow-datasets", "absl-py")
# What a report says where TensorFlow (Keras) cannot be imported.
_WITHOUT_TF = "unknown: TensorFlow cannot be imported"
_WITHOUT_KERAS = "unknown: TensorFlow or Keras cannot be imported"


def gather(*, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
  """Builds the report as a JSON-ready dict; every section it can.

  Args:
    environ: the environment to resolve the cluster from; ``os.environ``
      when ``None``.

  Returns:
    `ClusterInfo.to_dict` of the resolved cluster plus ``strategy``,
    ``strategy_reason``, ``gradient_transport`` and its ``_reason`` (what
    carries the gradients of a multi-worker strategy, `None` for others),
    ``is_chief``, ``address``, ``versions``,
    ``devices``, ``python``, ``system`` (``os``, ``cpus``, ``cuda_build``,
    ``cudnn_build``, ``gpus``: the names the driver lists, ``driver``: its
    version or ``None``), ``keras_corrections`` (each correction's name to
    the Keras functions that changed since it was verified: empty where it
    applies) and ``checks`` (each ``name``, ``ok``, ``detail``). Where
    TensorFlow or Keras cannot be imported, a failed check of its name
    gives the error, and what needs it is ``None``: the devices and the
    CUDA build need TensorFlow; the strategy, its transport and the Keras
    corrections need both.

  Raises:
    ConfigError: the cluster configuration is invalid.
  """
  info, unimportable = _resolve(environ)
  tf_imports = "tensorflow" not in unimportable
  report = info.to_dict()
  report.update(
      is_chief=info.is_chief, address=info.address, versions=_versions(),
      python=platform.python_version(), system=_system(tf_imports),
      devices=local_lib.local_devices() if tf_imports else None,
      strategy=None, strategy_reason=None,
      gradient_transport=None, gradient_transport_reason=None,
      keras_corrections=None, checks=_checks(info, environ) + [
          dict(name=name, ok=False, detail=f"cannot be imported: {error}")
          for name, error in unimportable.items()])
  if not unimportable:
    _add_strategy(report, info, environ)
  return report


def _resolve(environ) -> tuple[ClusterInfo, dict[str, str]]:
  """The cluster, then `_unimportable`: a bad configuration fails before
  TensorFlow loads. Only the local machine's resolver imports TensorFlow (to
  count devices); where it cannot, the cluster is still this machine."""
  try:
    info = resolve_lib.resolve_cluster(environ=environ)
  except ConfigError:
    raise
  except Exception:  # pylint: disable=broad-except
    unimportable = _unimportable()
    if "tensorflow" not in unimportable:
      raise  # Not for want of TensorFlow: a bug, traceback and all.
    return local_lib.resolve_local(devices={}), unimportable
  return info, _unimportable()


def _unimportable() -> dict[str, str]:
  """TensorFlow and Keras, where importing one fails, to the error: a module
  missing, or one that fails as it loads (a CUDA library, or a NumPy or
  protobuf of another version)."""
  found = {}
  for name in ("tensorflow", "keras"):
    try:
      importlib.import_module(name)
    except Exception as e:  # pylint: disable=broad-except
      found[name] = f"{type(e).__name__}: {e}"
  return found


def _add_strategy(report: dict[str, Any], info: ClusterInfo,
                  environ) -> None:
  """Adds what needs Keras too: the strategy, its gradient transport, the
  Keras corrections and the transport variables' checks."""
  from tfdist._compat import keras as keras_compat
  from tfdist.strategy import factory
  from tfdist.strategy import keras_hooks
  from tfdist.strategy import transport as transport_lib

  devices = report["devices"]
  name, why = factory.choose_strategy(info, devices)
  problems = transport_lib.environment_problems(environ)
  gradients = (None, None)
  if (name == "multi_worker_mirrored"  # Each worker's GPUs, else its CPU.
      and transport_lib.TRANSPORT_VARIABLE not in problems):
    gpus = devices.get("GPU", 0)
    gradients = transport_lib.plan(
        workers=max(info.num_workers, 1),
        local_devices=[f"/device:GPU:{i}" for i in range(gpus)]
        or ["/device:CPU:0"], environ=environ)
  report.update(
      strategy=name, strategy_reason=why, gradient_transport=gradients[0],
      gradient_transport_reason=gradients[1],
      keras_corrections={fix.name: list(keras_compat.changed_targets(fix))
                         for fix in keras_compat.FIXES + keras_hooks.HOOKS})
  report["checks"] += [
      dict(name=variable, ok=False,
           detail=f"received {e.value!r}; expected {e.expected}")
      for variable, e in problems.items()]


def format_report(report: Mapping[str, Any]) -> str:
  """The human-readable form of `gather`'s report."""
  system, devices = report["system"], report["devices"]
  build = (f"built with CUDA {system['cuda_build'] or 'none'}, cuDNN "
           f"{system['cudnn_build'] or 'none'}" if devices is not None
           else f"build {_WITHOUT_TF}")
  lines = [f"system:   {system['os']}, {system['cpus']} CPUs, Python "
           f"{report['python']}",
           f"cuda:     {build}; GPUs: {', '.join(system['gpus']) or 'none'}; "
           f"driver {system['driver'] or 'none'}",
           "versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
           _corrections_line(report["keras_corrections"]),
           "devices:  " + (_WITHOUT_TF if devices is None else ", ".join(
               f"{n} {k}" for k, n in devices.items()) or "none"),
           f"cluster:  {report['origin']} (source={report['source']})"]
  for job, addrs in report["cluster"].items():
    lines.append(f"  {job}: {', '.join(addrs)}")
  if report["task_type"] is not None:
    lines.append(f"task:     {report['task_type']}:{report['task_id']}"
                 f"{' (chief)' if report['is_chief'] else ''}")
  if report.get("slurm"):
    s = report["slurm"]
    lines.append(f"slurm:    job {s['job_id']} step {s['step_id']} node "
                 f"{s['node']} procid {s['proc_id']} localid {s['local_id']}")
  if report.get("tpu"):
    lines.append(f"tpu:      {report['tpu']}")
  lines.append(f"strategy: {report['strategy']} (auto: "
               f"{report['strategy_reason']})" if report["strategy"]
               else f"strategy: {_WITHOUT_KERAS}")
  if report.get("gradient_transport"):
    lines.append(f"gradients: {report['gradient_transport']} transport "
                 f"({report['gradient_transport_reason']})")
  for check in report["checks"]:
    mark = "ok  " if check["ok"] else "FAIL"
    lines.append(f"check:    [{mark}] {check['name']}: {check['detail']}")
  return "\n".join(lines)


def _corrections_line(changed: Mapping[str, list[str]] | None) -> str:
  if changed is None:
    return f"keras:    tfdist's corrections {_WITHOUT_KERAS}"
  kept = [name for name, targets in changed.items() if not targets]
  line = (f"keras:    {len(kept)} of {len(changed)} tfdist corrections match "
          "this Keras's code")
  gone = [f"{name} ({', '.join(targets)})"
          for name, targets in changed.items() if targets]
  return line + (f"; not applied, code changed upstream: {'; '.join(gone)}"
                 if gone else "")


def _versions() -> dict[str, str]:
  from tfdist import __version__  # pylint: disable=g-import-not-at-top
  out = {"tfdist": __version__}  # This copy's, even if installed metadata lags.
  for name in _PACKAGES[1:]:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = "not installed"
  return out


def _system(tf_imports: bool) -> dict[str, Any]:
  """The machine: OS, CPUs, TensorFlow's CUDA build (where it imports), GPUs
  and driver."""
  build = {}
  if tf_imports:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    build = tf.sysconfig.get_build_info()
  gpus, driver = _nvidia()
  return {"os": platform.platform(), "cpus": os.cpu_count(),
          "cuda_build": build.get("cuda_version"),
          "cudnn_build": build.get("cudnn_version"),
          "gpus": gpus, "driver": driver}


def _nvidia() -> tuple[list[str], str | None]:
  """The GPUs ``nvidia-smi`` lists and the driver version (bounded, 10 s);
  ``([], None)`` without an NVIDIA driver."""
  if shutil.which("nvidia-smi") is None:
    return [], None
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version",
         "--format=csv,noheader"], capture_output=True, text=True,
        timeout=10, check=False)
  except (OSError, subprocess.TimeoutExpired):
    return [], None
  rows = [[part.strip() for part in line.split(",")]
          for line in out.stdout.splitlines() if "," in line]
  return [r[0] for r in rows], (rows[0][1] if rows else None)


def _checks(info: ClusterInfo, environ) -> list[dict[str, Any]]:
  checks = []
  if info.address is not None:
    host, port = info.address.rsplit(":", 1)
    if _net.is_local(host.strip("[]")):
      problem = _net.port_problem(host.strip("[]"), int(port))
      checks.append(dict(
          name="port", ok=problem is None,
          detail=(f"this task's address {info.address} is free" if problem is None
                  else f"this task's address {info.address} cannot be bound: {problem}")))
      exposed = _net.host_addresses()
      if exposed:  # Not a failure: a fact to act on (docs/multi_node.md).
        checks.append(dict(name="exposure", ok=True, detail=(
            f"TensorFlow's gRPC server of this task listens on port {port} of "
            f"every address here ({', '.join(exposed)}), whatever TF_CONFIG "
            "says, with no authentication: whoever reaches it can run "
            "TensorFlow ops in the task, reading and writing files as this "
            "user. Admit only the cluster's hosts to the task ports "
            "(docs/multi_node.md, 'Firewalls and ports')")))
    else:
      checks.append(dict(name="port", ok=True,
                         detail=f"{info.address} is not on this host; not checked"))
  if (info.source != "slurm" and slurm_lib.in_slurm_job(environ)
      and not slurm_lib.is_slurm_step(environ)):
    checks.append(dict(
        name="slurm", ok=True,
        detail="inside a SLURM allocation but not an srun step: this runs as "
               "one local process; start tasks with srun for multi-worker"))
  return checks
