"""A per-step timeline of the gradient all-reduce, so overlap is seen.

While `recording` is open, this process notes when each step's backward pass
started (`mark_backward_start`, on the gradient of a model's output) and,
for each bucket the socket transport sums (`tfdist.strategy.transport`),
when its gradients were ready, when the ring began summing it and when it
ended. The backward pass ends when its last bucket is ready: the last bucket
holds the first layers' gradients, which the pass makes last. `steps` cuts
the notes into steps; the bench plots them (`tfdist.bench.hosts`). With
nothing recording, a note costs one ``None`` check.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

__all__ = ["recording", "note_bucket", "mark_backward_start", "steps",
           "summary"]

_notes: list[dict] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
  """Records this process's notes while open; yields the list they fill."""
  global _notes
  _notes = notes = []
  try:
    yield notes
  finally:
    _notes = None


def mark_backward_start(gradient: Any) -> Any:
  """Notes that the backward pass started; returns ``gradient`` as it is.

  Meant for a ``tf.numpy_function`` on the gradient of a model's output,
  the first the backward pass makes (`tfdist.bench.models.marked`).
  """
  if _notes is not None:
    _notes.append({"event": "backward_start", "t": time.perf_counter()})
  return gradient


def note_bucket(work: Callable[[], Any], *, bucket: int, of: int,
                nbytes: int, ready: float) -> Any:
  """Runs ``work`` (one bucket's all-reduce) and notes when it ran.

  Args:
    work: the all-reduce.
    bucket: its index, in the order every worker sums them.
    of: the number of buckets of the step.
    nbytes: float32 bytes of its gradients.
    ready: `time.perf_counter` when its gradients existed.
  """
  began = time.perf_counter()
  result = work()
  if _notes is not None:
    _notes.append({"event": "bucket", "bucket": bucket, "of": of,
                   "bytes": nbytes, "ready": ready, "began": began,
                   "ended": time.perf_counter()})
  return result


def steps(notes: list[dict]) -> list[dict]:
  """The notes cut into whole steps, times in seconds from each step's start.

  Returns:
    One dict a step: ``backward_s`` (start, end) and ``buckets``, a list of
    ``{"bucket", "bytes", "ready", "began", "ended"}``, in bucket order. A
    step with no backward mark (the model had no marker) starts at its first
    bucket's ready time. Steps cut short by the recording's ends are left
    out.
  """
  out: list[dict] = []
  start, buckets = None, []
  for n in sorted(notes, key=lambda n: n.get("t", n.get("ready"))):
    if n["event"] == "backward_start":
      start, buckets = n["t"], []
      continue
    if n["bucket"] == 0:  # Readies follow the bucket order: a new step.
      buckets = []
    buckets.append(n)
    if n["bucket"] == n["of"] - 1 and len(buckets) == n["of"]:
      t0 = buckets[0]["ready"] if start is None else start
      out.append({
          "backward_s": (0.0, buckets[-1]["ready"] - t0),
          "buckets": [{"bucket": b["bucket"], "bytes": b["bytes"],
                       **{k: b[k] - t0 for k in ("ready", "began", "ended")}}
                      for b in buckets]})
      start, buckets = None, []
  return out


def summary(step_list: list[dict]) -> dict:
  """Medians over ``step_list`` (from `steps`), in seconds.

  Returns:
    ``backward_s``: the backward pass; ``first_ready_s``: when its first
    bucket was ready (nothing crosses before); ``allreduce_s``: the
    buckets' time on the ring, summed; ``hidden``: the share of that time
    that ran while the backward pass did; ``exposed_s``: from the backward
    pass's end to the last sum, which the step waits out;
    ``bytes_per_s_during`` and ``bytes_per_s_after``: the ring's rate for
    the buckets it began during the pass and after it (0 where none), which
    says whether the pass starved it of processors; ``steps``: how many.
  """
  keys = ("backward_s", "first_ready_s", "allreduce_s", "hidden",
          "exposed_s", "bytes_per_s_during", "bytes_per_s_after")
  rows = []
  for step in step_list:
    end = step["backward_s"][1]
    buckets = step["buckets"]
    busy = sum(b["ended"] - b["began"] for b in buckets)
    during = sum(max(0.0, min(b["ended"], end) - b["began"]) for b in buckets)
    rows.append((end, buckets[0]["ready"], busy,
                 during / busy if busy else 0.0,
                 max(b["ended"] for b in buckets) - end,
                 _rate([b for b in buckets if b["began"] < end]),
                 _rate([b for b in buckets if b["began"] >= end])))
  return {"steps": len(rows),
          **{k: statistics.median(r[i] for r in rows) if rows else 0.0
             for i, k in enumerate(keys)}}


def _rate(buckets: list[dict]) -> float:
  seconds = sum(b["ended"] - b["began"] for b in buckets)
  return sum(b["bytes"] for b in buckets) / seconds if seconds else 0.0
