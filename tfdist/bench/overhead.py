"""Overhead of tfdist's training paths, and the Keras performance options.

Runs `tfdist.bench.overhead_worker` in a fresh process (it splits the CPU into
2 logical devices, which must happen before TensorFlow starts) and reads its
JSON line: every timing window of every case. ``overhead_ratio`` is the
smallest tfdist/raw steps/s ratio (of the medians) over the cases ``fit``,
``keras_fit`` and ``runner``; each case also gets the spread of its windows
(`spread`), which says whether tfdist and raw can be told apart at all.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Sequence

from tfdist.bench import procs

__all__ = ["measure", "spread", "sign_test_p", "TOLD_APART_P"]

#: A case is told apart from raw when the sign test's p is below this.
TOLD_APART_P = 0.05


def measure(*, batch: int, cnn_batch: int, steps: int, warmup_steps: int,
            rounds: int, timeout_s: float, quick: bool = False) -> dict:
  """Returns ``{"cases", "options", "overhead_ratio", "overhead_by_case",
  "flight_recorder_ratio"}``.

  Each case and option: ``steps_per_s`` and ``baseline_steps_per_s`` (the
  medians of the windows), their ``ratio``, and ``windows`` (`spread`).
  With ``quick`` only the flight recorder option is timed.
  """
  spec = {"batch": batch, "cnn_batch": cnn_batch, "steps": steps,
          "warmup_steps": warmup_steps, "rounds": rounds, "quick": quick}
  done = procs.run_all(
      [procs.python_module("tfdist.bench.overhead_worker", "--spec",
                           json.dumps(spec))],
      [procs.worker_env()], timeout_s=timeout_s, what="overhead")
  result = procs.json_lines(done[0].stdout)[-1]
  cases, options = (
      {name: _figures(w["variant_s"], w["baseline_s"], steps)
       for name, w in result[part].items()}
      for part in ("overhead", "options"))
  return {"cases": cases, "options": options,
          "overhead_ratio": min(c["ratio"] for c in cases.values()),
          "overhead_by_case": {c: f["ratio"] for c, f in cases.items()},
          "flight_recorder_ratio": options["flight_recorder"]["ratio"]}


def _figures(variant_s: list[float], baseline_s: list[float],
             steps: int) -> dict:
  v = steps / statistics.median(variant_s)
  b = steps / statistics.median(baseline_s)
  return {"steps_per_s": v, "baseline_steps_per_s": b, "ratio": v / b,
          "windows": spread(variant_s, baseline_s, steps)}


def spread(variant_s: Sequence[float], baseline_s: Sequence[float],
           steps: int) -> dict:
  """How far apart the windows of a variant and its baseline lie.

  The windows of a pair alternate (`tfdist.bench.overhead_worker`): window
  ``r`` of each side ran next to the other's, so their ratio is free of the
  machine's drift from round to round. ``told_apart`` is the sign test on
  those per-window ratios: a variant as fast as its baseline is above 1 in
  half the rounds, so ``k`` of ``n`` rounds on one side has the two-sided
  probability `sign_test_p`; below `TOLD_APART_P` the two differ (7 rounds
  must all fall on one side: p = 2 / 2^7 = 0.016; 6 of 7 gives 0.125).

  Args:
    variant_s: seconds of each of the variant's windows (tfdist's), in order.
    baseline_s: the baseline's (raw's), as many.
    steps: steps a window.

  Returns:
    ``{"variant_steps_per_s": [...], "baseline_steps_per_s": [...],
    "ratios": [...], "min", "median", "max" (of the ratios), "above_one"
    (rounds the variant was faster), "sign_test_p", "told_apart",
    "overlap" (whether the ranges of the two sides' steps/s overlap)}``.
  """
  if not variant_s or len(variant_s) != len(baseline_s):
    raise ValueError(f"windows: {len(variant_s)} of the variant against "
                     f"{len(baseline_s)} of the baseline; expected as many, "
                     "one or more")
  v = [steps / s for s in variant_s]
  b = [steps / s for s in baseline_s]
  ratios = [x / y for x, y in zip(v, b)]
  above = sum(r > 1 for r in ratios)
  p = sign_test_p(above, sum(r != 1 for r in ratios))
  return {"variant_steps_per_s": v, "baseline_steps_per_s": b,
          "ratios": ratios, "min": min(ratios),
          "median": statistics.median(ratios), "max": max(ratios),
          "above_one": above, "sign_test_p": p,
          "told_apart": p < TOLD_APART_P,
          "overlap": max(min(v), min(b)) <= min(max(v), max(b))}


def sign_test_p(above: int, n: int) -> float:
  """The two-sided sign test: how likely ``above`` of ``n`` (or a split as
  uneven) is when each side is as likely as the other."""
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(min(above, n - above) + 1))
  return min(1.0, 2 * tail / 2**n)
