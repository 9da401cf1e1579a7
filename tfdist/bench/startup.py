"""Start-up: time to the first step of a 2-worker ``tfdist launch``.

Against a bare TensorFlow script started by hand with its TF_CONFIG. Both
runs start from nothing (``time.time()`` before the first process starts) and
end when the slower worker finishes its first training step; the medians of
``repeats`` runs of each, alternating, are compared. `alternate` also serves
`tfdist.bench.memory`: every run reports its workers' peak RSS.
"""

from __future__ import annotations

import statistics
import sys
import time

from tfdist.bench import procs

__all__ = ["alternate", "measure"]


def _raw_run(workers: int, steps: int, timeout_s: float,
             model: str) -> tuple[float, int]:
  start = time.time()
  cmd = procs.python_module("tfdist.bench.startup_worker", "--mode", "raw",
                            "--steps", str(steps), "--model", model)
  done = procs.run_all([cmd] * workers,
                       [procs.worker_env({"TF_CONFIG": c})
                        for c in procs.tf_configs(workers)],
                       timeout_s=timeout_s, what="start-up (raw)")
  lines = [procs.json_lines(d.stdout)[-1] for d in done]
  return (max(l["first_step_unix"] for l in lines) - start,
          max(l["peak_rss_bytes"] for l in lines))


def _tfdist_run(workers: int, steps: int, timeout_s: float,
                model: str) -> tuple[float, int]:
  start = time.time()
  cmd = procs.python_module(
      "tfdist", "launch", "--workers", str(workers), "--grace-seconds", "5",
      "--", sys.executable, "-m", "tfdist.bench.startup_worker", "--mode",
      "tfdist", "--steps", str(steps), "--model", model)
  done = procs.run_all([cmd], [procs.worker_env()], timeout_s=timeout_s,
                       what="start-up (tfdist launch)")
  lines = [l for l in procs.json_lines(done[0].stdout)
           if l.get("mode") == "tfdist"]
  if len(lines) != workers:
    raise procs.BenchProcessError(
        f"bench start-up: {len(lines)} of {workers} workers reported")
  return (max(l["first_step_unix"] for l in lines) - start,
          max(l["peak_rss_bytes"] for l in lines))


_RUNS = {"raw": _raw_run, "tfdist": _tfdist_run}


def alternate(*, repeats: int, steps: int, timeout_s: float,
              workers: int = 2, model: str = "mlp"
              ) -> dict[str, list[tuple[float, int]]]:
  """``repeats`` runs of each kind, alternating, raw first.

  Args:
    repeats: runs of each kind.
    steps: training steps each run's workers take.
    timeout_s: bound on each run.
    workers: processes of each run's cluster.
    model: the `tfdist.bench.models.MODELS` entry trained.

  Returns:
    ``{"raw": [...], "tfdist": [...]}``: each run's (seconds to the slower
    worker's first step, the larger peak RSS of its workers in bytes).
  """
  runs: dict[str, list[tuple[float, int]]] = {"tfdist": [], "raw": []}
  for r in range(repeats):
    for mode in ("raw", "tfdist") if r % 2 == 0 else ("tfdist", "raw"):
      runs[mode].append(_RUNS[mode](workers, steps, timeout_s, model))
  return runs


def measure(*, repeats: int, steps: int, timeout_s: float,
            workers: int = 2, model: str = "mlp") -> dict:
  """Start-up of ``model``, ``repeats`` runs of each kind.

  Returns:
    ``{"model", "workers", "tfdist_s", "raw_s", "startup_ratio", "runs"}``
    with medians; ``runs`` holds every run's (seconds, peak RSS bytes).
  """
  runs = alternate(repeats=repeats, steps=steps, timeout_s=timeout_s,
                   workers=workers, model=model)
  med = {m: statistics.median(t for t, _ in v) for m, v in runs.items()}
  return {"model": model, "workers": workers, "tfdist_s": med["tfdist"],
          "raw_s": med["raw"], "startup_ratio": med["tfdist"] / med["raw"],
          "runs": runs}
