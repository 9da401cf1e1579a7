"""``tfdist bench --across-hosts``: all-reduce and training against the link.

Every task of a MultiWorkerMirrored cluster that spans hosts runs the same
command, under ``tfdist launch --nnodes N`` or ``srun``::

  tfdist launch --nnodes 2 --node-rank R --master-addr HOST0 -- \\
      python -m tfdist bench --across-hosts --json hosts.json

In one run, on the same hosts and sockets' routes:

1. **link**: plain TCP streams between ring neighbours, all sending at once
   (`tfdist.bench.link`): the most the link moves, what every all-reduce
   figure is a ratio of;
2. **all-reduce**: the sweep of `tfdist.bench.allreduce` over tensor sizes,
   for TensorFlow's collectives (what MultiWorkerMirroredStrategy does) and
   tfdist's socket transport, reported as NCCL's bus bandwidth
   (``S / t * 2 (n - 1) / n`` for S float32 bytes) over the link: the share
   of the link the all-reduce uses. With a 16-bit wire dtype the effective
   figure (float32 bytes reduced) can pass 1: up to 2;
3. **schedules**: every schedule of the socket ring and its rule on numpy
   buffers, float32 from 4 KiB to 64 MiB (``schedule_sizes_kb``; the quick
   preset 4 KiB, 256 KiB and 4 MiB), beside the alpha-beta model's
   time for each from the link's rate and hop latency above
   (`tfdist.bench.schedules.sweep`, scored by its ``report``:
   ``raw.schedules``): the rule's pick against the fastest schedule;
4. **training**: steps/s of ``wide_mlp`` (`tfdist.bench.models`, 33.6 MB of
   gradients a step; ``--model`` picks another), hand-written
   MultiWorkerMirroredStrategy code (``raw``) against tfdist's Runner with the
   socket transport (``tfdist``), in alternating windows, and each worker
   training its own copy with nothing exchanged (``alone``). A step at the
   link's rate takes ``alone``'s step plus the gradients' bus bytes over the
   link: its steps/s over ``raw``'s is ``training_ceiling_vs_raw``, the most
   any float32 all-reduce can gain on these hosts run back to back. Overlapped
   (the buckets cross while the backward pass runs) a step takes the longer of
   the two: ``training_overlap_ceiling_vs_raw``, and tfdist's steps/s over it
   is ``training_fraction_of_overlap_ceiling``. Then a few more of tfdist's
   steps are recorded (`tfdist.strategy.timeline`): when the backward pass ran
   and when each bucket crossed (``training.timeline``).

Every target the run misses gets a ``why`` from figures of the same run
(`why_not`): for an all-reduce, the same ring called without TensorFlow,
the bytes moved with no arithmetic, and how busy the chief's machine was;
for training, the step at the link's rate and how busy the chief's machine
was in each variant's windows (``training.machine_busy``, and of that the
kernel's packet work, ``softirq_share``). A target beyond what the machine
measured reachable is said to be so.

The processor's cost (``raw.processor``, `processor_cost`): this process's
CPU seconds per GB sent by the float32 ``ring`` at the largest size swept,
over the link's TCP streams' (``ring_cpu_vs_tcp``), both measured here.

The report's ``model_check`` sets each size's measured all-reduce times
beside the alpha-beta model of the schedule the socket ring picks
(`tfdist.bench.projection`), from the link's rate and the hop latency
measured in the same run, and tfdist's measured step beside the projected
one, its buckets crossing during the backward pass (``model_check.training``,
`tfdist.bench.projection.check_training`: this run's compute, backward pass
and buckets).

The chief prints the table and writes the JSON report (and the plot); the
other tasks print one line. Nothing is asserted about speed: the report says
which targets (`TARGETS`) the figures meet.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable

from tfdist.bench import allreduce as allreduce_lib
from tfdist.bench import link as link_lib
from tfdist.bench import models
from tfdist.bench import projection
from tfdist.bench import report as report_lib
from tfdist.bench import runner
from tfdist.bench import scaling
from tfdist.bench import schedules as schedules_lib
from tfdist.bench.report import Target
from tfdist.errors import ConfigError
from tfdist.ring import socket_ring
from tfdist.strategy import timeline

__all__ = ["HostsConfig", "HOSTS_QUICK", "HOSTS_FULL", "TARGETS", "run",
           "processor_cost", "validate", "format_table"]

_SOURCE = "tfdist bench --across-hosts"
_HEADLINE_METHOD = "socket"  # What training uses (through TensorFlow).


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostsConfig:
  """How much the bench across hosts measures.

  Attributes:
    quick: the CI preset.
    model: the `tfdist.bench.models.MODELS` entry trained.
    sizes_mb: float32 tensor sizes of the all-reduce sweep (MiB).
    methods: `tfdist.bench.allreduce.METHODS` entries to time.
    iterations: timed all-reduces per size and method.
    link_seconds: seconds each link stream sends.
    link_repeats: link streams timed.
    batch: examples per replica per training step.
    train_steps: steps per timing window.
    train_rounds: timing windows per variant.
    warmup_steps: untimed steps per variant first.
    timeline_steps: steps of tfdist's variant recorded after the timing
      (`tfdist.strategy.timeline`): the backward pass and each bucket.
    bucket_bytes: tfdist's `GradientOptions.bucket_bytes`; its default
      when ``None``.
    schedule_sizes_kb: float32 sizes of the schedules' sweep (KiB).
    schedule_windows: its timing windows per size and schedule.
    timeout_s: bound on connecting and on any one socket operation of the
      link measurement and of the schedules' rings.
  """
  quick: bool = False
  model: str = "wide_mlp"
  sizes_mb: tuple[float, ...] = (1, 4, 16, 64)
  methods: tuple[str, ...] = ("none", "bf16", "socket", "socket_bf16",
                              "ring", "ring_bf16", "ring_polled", "exchange")
  iterations: int = 5
  link_seconds: float = 2.0
  link_repeats: int = 3
  batch: int = 64
  train_steps: int = 10
  train_rounds: int = 3
  warmup_steps: int = 2
  timeline_steps: int = 5
  bucket_bytes: int | None = None
  schedule_sizes_kb: tuple[int, ...] = schedules_lib.SIZES_KB
  schedule_windows: int = 5
  timeout_s: float = 120.0


HOSTS_QUICK = HostsConfig(quick=True, sizes_mb=(4,),
                          methods=("none", "socket", "socket_bf16", "ring",
                                   "ring_bf16", "exchange"),
                          iterations=2, link_seconds=1.0, link_repeats=1,
                          train_steps=3, train_rounds=1, warmup_steps=1,
                          timeline_steps=2, schedule_sizes_kb=(4, 256, 4096),
                          schedule_windows=2)
HOSTS_FULL = HostsConfig()

#: The targets across hosts, for ratios measured within one run.
TARGETS: tuple[Target, ...] = (
    Target(key="allreduce_fraction_of_link", bound=0.9),
    Target(key="bf16_fraction_of_link", bound=1.8),
    Target(key="training_speedup_vs_raw", bound=2.0),
    Target(key="training_fraction_of_overlap_ceiling", bound=0.85),
    Target(key="ring_cpu_vs_tcp", bound=1.5, higher_is_better=False),
)

#: Headline keys and their types.
HEADLINE_KEYS: dict[str, type] = {
    "link_bytes_per_s": float,
    "allreduce_fraction_of_link": float,
    "bf16_fraction_of_link": float,
    "collective_fraction_of_link": float,
    "ceiling_fraction_of_link": float,
    "training_speedup_vs_raw": float,
    "training_ceiling_vs_raw": float,
    "training_overlap_ceiling_vs_raw": float,
    "training_fraction_of_overlap_ceiling": float,
    "ring_cpu_vs_tcp": float,
}

#: A machine this share busy or more had no processor left to go faster.
BUSY = 0.9


def run(config: HostsConfig, *, json_path: str | None = None,
        plot_path: str | None = None, log: Callable[[str], None] = print
        ) -> dict | None:
  """Measures link, all-reduce and training; the report on the chief.

  Call it in every task of the cluster (TF_CONFIG, SLURM).

  Returns:
    The report on the chief (written to ``json_path`` / ``plot_path``
    there); ``None`` on the other tasks.

  Raises:
    ConfigError: the cluster has one worker (nothing crosses a link).
  """
  import tfdist  # pylint: disable=g-import-not-at-top
  from tfdist.bench import cluster_worker  # pylint: disable=g-import-not-at-top
  from tfdist.strategy import transport  # pylint: disable=g-import-not-at-top
  strategy = tfdist.make_strategy("multi_worker_mirrored",
                                  transport="collective")
  n = strategy.num_replicas_in_sync
  if n < 2:
    raise ConfigError(
        field="cluster", value=f"{n} worker", source=_SOURCE,
        expected="two or more workers, on different hosts",
        hint="Run it in every task of a multi-node tfdist launch or srun")
  rank, hosts, _ = transport.peers(strategy)
  rendezvous = transport.CoordinationRendezvous()
  log(f"tfdist bench: link between {n} workers on {', '.join(hosts)} ...")
  link = link_lib.measure(
      rank=rank, hosts=hosts, rendezvous=rendezvous,
      key="tfdist/bench/link", seconds=config.link_seconds,
      repeats=config.link_repeats, timeout_s=config.timeout_s)
  log("tfdist bench: all-reduce sweep ...")
  sweep = allreduce_lib.sweep(strategy, sizes_mb=config.sizes_mb,
                              methods=config.methods,
                              iterations=config.iterations)
  log("tfdist bench: the ring's schedules against their model ...")
  schedules = schedules_lib.sweep(
      rank=rank, hosts=hosts, rendezvous=rendezvous,
      key="tfdist/bench/schedules", link=link,
      sizes_kb=config.schedule_sizes_kb, windows=config.schedule_windows,
      timeout_s=config.timeout_s)
  log(f"tfdist bench: training {config.model} ...")
  buckets = ({} if config.bucket_bytes is None
             else {"bucket_bytes": config.bucket_bytes})
  spec = {"models": {config.model: [
              {"name": "raw"},
              {"name": "tfdist", **scaling.RECOMMENDED, **buckets},
              {"name": "alone"}]},
          "batch": {config.model: config.batch}, "steps": config.train_steps,
          "rounds": config.train_rounds,
          "warmup_steps": config.warmup_steps,
          "timeline_steps": config.timeline_steps}
  train = cluster_worker.train_variants(strategy, spec,
                                        sorted(os.sched_getaffinity(0)))
  if not tfdist.is_chief(strategy):
    return None
  report = build(config=dataclasses.asdict(config), hosts=hosts, link=link,
                 sweep=sweep, schedules=schedules_lib.report(schedules),
                 train=train[config.model],
                 gradient_bytes=4 * models.MODELS[config.model].build()
                 .count_params(),
                 machine=runner.machine())
  validate(report)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1, sort_keys=True)
  if plot_path:
    write_plot({"this cluster": report}, plot_path)
  return report


def build(*, config: dict, hosts: list[str], link: dict, sweep: dict,
          schedules: dict, train: dict, gradient_bytes: int, machine: dict
          ) -> dict:
  """The report: headline ratios, targets met, and every raw figure.

  Args:
    config: the `HostsConfig` as a dict.
    hosts: one per worker, by rank.
    link: `tfdist.bench.link.measure`'s result.
    sweep: `tfdist.bench.allreduce.sweep`'s result.
    schedules: `tfdist.bench.schedules.report`'s result.
    train: ``{variant: {"samples_per_s": ..., "windows_s": [...]}}`` for
      ``raw``, ``tfdist`` and ``alone``.
    gradient_bytes: float32 bytes of the model's gradients a step.
    machine: `tfdist.bench.runner.machine`'s result.
  """
  rate = link["bytes_per_s"]
  fractions = {m: {size: figures["busbw"] / rate
                   for size, figures in per_size.items()}
               for m, per_size in sweep.items()}

  def smallest(method: str) -> float:
    """The method's lowest share of the link over sizes of 4 MiB and up."""
    return fractions[method][_lowest_size(fractions, method)]

  speed = {v: figures["samples_per_s"] / (config["batch"] * len(hosts))
           for v, figures in train.items()}
  n = len(hosts)
  # A step whose all-reduce runs at the link's rate: back to back, the
  # compute (alone) and then the gradients' bus bytes over the link;
  # overlapped (buckets crossing while the backward pass runs), the longer.
  compute_s = 1 / speed["alone"]
  wire_s = gradient_bytes * 2 * (n - 1) / n / rate
  link_step_s, overlap_step_s = compute_s + wire_s, max(compute_s, wire_s)
  training = {"model": config["model"], "steps_per_s": speed,
              "gradient_bytes": gradient_bytes, "link_step_s": link_step_s,
              "overlap_step_s": overlap_step_s,
              "windows_s": {v: f["windows_s"] for v, f in train.items()}}
  for key in ("machine_busy", "softirq_share"):
    if all(key in f for f in train.values()):
      training[key] = {v: f[key] for v, f in train.items()}
  if train["tfdist"].get("timeline"):
    training["timeline"] = train["tfdist"]["timeline"]
    training["timeline_summary"] = timeline.summary(training["timeline"])
  processor = processor_cost(link=link, sweep=sweep, workers=n)
  headline = {
      "link_bytes_per_s": float(rate),
      "allreduce_fraction_of_link": smallest(_HEADLINE_METHOD),
      "bf16_fraction_of_link": smallest("socket_bf16"),
      "collective_fraction_of_link": smallest("none"),
      "ceiling_fraction_of_link": smallest("exchange"),
      "training_speedup_vs_raw": speed["tfdist"] / speed["raw"],
      "training_ceiling_vs_raw": 1 / (link_step_s * speed["raw"]),
      "training_overlap_ceiling_vs_raw": 1 / (overlap_step_s * speed["raw"]),
      "training_fraction_of_overlap_ceiling": speed["tfdist"] * overlap_step_s,
      "ring_cpu_vs_tcp": processor["ring_cpu_vs_tcp"],
  }
  measured_link = projection.Link(
      bytes_per_s=rate, latency_s=link.get("hop_latency_s") or 0.0)
  model = projection.check(sweep=sweep, p=n, link=measured_link)
  model["training"] = projection.check_training(
      training=training, link=measured_link, p=n)
  targets = {}
  for t in TARGETS:
    entry = {"target": t.text, "value": headline[t.key],
             "met": t.met(headline[t.key])}
    if not entry["met"]:
      entry.update(why_not(t, sweep=sweep, fractions=fractions,
                           training=training, processor=processor))
    targets[t.key] = entry
  return {
      "kind": "across_hosts",
      "headline": headline,
      "model_check": model,
      "targets": targets,
      "raw": {"hosts": hosts, "workers": len(hosts), "link": link,
              "allreduce": {"sweep": sweep, "fraction_of_link": fractions},
              "schedules": schedules, "processor": processor,
              "training": training},
      "config": config,
      "machine": machine,
  }


def processor_cost(*, link: dict, sweep: dict, workers: int) -> dict:
  """The ring's processor seconds per GB beside the raw TCP stream's.

  Both are this process's CPU seconds (all its threads), measured in the
  same run: the link's streams (`tfdist.bench.link`: ``cpu_s_per_gb``, per
  GB received while as many were sent) and the float32 ``ring`` all-reduce
  at the largest size swept (``cpu_seconds`` a call). A ring all-reduce of
  S bytes over n workers sends ``2 (n - 1) / n`` S from each worker and
  receives as much: per GB on the wire is the figure comparable with the
  stream's; per GB reduced (of S) is what training pays. ``exchange``
  (the same bytes over the same sockets, no arithmetic) splits the ring's
  excess into its sockets' and its arithmetic's.

  Returns:
    ``{"size_mb", "tcp_cpu_s_per_gb", "ring_cpu_s_per_gb_reduced",
    "ring_cpu_s_per_gb_wire", "ring_cpu_vs_tcp"}``, and with ``exchange``
    swept ``exchange_cpu_s_per_gb_wire`` and ``exchange_cpu_vs_tcp``.
  """
  size = max(sweep["ring"], key=float)
  reduced_gb = float(size) * (1 << 20) / 1e9
  wire = 2 * (workers - 1) / workers
  tcp = link["cpu_s_per_gb"]
  ring = sweep["ring"][size]["cpu_seconds"] / (reduced_gb * wire)
  out = {"size_mb": size, "tcp_cpu_s_per_gb": tcp,
         "ring_cpu_s_per_gb_reduced": ring * wire,
         "ring_cpu_s_per_gb_wire": ring, "ring_cpu_vs_tcp": ring / tcp}
  if size in sweep.get("exchange", {}):
    # exchange sends the ring's bytes: the tensor resized by the wire factor.
    exchange = sweep["exchange"][size]["cpu_seconds"] / (reduced_gb * wire)
    out.update(exchange_cpu_s_per_gb_wire=exchange,
               exchange_cpu_vs_tcp=exchange / tcp)
  return out


def _lowest_size(fractions: dict, method: str) -> str:
  """The size (of 4 MiB and up, where there are any) ``method`` did worst."""
  shares = fractions[method]
  big = [size for size in shares if float(size) >= 4] or list(shares)
  return min(big, key=shares.get)


def _why_allreduce(target: Target, *, sweep: dict, fractions: dict,
                   method: str, direct: str, bytes_scale: float,
                   **_) -> dict:
  """A missed all-reduce target, from the same run's other methods.

  At the size ``method`` did worst: ``direct`` (the same ring called on
  numpy buffers, without TensorFlow) shows what TensorFlow's hop costs;
  ``exchange`` (the bytes alone, no arithmetic) times ``bytes_scale`` (2
  for a 16-bit wire, which moves half the bytes) is the machine's ceiling;
  ``machine_busy`` says whether a processor was left.
  """
  size = _lowest_size(fractions, method)
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
  if "machine_ceiling" in out and not target.met(out["machine_ceiling"]):
    verdict.append("out of reach on this machine: moving the bytes alone "
                   "stays under the target")
  elif direct in sweep and target.met(fractions[direct][size]):
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


def _why_training(target: Target, *, training: dict, **_) -> dict:
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
  if not target.met(ceiling):
    why += (f". Out of reach on these hosts: {step['alone']:.0f} ms of "
            "compute and the gradients over the link take "
            f"{at_link / step['raw']:.0%} of raw's step; {target.text}x "
            f"needs {1 / target.bound:.0%} or less")
  wait = step["raw"] - at_link  # What a faster all-reduce could save.
  if wait > 0:
    why += (f"; tfdist saved {(step['raw'] - step['tfdist']) / wait:.0%} "
            "of that")
  return {"machine_ceiling": ceiling, "why": why + _busy_line(training)}


def _why_overlap(target: Target, *, training: dict, **_) -> dict:
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
      f"({target.text} wanted); the rest is what did not overlap"
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


def _why_processor(target: Target, *, processor: dict, **_) -> dict:
  """A ring that spends more processor a GB than a plain stream: how much
  of that its sockets spend moving the bytes (``exchange``), and how much
  its arithmetic and copies."""
  p = processor
  why = (f"at {p['size_mb']} MiB the float32 ring spent "
         f"{p['ring_cpu_s_per_gb_wire']:.2f} processor seconds a GB sent "
         f"({p['ring_cpu_s_per_gb_reduced']:.2f} a GB reduced), the TCP "
         f"stream {p['tcp_cpu_s_per_gb']:.2f}: {p['ring_cpu_vs_tcp']:.2f}x "
         f"({target.text} wanted)")
  out: dict = {}
  if "exchange_cpu_vs_tcp" in p:
    out["machine_ceiling"] = p["exchange_cpu_vs_tcp"]
    arithmetic = p["ring_cpu_s_per_gb_wire"] - p["exchange_cpu_s_per_gb_wire"]
    why += (f"; the same bytes over the ring's sockets with no arithmetic "
            f"(exchange) {p['exchange_cpu_s_per_gb_wire']:.2f} "
            f"({p['exchange_cpu_vs_tcp']:.2f}x the stream): the additions "
            f"and copies cost {arithmetic:.2f} a GB sent")
    why += (". The ring's sockets are the gap: moving the bytes alone "
            "misses the target" if not target.met(p["exchange_cpu_vs_tcp"])
            else ". The ring's arithmetic is the gap: its sockets alone "
            "meet the target")
  return {**out, "why": why}


#: How each target's miss is explained: target key -> explainer.
_WHY: dict[str, Callable[..., dict]] = {
    "allreduce_fraction_of_link": functools.partial(
        _why_allreduce, method=_HEADLINE_METHOD, direct="ring",
        bytes_scale=1),
    "bf16_fraction_of_link": functools.partial(
        _why_allreduce, method="socket_bf16", direct="ring_bf16",
        bytes_scale=2),
    "training_speedup_vs_raw": _why_training,
    "training_fraction_of_overlap_ceiling": _why_overlap,
    "ring_cpu_vs_tcp": _why_processor,
}


def why_not(target: Target, *, sweep: dict, fractions: dict,
            training: dict, processor: dict | None = None) -> dict:
  """Why ``target`` was missed, from figures measured in the same run.

  Returns:
    ``{"why": one line, ...}`` with the figures it rests on
    (``machine_ceiling`` where the run measured one, ``machine_busy``,
    ``tensorflow_hop_s``, ``at_size_mb``).
  """
  return _WHY[target.key](target, sweep=sweep, fractions=fractions,
                          training=training, processor=processor)


def validate(report: dict) -> None:
  """Checks keys and types (asserts no speed).

  Raises:
    ReportError: a key is missing or holds the wrong type.
  """
  for key, kind in HEADLINE_KEYS.items():
    _expect(report.get("headline", {}).get(key), kind, f"headline.{key}")
  schedules = report["raw"].get("schedules") or {}
  for where, targets in (("targets", report.get("targets", {})),
                         ("schedules.targets", schedules.get("targets", {}))):
    for key, entry in targets.items():
      _expect(entry.get("met"), bool, f"{where}.{key}.met")
      if not entry["met"] and not (isinstance(entry.get("why"), str)
                                   and entry["why"]):
        raise report_lib.ReportError(
            f"across-hosts report: {where}.{key} is not met and has no why "
            f"({entry.get('why')!r}); expected a line from this run's "
            "figures")
  for method, per_size in report["raw"]["allreduce"]["sweep"].items():
    for size, figures in per_size.items():
      for key in ("seconds", "algbw", "busbw"):
        _expect(figures.get(key), float, f"sweep.{method}.{size}.{key}")
  _expect(schedules.get("same_bits"), bool, "schedules.same_bits")
  if not schedules.get("sizes"):
    raise report_lib.ReportError(
        "across-hosts report: schedules.sizes is empty or missing; expected "
        "the schedules' sweep (tfdist.bench.schedules.report)")
  for kb, size in schedules["sizes"].items():
    for name in socket_ring.SCHEDULES:
      row = size["schedules"].get(name, {})
      for key in ("measured_s", "model_s"):
        _expect(row.get(key), float, f"schedules.sizes.{kb}.{name}.{key}")
    _expect(size["chosen_vs_best"], float,
            f"schedules.sizes.{kb}.chosen_vs_best")
    if size["rule"]["pick"] not in socket_ring.SCHEDULES:
      raise report_lib.ReportError(
          f"across-hosts report: schedules.sizes.{kb}.rule.pick = "
          f"{size['rule']['pick']!r}; expected one of "
          f"{sorted(socket_ring.SCHEDULES)}")


def _expect(value, kind: type, where: str) -> None:
  """Refuses ``value`` at ``where`` unless it is a ``kind`` (a positive
  number where ``kind`` is float)."""
  if not isinstance(value, kind) or (kind is float and not value > 0):
    raise report_lib.ReportError(
        f"across-hosts report: {where} = {value!r}; expected a "
        f"{'positive ' if kind is float else ''}{kind.__name__}")


def format_table(report: dict) -> str:
  """The headline and the sweep as text, one figure per line."""
  h = report["headline"]
  raw = report["raw"]
  lines = [f"across {raw['workers']} workers on {', '.join(raw['hosts'])}: "
           f"link {h['link_bytes_per_s'] / 1e6:.0f} MB/s (TCP streams)"]
  for key, t in report["targets"].items():
    lines.append(f"  {key:<36} {t['value']:7.3f}  target {t['target']:<7} "
                 f"{'met' if t['met'] else 'NOT met'}")
    if "why" in t:
      lines.append(f"    why: {t['why']}")
  for key in ("collective_fraction_of_link", "ceiling_fraction_of_link",
              "training_ceiling_vs_raw", "training_overlap_ceiling_vs_raw"):
    lines.append(f"  {key:<36} {h[key]:7.3f}")
  lines.append("  bus bandwidth / link, by tensor size (MiB):")
  fractions = raw["allreduce"]["fraction_of_link"]
  sizes = sorted(next(iter(fractions.values())), key=float)
  lines.append("    " + f"{'method':<14}" + "".join(f"{s:>8}" for s in sizes))
  for method, per_size in fractions.items():
    lines.append("    " + f"{method:<14}" +
                 "".join(f"{per_size[s]:8.3f}" for s in sizes))
  sweep = raw["allreduce"]["sweep"]
  if all("cpu_per_wall" in f for m in sweep.values() for f in m.values()):
    lines.append("  the chief's CPU seconds per second, by tensor size (MiB):")
    for method, per_size in sweep.items():
      lines.append("    " + f"{method:<14}" + "".join(
          f"{per_size[s]['cpu_per_wall']:8.2f}" for s in sizes))
  p = raw["processor"]
  lines.append(f"  processor s a GB sent at {p['size_mb']} MiB: ring "
               f"{p['ring_cpu_s_per_gb_wire']:.2f} "
               f"({p['ring_cpu_s_per_gb_reduced']:.2f} a GB reduced), TCP "
               f"stream {p['tcp_cpu_s_per_gb']:.2f}" + (
                   f", exchange {p['exchange_cpu_s_per_gb_wire']:.2f}"
                   if "exchange_cpu_s_per_gb_wire" in p else ""))
  speed = raw["training"]["steps_per_s"]
  lines.append(f"  {raw['training']['model']} steps/s: " + ", ".join(
      f"{v} {s:.2f}" for v, s in speed.items()))
  lines += _schedules_lines(raw["schedules"])
  model = report.get("model_check")
  if model:
    lines.append(f"  model (alpha {model['latency_s'] * 1e6:.1f} us a "
                 f"hop, the link): measured / predicted time, by size:")
    for size, row in sorted(model["by_size"].items(),
                            key=lambda kv: float(kv[0])):
      lines.append(f"    {size:>6} MiB  {row['schedule']} predicted "
                   f"{row['predicted_s'] * 1e3:8.2f} ms  " + "  ".join(
                       f"{m} {v['measured_over_predicted']:.2f}"
                       for m, v in row.items() if isinstance(v, dict)))
    step = model.get("training")
    if step:
      lines.append(f"    a step: predicted {step['predicted_s'] * 1e3:.1f} ms"
                   f" (overlapped; {step['serial_s'] * 1e3:.1f} without), "
                   f"measured {step['measured_s'] * 1e3:.1f} ms: "
                   f"{step['measured_over_predicted']:.2f}")
  return "\n".join(lines)


def _schedules_lines(schedules: dict) -> list[str]:
  """Each size's schedules, measured / model (ms), the rule's pick and its
  time over the fastest's; the sweep's targets."""
  lines = [f"  schedules (numpy buffers; model from alpha "
           f"{schedules['alpha_s'] * 1e6:.1f} us, B "
           f"{schedules['bytes_per_s'] / 1e6:.0f} MB/s; same bits "
           f"{schedules['same_bits']}): measured / model ms, by size:"]
  for kb, size in sorted(schedules["sizes"].items(),
                         key=lambda kv: int(kv[0])):
    lines.append(f"    {kb:>6} KiB  " + "  ".join(
        f"{name} {row['measured_s'] * 1e3:.3f}/{row['model_s'] * 1e3:.3f}"
        for name, row in size["schedules"].items())
        + f"  rule {size['rule']['pick']} {size['chosen_vs_best']:.2f}x "
        "the fastest")
  for key, t in schedules["targets"].items():
    goal = schedules_lib.target(key, schedules["ranks"])
    lines.append(f"  schedules {key:<26} {t['value']:7.3f}  target "
                 f"{goal.text:<7} {'met' if t['met'] else 'NOT met'} "
                 f"(at {t['at_kb']} KiB)")
    if "why" in t:
      lines.append(f"    why: {t['why']}")
  return lines


def write_plot(reports: dict[str, dict], path: str) -> None:
  """One panel per report (e.g. per link rate): bus bandwidth / link by size.

  Args:
    reports: label -> across-hosts report.
    path: the PNG to write (needs matplotlib).
  """
  from tfdist.bench import plot  # pylint: disable=g-import-not-at-top
  plt = plot.pyplot()
  rows = 1 + any(r["raw"]["training"].get("timeline") for r in reports.values())
  fig, axes = plt.subplots(rows, len(reports),
                           figsize=(5.5 * len(reports), 4.2 * rows),
                           squeeze=False)
  for ax, report in zip(axes[-1], reports.values()):
    if rows > 1:
      _plot_timeline(ax, report["raw"]["training"].get("timeline") or [])
  for ax, (label, report) in zip(axes[0], reports.items()):
    fractions = report["raw"]["allreduce"]["fraction_of_link"]
    for method, per_size in fractions.items():
      sizes = sorted(per_size, key=float)
      ax.plot([float(s) for s in sizes], [per_size[s] for s in sizes],
              marker="o", label=plot.METHOD_LABELS.get(method, method))
    ax.axhline(1.0, color="black", linestyle=":", label="the link (TCP)")
    speed = report["raw"]["training"]["steps_per_s"]
    ceiling = report["headline"].get("training_overlap_ceiling_vs_raw")
    ax.set(xlabel="tensor size (MiB, float32)", ylabel="bus bandwidth / link")
    ax.set_title(
        f"{label}: link {report['headline']['link_bytes_per_s'] / 1e6:.0f} "
        f"MB/s; {report['raw']['training']['model']} "
        f"x{speed['tfdist'] / speed['raw']:.2f}"
        + (f" (overlapped, at most x{ceiling:.2f})" if ceiling else ""),
        fontsize=9)
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _plot_timeline(ax, steps: list[dict], shown: int = 3) -> None:
  """The last ``shown`` recorded steps of tfdist's training, one above the
  other: the backward pass, and each bucket waiting (pale) and on the ring."""
  for row, step in enumerate(steps[-shown:]):
    y = row * (len(step["buckets"]) + 2)
    start, end = step["backward_s"]
    ax.barh(y, (end - start) * 1e3, left=start * 1e3, color="grey",
            label="backward pass" if row == 0 else None)
    for b in step["buckets"]:
      at = y + 1 + b["bucket"]
      ax.barh(at, (b["began"] - b["ready"]) * 1e3, left=b["ready"] * 1e3,
              color="tab:blue", alpha=0.3,
              label="bucket ready, waiting" if row == b["bucket"] == 0
              else None)
      ax.barh(at, (b["ended"] - b["began"]) * 1e3, left=b["began"] * 1e3,
              color="tab:blue",
              label=f"bucket on the ring ({len(step['buckets'])} a step)"
              if row == b["bucket"] == 0 else None)
  ax.invert_yaxis()
  ax.set(xlabel="ms from the backward pass's start", yticks=[],
         title=f"tfdist's last {min(shown, len(steps))} recorded steps")
  if steps:
    ax.legend(fontsize=7)

