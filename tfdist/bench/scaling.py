"""Scaling: samples/s of the reference models on 1, 2, ... workers.

Each worker count is one MultiWorkerMirrored cluster on localhost
(`cluster_worker`, one process per worker, each pinned to its own core).
Weak scaling: ``scaling_efficiency = samples/s(N) / (N * samples/s(1))``.
Variants ``raw``, ``tfdist`` (`RECOMMENDED`), ``alone`` (nothing exchanged:
the ceiling) and one option changed at a time alternate in windows; the
largest cluster also runs the all-reduce sweep (`tfdist.bench.allreduce`)
and times ``alone`` steps one by one for the ceilings that waiting for the
slowest worker (`sync_factor`) and the all-reduce leave
(docs/benchmarks.md, "Method").
"""

from __future__ import annotations

import json
import os
import statistics

from tfdist.bench import allreduce
from tfdist.bench import procs
from tfdist.strategy import timeline

__all__ = ["RECOMMENDED", "worker_counts", "variants", "sync_factor",
           "measure"]

#: tfdist's communication options for the ``tfdist`` variant: the measured
#: best that keeps the update of one step (no accumulation) and its float32
#: sums: the socket transport, float32 on the wire.
RECOMMENDED = {"transport": "socket", "compression": "none"}


def worker_counts(cpus: int | None = None) -> list[int]:
  """1 and 2 workers, then 4 and 8 while there is a core for each."""
  cpus = cpus or os.cpu_count() or 2
  return [n for n in (1, 2, 4, 8) if n <= max(2, cpus)]


def variants(quick: bool) -> dict[str, list[dict]]:
  """Per model, the variants to time; the first two are raw and tfdist."""
  base = [{"name": "raw"}, {"name": "tfdist", **RECOMMENDED},
          # Each worker trains by itself, exchanging nothing: what the
          # machine allows N processes at once (the efficiency's ceiling).
          {"name": "alone"}]
  if quick:
    return {"mlp": base, "cnn": base}
  mlp = base + [
      # TensorFlow's collectives through the optimizer hook.
      {"name": "uncompressed", "compression": "none"},
      {"name": "fp16", "compression": "fp16"},
      {"name": "bf16", "compression": "bf16"},
      {"name": "pack_64k", "compression": "fp16", "bytes_per_pack": 64 << 10},
      {"name": "pack_256k", "compression": "fp16",
       "bytes_per_pack": 256 << 10},
      # The socket transport with 16-bit wire dtypes.
      {"name": "socket_fp16", "transport": "socket", "compression": "fp16"},
      {"name": "socket_bf16", "transport": "socket", "compression": "bf16"},
      # The Runner reduces the loss every step: one more collective a step.
      {"name": "loss_each_step", **RECOMMENDED, "loss_each_step": True},
      {"name": "accumulate_4", **RECOMMENDED, "accumulation_steps": 4},
  ]
  return {"mlp": mlp, "cnn": base}


def sync_factor(steps_s: list[list[float]]) -> float:
  """The mean step over the mean of each step's slowest, over workers.

  Args:
    steps_s: per worker, its steps' seconds, in order (the j-th of every
      worker taken as one synchronous step).

  Returns:
    At most 1: the share of its own speed a worker keeps when every step
    waits for the slowest.
  """
  k = min(len(s) for s in steps_s)
  slowest = [max(s[j] for s in steps_s) for j in range(k)]
  return (statistics.fmean(x for s in steps_s for x in s[:k])
          / statistics.fmean(slowest))


def _waited(straggler: dict) -> float:
  """Seconds of a synchronous step with a free all-reduce: the slowest's."""
  return straggler["mean_step_s"] / straggler["sync_factor"]


def measure(*, quick: bool, batch: dict[str, int], steps: int,
            warmup_steps: int, rounds: int, cluster_repeats: int,
            allreduce_mb: list[float], allreduce_iterations: int,
            timeout_s: float, pin_cores: bool = True, alone_steps: int = 0,
            timeline_steps: int = 0, counts: list[int] | None = None) -> dict:
  """Runs every cluster ``cluster_repeats`` times; medians of samples/s.

  With ``alone_steps``, the largest cluster's workers time that many single
  ``alone`` steps each (``straggler`` in the result). With
  ``timeline_steps``, its first run records that many steps of each model's
  ``tfdist`` variant (`tfdist.strategy.timeline`; ``timeline`` in the
  result).
  """
  counts = counts or worker_counts()
  plan = variants(quick)
  samples: dict[str, dict[str, dict[int, list[float]]]] = {
      m: {v["name"]: {n: [] for n in counts} for v in vs}
      for m, vs in plan.items()}
  sweep = None
  cores: dict[str, dict[str, list[int]]] = {}
  factors: dict[str, list[float]] = {m: [] for m in plan}
  mean_steps: dict[str, list[float]] = {m: [] for m in plan}
  allreduce_s: dict[str, list[float]] = {m: [] for m in plan}
  timelines: dict[str, dict] = {}
  for repeat in range(cluster_repeats):
    for n in (counts if repeat % 2 == 0 else counts[::-1]):
      spec = {"intra_threads": 1, "inter_threads": 2, "batch": batch,
              "steps": steps, "warmup_steps": warmup_steps, "rounds": rounds,
              "models": plan,
              "allreduce_mb": allreduce_mb if (
                  n == max(counts) and sweep is None) else [],
              "allreduce_methods": list(allreduce.METHODS),
              "allreduce_iterations": allreduce_iterations,
              "pin_cores": pin_cores,
              "alone_steps": alone_steps if n == max(counts) > 1 else 0,
              "timeline_steps": timeline_steps if (
                  n == max(counts) > 1 and not timelines) else 0}
      cmd = procs.python_module("tfdist.bench.cluster_worker", "--spec",
                                json.dumps(spec))
      done = procs.run_all([cmd] * n,
                           [procs.worker_env({"TF_CONFIG": c})
                            for c in procs.tf_configs(n)],
                           timeout_s=timeout_s, what=f"scaling ({n} workers)")
      lines = [l for d in done for l in procs.json_lines(d.stdout)]
      result = next(l for l in lines if "train" in l)
      cores[str(n)] = {str(l["worker"]): l["cores"] for l in lines
                       if "cores" in l}
      for model, by_variant in result["train"].items():
        for variant, figures in by_variant.items():
          samples[model][variant][n].append(figures["samples_per_s"])
          if "timeline" in figures:
            timelines[model] = {
                "steps": figures["timeline"],
                "summary": timeline.summary(figures["timeline"])}
      if result.get("allreduce"):
        sweep = result["allreduce"]
      by_worker = [l["alone_steps_s"] for l in lines if "alone_steps_s" in l]
      for model in (by_worker[0] if len(by_worker) == n else {}):
        per_worker = [w[model] for w in by_worker]
        factors[model].append(sync_factor(per_worker))
        mean_steps[model].append(
            statistics.fmean(x for w in per_worker for x in w))
        allreduce_s[model].extend(
            l["gradients_allreduce_s"][model] for l in lines
            if "gradients_allreduce_s" in l and l["worker"] == 0)
  med = {m: {v: {str(n): statistics.median(xs) for n, xs in by_n.items()}
             for v, by_n in vs.items()} for m, vs in samples.items()}
  top = str(max(counts))

  def efficiency(model: str, variant: str) -> float:
    s = med[model][variant]
    return s[top] / (int(top) * s["1"])

  straggler = {m: {"workers": int(top),
                   "sync_factor": statistics.median(factors[m]),
                   "mean_step_s": statistics.median(mean_steps[m]),
                   "gradients_allreduce_s": statistics.median(allreduce_s[m])}
               for m in plan if factors[m] and allreduce_s[m]}
  ceiling = {m: efficiency(m, "alone") for m in med}
  return {
      "worker_counts": counts,
      "samples_per_s": med,
      "scaling_efficiency": {m: efficiency(m, "tfdist") for m in med},
      "raw_scaling_efficiency": {m: efficiency(m, "raw") for m in med},
      "scaling_ceiling": ceiling,
      "scaling_sync_ceiling": {m: ceiling[m] * f["sync_factor"]
                               for m, f in straggler.items()},
      "scaling_allreduce_ceiling": {
          m: ceiling[m] * f["sync_factor"] * _waited(f) / (
              _waited(f) + f["gradients_allreduce_s"])
          for m, f in straggler.items()},
      "scaling_overlap_ceiling": {
          m: ceiling[m] * f["sync_factor"] * min(
              1.0, _waited(f) / f["gradients_allreduce_s"])
          for m, f in straggler.items()},
      "straggler": straggler,
      "timeline": timelines,
      "mlp_speedup_vs_raw": med["mlp"]["tfdist"]["2"] / med["mlp"]["raw"]["2"],
      "mlp_variants_vs_raw": {v: s["2"] / med["mlp"]["raw"]["2"]
                              for v, s in med["mlp"].items()},
      "allreduce_sweep": sweep,
      "pinning": {"pinned": pin_cores, "cores_by_workers": cores},
  }
