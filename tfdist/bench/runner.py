"""`tfdist bench`: every measurement side by side in one invocation.

The measurements run one after another (a registry, in order), each in
processes of its own that are bounded in time and killed by PID. Every
headline figure is a ratio of two things timed in the same run; every timed
figure is a median of repeated windows or runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import time
from typing import Any, Callable

from tfdist.bench import allreduce as allreduce_lib
from tfdist.bench import memory as memory_lib
from tfdist.bench import overhead as overhead_lib
from tfdist.bench import report as report_lib
from tfdist.bench import scaling as scaling_lib
from tfdist.bench import schedules as schedules_lib
from tfdist.bench import startup as startup_lib
from tfdist.errors import ConfigError

__all__ = ["BenchConfig", "QUICK", "FULL", "run", "check_outputs", "machine"]

_SOURCE = "tfdist.bench.run"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
  """How much the bench measures.

  Attributes:
    quick: the CI preset: fewer variants, sizes and repeats.
    overhead_steps: steps per timing window of the overhead cases.
    overhead_rounds: timing windows per case.
    train_steps: steps per timing window in the clusters.
    train_rounds: timing windows per variant in one cluster.
    alone_steps: single ``alone`` steps each worker of a cluster of 2 or
      more times one by one (how far the slowest worker's step is from the
      average: `tfdist.bench.scaling`).
    timeline_steps: steps of the largest cluster's ``tfdist`` variant
      recorded by `tfdist.strategy.timeline` (the report's
      ``raw.scaling.timeline``).
    cluster_repeats: times each cluster size is launched.
    allreduce_mb: float32 tensor sizes of the all-reduce sweep.
    allreduce_iterations: timed all-reduces per size.
    loopback_mb: MiB per loopback transfer.
    schedule_ranks: process counts of the socket ring's schedules against
      their model (`tfdist.bench.schedules`; no TensorFlow, so more
      processes than cores).
    schedule_kb: their float32 sizes in KiB.
    schedule_windows: their timing windows per size and schedule.
    startup_repeats: start-up runs of each kind, and memory runs.
    startup_model: the `tfdist.bench.models.MODELS` entry the start-up runs
      train, for ``startup_steps``.
    memory_model: the entry the memory runs train (`tfdist.bench.memory`),
      for ``memory_steps``; the start-up runs' peaks where both are alike.
    timeout_s: limit on any one process group the bench starts.
    pin_cores: in the scaling clusters, bind worker i to core i modulo the
      cores (raw and tfdist variants, and the 1-worker baseline alike).
  """
  quick: bool = False
  overhead_steps: int = 60
  overhead_rounds: int = 7
  train_steps: int = 40
  train_rounds: int = 2
  alone_steps: int = 40
  timeline_steps: int = 5
  cluster_repeats: int = 2
  allreduce_mb: tuple[float, ...] = (1, 4, 16, 64)
  allreduce_iterations: int = 5
  loopback_mb: int = 512
  schedule_ranks: tuple[int, ...] = (2, 3, 4, 8)
  schedule_kb: tuple[int, ...] = (4, 16, 64, 256, 1024)
  schedule_windows: int = 5
  startup_repeats: int = 3
  startup_model: str = "mlp"
  startup_steps: int = 20
  memory_model: str = "deep_mlp"
  memory_steps: int = 10
  timeout_s: float = 600.0
  pin_cores: bool = True


QUICK = BenchConfig(quick=True, overhead_steps=10, overhead_rounds=1,
                    train_steps=5, train_rounds=1, alone_steps=5,
                    timeline_steps=2, cluster_repeats=1,
                    allreduce_mb=(1,), allreduce_iterations=2,
                    loopback_mb=16, schedule_ranks=(2, 3),
                    schedule_kb=(4, 256), schedule_windows=2,
                    startup_repeats=1, startup_model="wide_mlp",
                    startup_steps=2, memory_model="wide_mlp", memory_steps=2,
                    timeout_s=240.0)
FULL = BenchConfig()

_BATCH = {"mlp": 64, "cnn": 32}  # Per replica.

Results = dict[str, dict]


def _overhead(c: BenchConfig, results: Results) -> dict:
  del results
  return overhead_lib.measure(batch=_BATCH["mlp"], cnn_batch=_BATCH["cnn"],
                              steps=c.overhead_steps, warmup_steps=3,
                              rounds=c.overhead_rounds, timeout_s=c.timeout_s,
                              quick=c.quick)


def _scaling(c: BenchConfig, results: Results) -> dict:
  del results
  return scaling_lib.measure(
      quick=c.quick, batch=_BATCH, steps=c.train_steps, warmup_steps=3,
      rounds=c.train_rounds, cluster_repeats=c.cluster_repeats,
      alone_steps=c.alone_steps, timeline_steps=c.timeline_steps,
      allreduce_mb=list(c.allreduce_mb),
      allreduce_iterations=c.allreduce_iterations, timeout_s=c.timeout_s,
      pin_cores=c.pin_cores)


def _allreduce(c: BenchConfig, results: Results) -> dict:
  loopback = allreduce_lib.loopback_bytes_per_s(
      c.loopback_mb, repeats=1 if c.quick else 3)
  sweep = results["scaling"]["allreduce_sweep"]
  summary = allreduce_lib.summarize(
      sweep, loopback, method=allreduce_lib.method_name(
          scaling_lib.RECOMMENDED["transport"],
          scaling_lib.RECOMMENDED["compression"]))
  schedules = schedules_lib.measure(
      ranks=c.schedule_ranks, sizes_kb=c.schedule_kb,
      windows=c.schedule_windows, link_seconds=0.3 if c.quick else 1.0,
      timeout_s=c.timeout_s)
  return {**summary, "loopback_bytes_per_s": loopback, "sweep": sweep,
          "schedules": schedules}


def _startup(c: BenchConfig, results: Results) -> dict:
  del results
  return startup_lib.measure(repeats=c.startup_repeats, steps=c.startup_steps,
                             model=c.startup_model, timeout_s=c.timeout_s)


def _memory(c: BenchConfig, results: Results) -> dict:
  runs = results["startup"]["runs"] if (c.memory_model, c.memory_steps) == (
      c.startup_model, c.startup_steps) else None
  return memory_lib.measure(
      model=c.memory_model, repeats=c.startup_repeats, steps=c.memory_steps,
      timeout_s=c.timeout_s, runs=runs)


# name -> measurement, run in this order (later ones read earlier results).
_MEASUREMENTS: dict[str, Callable[[BenchConfig, Results], dict]] = {
    "overhead": _overhead,
    "scaling": _scaling,
    "allreduce": _allreduce,
    "startup": _startup,
    "memory": _memory,
}


def machine() -> dict[str, Any]:
  """The versions and machine a report was measured with."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  return {"cpus": os.cpu_count(), "python": platform.python_version(),
          "tensorflow": tf.__version__, "keras": keras.__version__,
          "platform": platform.platform()}


def run(config: BenchConfig, *, json_path: str | None = None,
        plot_path: str | None = None, log: Callable[[str], None] = print
        ) -> dict:
  """Runs every measurement; writes the JSON report and the plot.

  Returns:
    The report (see `tfdist.bench.report`), already validated.

  Raises:
    ConfigError: from `check_outputs`, before anything is measured.
  """
  check_outputs(json_path=json_path, plot_path=plot_path)
  results: Results = {}
  for name, measure in _MEASUREMENTS.items():
    start = time.monotonic()
    log(f"tfdist bench: {name} ...")
    results[name] = measure(config, results)
    log(f"tfdist bench: {name} done in {time.monotonic() - start:.0f} s")
  config_dict = dataclasses.asdict(config)
  config_dict["batch_per_replica"] = _BATCH
  config_dict["recommended_options"] = scaling_lib.RECOMMENDED
  config_dict["pinning"] = {
      "pinned": config.pin_cores,
      "rule": "scaling worker i on core i % cores, 1 intra-op thread",
      "cores_by_workers": results["scaling"]["pinning"]["cores_by_workers"]}
  report = report_lib.build(config=config_dict, machine=machine(), **results)
  report_lib.validate(report)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1, sort_keys=True)
  if plot_path:
    from tfdist.bench import plot  # pylint: disable=g-import-not-at-top
    plot.write_plot(report, plot_path)
  return report


def check_outputs(*, json_path: str | None = None,
                  plot_path: str | None = None, local: bool = True) -> None:
  """Fails before the minutes of `run` if its report cannot be written.

  Args:
    json_path: the report's path: a ``.json`` file.
    plot_path: the plot's path, in a format matplotlib writes (``.png``,
      ``.pdf``, ``.svg``, ...), known by its extension.
    local: whether the paths are this machine's to check: their directory
      must exist and they must not be directories.

  Raises:
    ConfigError: a path with the wrong extension, or (``local``) not a file
      in an existing directory; a plot asked for without matplotlib.
  """
  if plot_path and importlib.util.find_spec("matplotlib") is None:
    raise ConfigError(field="plot_path", value=plot_path, source=_SOURCE,
                      expected="matplotlib installed",
                      hint="pip install 'tfdist[bench]'")
  for field, path, formats in (("json_path", json_path, lambda: ["json"]),
                               ("plot_path", plot_path, _plot_formats)):
    if not path:
      continue
    if os.path.splitext(path)[1][1:].lower() not in formats():
      raise ConfigError(
          field=field, value=path, source=_SOURCE,
          expected="a file name ending in " + ", ".join(
              f".{f}" for f in formats()))
    if local and (os.path.isdir(path) or not os.path.isdir(
        os.path.dirname(os.path.abspath(path)))):
      raise ConfigError(field=field, value=path, source=_SOURCE,
                        expected="a file in an existing directory")


def _plot_formats() -> list[str]:
  """The file formats matplotlib writes, png first."""
  from matplotlib import backend_bases  # pylint: disable=g-import-not-at-top
  return sorted(backend_bases.FigureCanvasBase.get_supported_filetypes(),
                key=lambda f: (f != "png", f))
