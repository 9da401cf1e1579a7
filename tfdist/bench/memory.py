"""Memory: a training worker's peak RSS under tfdist against the bare script.

Two-worker clusters on this machine, each worker a process of its own (so
nothing of one kind's run counts in the other's), train ``model`` for a few
steps; each worker reports ``ru_maxrss``, the larger of a run's two is its
figure. ``raw`` is MultiWorkerMirroredStrategy with a hand-written step;
``tfdist`` is ``tfdist launch`` (the socket transport, the gradients in
buckets) with `tfdist.Runner`. A model of many large gradients (``deep_mlp``:
134 MB in 8 buckets) shows what the buckets' buffers cost; the start-up
runs' small MLP would show only TensorFlow's own footprint.
"""

from __future__ import annotations

import statistics

from tfdist.bench import startup

__all__ = ["measure"]


def measure(*, model: str, repeats: int, steps: int, timeout_s: float,
            workers: int = 2, runs: dict | None = None) -> dict:
  """Peak RSS of each kind, ``repeats`` alternating runs each, or of
  ``runs`` (`startup.alternate`'s, of this model and steps) when given.

  Returns:
    ``{"model", "steps", "workers", "tfdist_peak_rss_mb", "raw_peak_rss_mb",
    "memory_ratio", "runs_mb"}``: medians, and every run's figure.
  """
  runs = runs or startup.alternate(repeats=repeats, steps=steps,
                                   timeout_s=timeout_s, workers=workers,
                                   model=model)
  mb = {m: [rss / 2**20 for _, rss in v] for m, v in runs.items()}
  ours, raw = statistics.median(mb["tfdist"]), statistics.median(mb["raw"])
  return {"model": model, "steps": steps, "workers": workers,
          "tfdist_peak_rss_mb": ours, "raw_peak_rss_mb": raw,
          "memory_ratio": ours / raw, "runs_mb": mb}
