"""Time per step against host count, on paper: the alpha-beta cost model.

A message of m bytes between two hosts costs ``alpha + m / B`` (``alpha``
one hop's latency, ``B`` one host's link rate each way; a non-blocking
switch). Each schedule's time is its own module's ``seconds``
(`tfdist.ring.socket_ring.SCHEDULES`); **tfdist** is the rule's pick
(`tfdist.ring.socket_ring.choose`).

A step (weak scaling) all-reduces its gradients in buckets
(`DEFAULT_BUCKET_BYTES`) as the backward pass makes them: bucket k is ready
at ``backward * (bytes up to k) / S``, its sum ends at ``f_k = max(f_(k-1),
ready_k) + T(bucket k)``, and (`overlapped_seconds`)::

  T_step(p) = compute - backward + f_K        (T_step(1) = compute)

Efficiency is ``T_step(1) / T_step(p)``; ``serial_s`` is compute plus one
all-reduce of all the gradients. `check` and `check_training` set measured
all-reduces and steps beside the model, from the same run's alpha and B
(``tfdist bench --across-hosts``); `project` is ``tfdist bench --project``.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Callable, Mapping, Sequence

from tfdist.ring import socket_ring

__all__ = ["Link", "Workload", "Step", "SCHEDULES", "WORKLOADS", "HOST_COUNTS",
           "RATES_GBIT", "DEFAULT_LATENCY_S", "DEFAULT_GOODPUT",
           "DEFAULT_BUCKET_BYTES", "BACKWARD_SHARE", "WIDE_MLP", "CNN",
           "link_at", "allreduce_seconds", "overlapped_seconds", "step",
           "project", "check", "check_training", "format_table"]

#: One message's cost (s) when none is measured: what the socket ring's
#: rule assumes (`tfdist.ring.socket_ring.DEFAULT_LATENCY_S`), a step of
#: tfdist's Python schedules as two hosts of the bed measured it.
DEFAULT_LATENCY_S = socket_ring.DEFAULT_LATENCY_S
#: TCP payload per bit of line rate: the test bed's streams moved 119 MB/s
#: at 1 Gbit/s and 1182 MB/s at 10 Gbit/s (0.95 and 0.946).
DEFAULT_GOODPUT = 0.95
#: Host counts and link rates (Gbit/s) of the projection table.
HOST_COUNTS: tuple[int, ...] = (2, 3, 4, 8, 16, 64)
RATES_GBIT: tuple[float, ...] = (1, 10, 100)
#: tfdist's bucket (`tfdist.perf.GradientOptions.bucket_bytes`' default).
DEFAULT_BUCKET_BYTES = 25 << 20
#: The backward pass's share of a step's compute when none is measured: it
#: multiplies twice as much as the forward pass (a gradient for the inputs
#: and one for the weights). The bed's timelines measured 0.46-0.53 for
#: ``wide_mlp`` (docs/benchmarks.md).
BACKWARD_SHARE = 0.5
#: The schedules projected: the socket ring's, and ``tfdist`` (the rule's).
SCHEDULES: tuple[str, ...] = (*socket_ring.SCHEDULES, "tfdist")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
  """One host's link into the switch.

  Attributes:
    bytes_per_s: payload bytes per second each way (B).
    latency_s: one hop's latency (alpha).
  """
  bytes_per_s: float
  latency_s: float

  def __post_init__(self):
    if not self.bytes_per_s > 0 or not self.latency_s >= 0:
      raise ValueError(
          f"Link: expected bytes_per_s > 0 and latency_s >= 0, got "
          f"bytes_per_s={self.bytes_per_s!r}, latency_s={self.latency_s!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """A training step: its gradients and its compute.

  Attributes:
    name: what to call it.
    gradient_bytes: float32 bytes all-reduced per step (S).
    compute_s: one host's step without the all-reduce (forward, backward,
      update), at the per-host batch.
    backward_share: the backward pass's share of ``compute_s``.
  """
  name: str
  gradient_bytes: int
  compute_s: float
  backward_share: float = BACKWARD_SHARE


# The bench's models (tfdist/bench/models.py), counted without TensorFlow:
# wide_mlp 1024-4096-1024-10 is 8,403,978 parameters; the CNN's three 3x3
# convolutions (3->32->64->64) and 64->10 head 56,970. Compute: one process
# alone on one core of this 2-vCPU machine (the bench's thread settings: 1
# intra-op, 2 inter-op threads), batch 64 (wide_mlp) and 32 (cnn), the
# hand-written step with no strategy, median of 5 windows (docs/benchmarks.md,
# "Scale on paper"). A GPU would shrink it and lower every efficiency.
WIDE_MLP = Workload(name="wide_mlp", gradient_bytes=4 * 8_403_978,
                    compute_s=0.0167)
CNN = Workload(name="cnn", gradient_bytes=4 * 56_970, compute_s=0.0052)
WORKLOADS: dict[str, Workload] = {w.name: w for w in (WIDE_MLP, CNN)}


def link_at(gbit_per_s: float, *, latency_s: float = DEFAULT_LATENCY_S,
            goodput: float = DEFAULT_GOODPUT) -> Link:
  """A link of ``gbit_per_s`` line rate carrying ``goodput`` of it as TCP."""
  return Link(bytes_per_s=gbit_per_s * 1e9 / 8 * goodput, latency_s=latency_s)


def allreduce_seconds(schedule: str, p: int, size_bytes: float,
                      link: Link) -> float:
  """The modelled all-reduce time of ``size_bytes`` by ``schedule``.

  Args:
    schedule: one of `SCHEDULES`; ``"tfdist"`` is the schedule the socket
      ring's rule picks for this size and host count.
    p: hosts, 2 or more.
    size_bytes: float32 bytes.
    link: alpha and B.

  Raises:
    ValueError: an unknown schedule, naming the known ones, or fewer than
      two hosts.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule: expected one of {list(SCHEDULES)}, got "
                     f"{schedule!r}")
  if not isinstance(p, int) or p < 2:
    raise ValueError(f"p: expected an integer host count >= 2, got {p!r}")
  if schedule == "tfdist":
    schedule = socket_ring.choose(p, int(size_bytes))
  return socket_ring.SCHEDULES[schedule].seconds(
      p, size_bytes, latency_s=link.latency_s, bytes_per_s=link.bytes_per_s)


def overlapped_seconds(*, backward_s: float, bucket_bytes: Sequence[float],
                       allreduce: Callable[[float], float]) -> float:
  """From the backward pass's start to the last bucket's sum.

  The buckets' bytes are made at an even rate over ``backward_s`` (bucket
  k ready once the bytes up to it are), and cross one after the other,
  each as soon as it is ready and the one before has crossed.

  Args:
    backward_s: the backward pass.
    bucket_bytes: each bucket's bytes, in the order they are made.
    allreduce: one bucket's all-reduce time by its bytes.
  """
  total, made, finish = sum(bucket_bytes), 0.0, 0.0
  for size in bucket_bytes:
    made += size
    finish = max(finish, backward_s * made / total) + allreduce(size)
  return max(finish, backward_s)


def _buckets(size_bytes: int, bucket_bytes: int) -> list[int]:
  """``size_bytes`` cut into buckets of ``bucket_bytes``, the rest last."""
  whole, rest = divmod(size_bytes, bucket_bytes)
  return [bucket_bytes] * whole + ([rest] if rest else [])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
  """One modelled training step.

  Attributes:
    allreduce_s: the buckets' all-reduces, one after the other.
    step_s: the step, the buckets crossing during the backward pass.
    serial_s: the step with one all-reduce after the backward pass.
    steps_per_s: ``1 / step_s``.
    efficiency: ``compute / step_s``: the share of one host's speed each
      host keeps.
  """
  allreduce_s: float
  step_s: float
  serial_s: float
  steps_per_s: float
  efficiency: float


def step(workload: Workload, *, p: int, link: Link, schedule: str = "tfdist",
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Step:
  """``workload``'s step on ``p`` hosts, each bucket by ``schedule``."""
  return _step(compute_s=workload.compute_s,
               backward_s=workload.compute_s * workload.backward_share,
               bucket_bytes=_buckets(workload.gradient_bytes, bucket_bytes),
               allreduce=functools.partial(allreduce_seconds, schedule, p,
                                           link=link))


def _step(*, compute_s: float, backward_s: float,
          bucket_bytes: Sequence[float],
          allreduce: Callable[[float], float]) -> Step:
  """The step of ``compute_s`` whose buckets cross during its backward pass
  (`overlapped_seconds`), and without overlap."""
  total = compute_s - backward_s + overlapped_seconds(
      backward_s=backward_s, bucket_bytes=bucket_bytes, allreduce=allreduce)
  return Step(allreduce_s=sum(map(allreduce, bucket_bytes)), step_s=total,
              serial_s=compute_s + allreduce(sum(bucket_bytes)),
              steps_per_s=1 / total, efficiency=compute_s / total)


def project(*, workloads: Sequence[Workload] = (WIDE_MLP, CNN),
            host_counts: Sequence[int] = HOST_COUNTS,
            rates_gbit: Sequence[float] = RATES_GBIT,
            latency_s: float = DEFAULT_LATENCY_S,
            goodput: float = DEFAULT_GOODPUT) -> dict:
  """The table: every workload, rate, host count and schedule.

  Returns:
    ``{"assumptions": {...}, "steps": {workload: {rate: {p: {schedule:
    Step as a dict}}}}, "picks": {workload: {p: schedule}}}`` (the rule's
    pick for one bucket of the workload's first bucket size), rates and
    host counts as strings (JSON keys).
  """
  steps: dict = {}
  for rate in rates_gbit:
    link = link_at(rate, latency_s=latency_s, goodput=goodput)
    for w in workloads:
      steps.setdefault(w.name, {})[f"{rate:g}"] = {
          str(p): {s: dataclasses.asdict(step(w, p=p, link=link, schedule=s))
                   for s in SCHEDULES}
          for p in host_counts}
  picks = {w.name: {str(p): socket_ring.choose(
      p, _buckets(w.gradient_bytes, DEFAULT_BUCKET_BYTES)[0])
                    for p in host_counts} for w in workloads}
  return {"assumptions": {"latency_s": latency_s, "goodput": goodput,
                          "bucket_bytes": DEFAULT_BUCKET_BYTES,
                          "workloads": {w.name: dataclasses.asdict(w)
                                        for w in workloads}},
          "steps": steps, "picks": picks}


def check(*, sweep: Mapping[str, Mapping[str, Mapping[str, float]]],
          link: Link, p: int, methods: Sequence[str] = ("ring", "socket",
                                                       "none")) -> dict:
  """A measured all-reduce sweep beside the model's prediction.

  Args:
    sweep: `tfdist.bench.allreduce.sweep`'s result (``{method: {size_mb:
      {"seconds": ...}}}``); sizes in MiB of float32.
    link: alpha and B measured in the same run.
    p: hosts.
    methods: which measured methods to set beside the model (those
      present).

  Returns:
    ``{"latency_s", "bytes_per_s", "p", "by_size": {size_mb:
    {"schedule": the rule's pick, "predicted_s": its model, method:
    {"measured_s", "measured_over_predicted"}}}}``.
  """
  sizes = sorted({s for m in methods if m in sweep for s in sweep[m]},
                 key=float)
  by_size = {}
  for size in sizes:
    nbytes = float(size) * (1 << 20)
    predicted = allreduce_seconds("tfdist", p, nbytes, link)
    row: dict = {"schedule": socket_ring.choose(p, int(nbytes)),
                 "predicted_s": predicted}
    for m in methods:
      if size in sweep.get(m, {}):
        measured = sweep[m][size]["seconds"]
        row[m] = {"measured_s": measured,
                  "measured_over_predicted": measured / predicted}
    by_size[size] = row
  return {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s,
          "p": p, "by_size": by_size}


def check_training(*, training: Mapping, link: Link, p: int) -> dict | None:
  """tfdist's measured step beside the overlapped step's prediction.

  The prediction takes this run's figures: the compute (``alone``'s step,
  nothing exchanged), the backward pass and each bucket's bytes from the
  timeline (`tfdist.strategy.timeline`), alpha and B.

  Args:
    training: ``tfdist bench --across-hosts``' ``raw.training``.
    link: alpha and B measured in the same run.
    p: hosts.

  Returns:
    ``{"predicted_s", "serial_s", "measured_s", "measured_over_predicted",
    "backward_s", "bucket_bytes"}``; ``None`` without a timeline.
  """
  steps = training.get("timeline")
  if not steps:
    return None
  backward = statistics.median(s["backward_s"][1] - s["backward_s"][0]
                               for s in steps)
  buckets = [b["bytes"] for b in steps[0]["buckets"]]
  predicted = _step(
      compute_s=1 / training["steps_per_s"]["alone"], backward_s=backward,
      bucket_bytes=buckets, allreduce=functools.partial(
          allreduce_seconds, "tfdist", p, link=link))
  measured = 1 / training["steps_per_s"]["tfdist"]
  return {"predicted_s": predicted.step_s, "serial_s": predicted.serial_s,
          "measured_s": measured,
          "measured_over_predicted": measured / predicted.step_s,
          "backward_s": backward, "bucket_bytes": buckets}


def format_table(projection: dict) -> str:
  """`project`'s result as Markdown tables: steps/s and efficiency."""
  a = projection["assumptions"]
  shown = ("ring", "halving", "tfdist")
  shown = tuple(s for s in shown if s in SCHEDULES)
  lines = [f"alpha {a['latency_s'] * 1e6:g} us per hop, TCP carries "
           f"{a['goodput']:g} of the line rate, buckets of "
           f"{a['bucket_bytes'] >> 20} MiB crossing during the backward "
           f"pass; {' | '.join(shown)} (tfdist: the socket ring's pick)",
           ""]
  for name, by_rate in projection["steps"].items():
    w = a["workloads"][name]
    lines += [f"{name}: {w['gradient_bytes'] / 1e6:.2f} MB of gradients, "
              f"compute {w['compute_s'] * 1e3:g} ms a step",
              "",
              "| Gbit/s | hosts | all-reduce ms | steps/s | efficiency | "
              "tfdist without overlap |",
              "|---|---|---|---|---|---|"]
    for rate, by_p in by_rate.items():
      for p, s in by_p.items():
        lines.append(
            f"| {rate} | {p} | "
            + " / ".join(f"{s[k]['allreduce_s'] * 1e3:.2f}" for k in shown)
            + " | " + " / ".join(f"{s[k]['steps_per_s']:.2f}" for k in shown)
            + " | " + " / ".join(f"{s[k]['efficiency']:.3f}" for k in shown)
            + f" | {w['compute_s'] / s['tfdist']['serial_s']:.3f} |")
    lines.append("")
  lines += ["The socket ring's pick for the first bucket:", "",
            "| workload | " + " | ".join(
                f"p={p}" for p in next(iter(
                    projection["picks"].values()))) + " |",
            "|---|" + "---|" * len(next(iter(projection["picks"].values())))]
  for name, by_p in projection["picks"].items():
    lines.append(f"| {name} | " + " | ".join(by_p.values()) + " |")
  return "\n".join(lines)
