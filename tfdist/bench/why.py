"""Why a target was missed, from figures measured in the same run.

Each explainer is a `tfdist.bench.figures.Figure`'s ``explain``:
``explain(figure, value=..., ranks=..., **context)`` returns the entry's
``why`` and the figures it rests on (``machine_ceiling`` where the run
measured one). `tfdist.bench.figures.score` calls it.
"""

from __future__ import annotations

import statistics
from typing import Any

from tfdist.bench.overhead import TOLD_APART_P

#: A `tfdist.bench.figures.Figure` (which imports this module).
Figure = Any

#: A machine this share busy or more had no processor left to go faster.
BUSY = 0.9


# tfdist bench: one machine.


def overhead(figure: Figure, *, overhead: dict, **_) -> dict:
  """Whether each case's windows tell tfdist from raw (`overhead.spread`)."""
  cases, parts = overhead["cases"], []
  for name, case in cases.items():
    w = case["windows"]
    parts.append(f"{name} {case['ratio']:.3f}, its windows "
                 f"{w['min']:.3f}-{w['max']:.3f} of raw's (median "
                 f"{w['median']:.3f}, {w['above_one']} of {len(w['ratios'])} "
                 f"above 1, sign test p {w['sign_test_p']:.2f})")
  apart = [n for n, c in cases.items() if c["windows"]["told_apart"]]
  parts.append(f"told apart from raw: {', '.join(apart)}" if apart else
               "no case told apart from raw (sign test p < "
               f"{TOLD_APART_P:g} needed)")
  return {"why": _against(figure, None, "; ".join(parts))}


def scaling(figure: Figure, *, value: float, scaling: dict, **_) -> dict:
  """A model's scaling against its workers training alone, and what
  waiting for the slowest worker and the all-reduce leave of that
  (`tfdist.bench.scaling`)."""
  model = figure.name.split(".")[1]
  ceiling = scaling.get("scaling_ceiling", {}).get(model)
  straggler, evidence = scaling.get("straggler", {}).get(model), None
  if straggler:
    mean = straggler["mean_step_s"]
    sync = scaling["scaling_sync_ceiling"][model]
    reduced = scaling["scaling_allreduce_ceiling"][model]
    evidence = (
        f"a synchronous step waits for the slowest of {straggler['workers']} "
        f"workers: their own steps, timed one by one, took "
        f"{mean * 1e3:.1f} ms on average and each step's slowest "
        f"{mean / straggler['sync_factor'] * 1e3:.1f} ms (ceiling "
        f"{sync:.3f}); one all-reduce of the gradients, timed alone, took "
        f"{straggler['gradients_allreduce_s'] * 1e3:.2f} ms (ceiling "
        f"{reduced:.3f}); tfdist reached {value / reduced:.2f} of that")
  return {"machine_ceiling": ceiling,
          "why": _against(figure, ceiling, evidence, value)}


def loopback(figure: Figure, *, value: float, allreduce: dict, **_) -> dict:
  """The all-reduce against the bytes alone over the same sockets, the same
  ring without TensorFlow, and how busy the machine was."""
  ceiling = allreduce.get("ceiling_fraction_of_loopback")
  parts, method = [], allreduce.get("method")
  ring = allreduce.get("fractions", {}).get("ring")
  if ring:
    parts.append(f"the same ring without TensorFlow reached {ring:.3f}")
  busy = [f["machine_busy"] for f in
          allreduce.get("sweep", {}).get(method, {}).values()
          if "machine_busy" in f]
  if busy:
    parts.append(f"the machine was {statistics.median(busy):.0%} busy "
                 f"during {method} (median over sizes)")
  return {"machine_ceiling": ceiling,
          "why": _against(figure, ceiling, "; ".join(parts), value)}


def _against(figure: Figure, ceiling: float | None, evidence: str | None,
             value: float = 0.0) -> str:
  """One line on a miss, against the machine's ceiling for the figure."""
  if ceiling is None:
    line = "no ceiling measured for this figure; see docs/benchmarks.md"
  elif not figure.met(ceiling):
    line = (f"out of reach on this machine in this run: its ceiling was "
            f"{ceiling:.3f}; tfdist reached {value / ceiling:.2f} of it")
  else:
    line = (f"the machine allowed {ceiling:.3f} in this run; tfdist reached "
            f"{value / ceiling:.2f} of it")
  return f"{line}; {evidence}" if evidence else line


def lowest_size(fractions: dict, method: str) -> str:
  """The size (of 4 MiB and up, where there are any) ``method`` did worst."""
  shares = fractions[method]
  big = [size for size in shares if float(size) >= 4] or list(shares)
  return min(big, key=shares.get)


# tfdist bench --across-hosts.


def allreduce(figure: Figure, *, sweep: dict, fractions: dict, method: str,
              direct: str, bytes_scale: float, **_) -> dict:
  """A missed all-reduce target, from the same run's other methods.

  At the size ``method`` did worst: ``direct`` (the same ring called on
  numpy buffers, without TensorFlow) shows what TensorFlow's hop costs;
  ``exchange`` (the bytes alone, no arithmetic) times ``bytes_scale`` (2
  for a 16-bit wire, which moves half the bytes) is the machine's ceiling;
  ``machine_busy`` says whether a processor was left.
  """
  size = lowest_size(fractions, method)
  figures = sweep[method][size]
  parts = [f"lowest at {size} MiB: {fractions[method][size]:.2f} of the "
           f"link in {figures['seconds'] * 1e3:.2f} ms a call"]
  out: dict = {"at_size_mb": size}
  if direct in sweep:
    hop = figures["seconds"] - sweep[direct][size]["seconds"]
    out["tensorflow_hop_s"] = hop
    parts.append(f"the same ring without TensorFlow ({direct}) "
                 f"{fractions[direct][size]:.2f}: TensorFlow's hop cost "
                 f"{hop * 1e3:.2f} ms a call")
  if "exchange" in sweep:
    ceiling = fractions["exchange"][size] * bytes_scale
    out["machine_ceiling"] = ceiling
    parts.append(f"the bytes alone, no arithmetic (exchange"
                 f"{' x2: half the bytes' if bytes_scale != 1 else ''}) "
                 f"{ceiling:.2f}")
  busy = figures.get("machine_busy")
  if busy is not None:
    out["machine_busy"] = busy
    parts.append(f"the chief's machine {busy:.0%} busy")
  verdict = []
  if "machine_ceiling" in out and not figure.met(out["machine_ceiling"]):
    verdict.append("out of reach on this machine: moving the bytes alone "
                   "stays under the target")
  elif direct in sweep and figure.met(fractions[direct][size]):
    verdict.append("TensorFlow's hop is the gap: the ring alone meets the "
                   "target")
  elif direct in sweep:
    verdict.append("the ring's own work is the gap: called alone it stays "
                   "under the target, the bytes alone do not")
  if busy is not None and busy >= BUSY:
    verdict.append("its processors were the limit")
  verdict_text = "; ".join(verdict)
  out["why"] = "; ".join(parts) + (
      f". {verdict_text[:1].upper()}{verdict_text[1:]}" if verdict else "")
  return out


def training(figure: Figure, *, training: dict, **_) -> dict:
  """A missed training target, from the step at the link's rate.

  raw's step is the model's compute (``alone``: nothing exchanged) plus its
  wait on TensorFlow's all-reduce; no float32 all-reduce waits less than
  the gradients' bus bytes take over the link (``link_step_s``).
  """
  speed = training["steps_per_s"]
  step = {v: 1e3 / s for v, s in speed.items()}  # ms a step.
  at_link = training["link_step_s"] * 1e3
  ceiling = step["raw"] / at_link
  why = (f"a step took {step['raw']:.0f} ms raw, {step['tfdist']:.0f} ms "
         f"with tfdist, {step['alone']:.0f} ms with nothing exchanged "
         f"(alone), {at_link:.0f} ms with its "
         f"{training['gradient_bytes'] / 1e6:.1f} MB all-reduced at the "
         f"link's rate: {ceiling:.2f}x raw at most")
  if not figure.met(ceiling):
    why += (f". Out of reach on these hosts: {step['alone']:.0f} ms of "
            "compute and the gradients over the link take "
            f"{at_link / step['raw']:.0%} of raw's step; {figure.text()}x "
            f"needs {1 / figure.bound():.0%} or less")
  wait = step["raw"] - at_link  # What a faster all-reduce could save.
  if wait > 0:
    why += (f"; tfdist saved {(step['raw'] - step['tfdist']) / wait:.0%} "
            "of that")
  return {"machine_ceiling": ceiling, "why": why + _busy_line(training)}


def overlap(figure: Figure, *, training: dict, **_) -> dict:
  """A missed overlap target: tfdist's step against the longer of the
  compute and the gradients' bus bytes over the link (``overlap_step_s``)."""
  step = 1e3 / training["steps_per_s"]["tfdist"]
  floor = training["overlap_step_s"] * 1e3
  compute = 1e3 / training["steps_per_s"]["alone"]
  wire = training["link_step_s"] * 1e3 - compute
  return {"why": (
      f"a step took {step:.0f} ms with tfdist; overlapped, no step takes "
      f"less than the longer of {compute:.0f} ms of compute (alone) and "
      f"{wire:.0f} ms of its {training['gradient_bytes'] / 1e6:.1f} MB over "
      f"the link: {floor:.0f} ms, {floor / step:.2f} of tfdist's step "
      f"({figure.text()} wanted); the rest is what did not overlap"
      + _timeline_line(training, step_ms=step, compute_ms=compute,
                       wire_ms=wire) + _busy_line(training))}


def _busy_line(training: dict) -> str:
  """How busy the chief's machine was in each variant's windows (on the
  bed, the machine of every host); nothing where it was not read.

  With its processors busy (`BUSY`) in tfdist's windows, the step shortens
  by at most the idle share unless it does less work: the exchange's own
  processor time (the ring, the kernel's packet work) does not overlap
  with compute that already fills every processor.
  """
  busy, softirq = training.get("machine_busy"), training.get("softirq_share")
  if not busy:
    return ""
  named = [v for v in ("tfdist", "raw", "alone") if v in busy]
  shares = ", ".join(
      f"{busy[v]:.0%} in {v}'s{' windows' if v == named[0] else ''} "
      f"(softirq {softirq[v]:.0%})" for v in named)
  line = (f"; the chief's machine was busy {shares}: softirq is the "
          "kernel's packet work, charged to no process")
  if busy.get("tfdist", 0) >= BUSY:
    line += (f". Its processors were the limit: with {busy['tfdist']:.0%} "
             f"of them busy, tfdist's step could be at most "
             f"{1 / busy['tfdist'] - 1:.0%} faster without less work")
  return line


def _timeline_line(training: dict, *, step_ms: float, compute_ms: float,
                   wire_ms: float) -> str:
  """What the recorded timeline says of the overlap, or nothing.

  Nothing crosses before the first bucket is ready, so a step is no shorter
  than the compute outside the backward pass, plus the first bucket's ready
  time, plus the gradients over the link.
  """
  t = training.get("timeline_summary")
  if not t:
    return ""
  outside = compute_ms - t["backward_s"] * 1e3  # Forward pass, update.
  ready_floor = outside + t["first_ready_s"] * 1e3 + wire_ms
  return (f"; the timeline (median of {t['steps']} steps): a "
          f"{t['backward_s'] * 1e3:.0f} ms backward pass whose first bucket "
          f"was ready at {t['first_ready_s'] * 1e3:.0f} ms, "
          f"{t['allreduce_s'] * 1e3:.0f} ms of buckets on the ring, "
          f"{t['hidden']:.2f} of it during the pass, "
          f"{t['exposed_s'] * 1e3:.0f} ms after it; the ring moved "
          f"{t['bytes_per_s_during'] / 1e6:.0f} MB/s in the buckets it began "
          f"during the pass, {t['bytes_per_s_after'] / 1e6:.0f} MB/s after; "
          f"from the first bucket on, no step takes less than "
          f"{ready_floor:.0f} ms ({outside:.0f} ms of compute outside the "
          f"pass, {t['first_ready_s'] * 1e3:.0f} ms, then the link): "
          f"{ready_floor / step_ms:.2f} of tfdist's step")


def processor(figure: Figure, *, processor: dict, **_) -> dict:
  """A ring that spends more processor a GB than a plain stream: how much
  of that its sockets spend moving the bytes (``exchange``), and how much
  its arithmetic and copies."""
  p = processor
  why = (f"at {p['size_mb']} MiB the float32 ring spent "
         f"{p['ring_cpu_s_per_gb_wire']:.2f} processor seconds a GB sent "
         f"({p['ring_cpu_s_per_gb_reduced']:.2f} a GB reduced), the TCP "
         f"stream {p['tcp_cpu_s_per_gb']:.2f}: {p['ring_cpu_vs_tcp']:.2f}x "
         f"({figure.text()} wanted)")
  out: dict = {}
  if "exchange_cpu_vs_tcp" in p:
    out["machine_ceiling"] = p["exchange_cpu_vs_tcp"]
    arithmetic = p["ring_cpu_s_per_gb_wire"] - p["exchange_cpu_s_per_gb_wire"]
    why += (f"; the same bytes over the ring's sockets with no arithmetic "
            f"(exchange) {p['exchange_cpu_s_per_gb_wire']:.2f} "
            f"({p['exchange_cpu_vs_tcp']:.2f}x the stream): the additions "
            f"and copies cost {arithmetic:.2f} a GB sent")
    why += (". The ring's sockets are the gap: moving the bytes alone "
            "misses the target" if not figure.met(p["exchange_cpu_vs_tcp"])
            else ". The ring's arithmetic is the gap: its sockets alone "
            "meet the target")
  return {**out, "why": why}


# The socket ring's schedules (tfdist.bench.schedules).


def schedules(figure: Figure, *, out: dict, kb: str, **_) -> dict:
  """What the sweep says of a miss at ``kb``: the schedules and the cores
  the processes share."""
  del figure
  size = out["sizes"][kb]
  rule, best, rows = size["rule"], size["best"], size["schedules"]
  busy, cores, n = size["busy_cores"], out["cores"], out["ranks"]
  fastest_s = rows[best["measured"]]["measured_s"]
  text = (f"at {kb} KiB the rule took {rule['pick']} "
          f"({rule['measured_s'] * 1e3:.3f} ms), the fastest measured was "
          f"{best['measured']} ({fastest_s * 1e3:.3f} ms), the model's best "
          f"{best['model']}; the {n} processes "
          f"share this machine's {cores} cores and kept {busy:.2f} of them "
          "busy in these all-reduces")
  if best["measured"] == rule["pick"]:
    text += (f"; {rule['pick']} itself on its own ring, timed in the same "
             "windows: the gap is this run's spread")
  if busy >= BUSY * cores:
    return {"why": text + ": the processors, not the link, were the limit"}
  return {"why": text + " (the kernel's packet work not counted)"}
