"""``tfdist bench --across-hosts``: all-reduce and training against the link.

Every task of a MultiWorkerMirrored cluster that spans hosts runs the same
command, under ``tfdist launch --nnodes N`` or ``srun``::

  tfdist launch --nnodes 2 --node-rank R --master-addr HOST0 -- \\
      python -m tfdist bench --across-hosts --json hosts.json

In one run, on the same hosts: the link (`tfdist.bench.link`), the
all-reduce sweep (`tfdist.bench.allreduce`), the socket ring's schedules
(`tfdist.bench.schedules.sweep`), and training (``raw``, ``tfdist``,
``alone``; then tfdist's steps recorded by `tfdist.strategy.timeline`).
`build` turns them into the figures of `tfdist.bench.figures` (each one's
method is there), scored, each miss with its why (`tfdist.bench.why`), and
``model_check``: the measured times beside the alpha-beta model
(`tfdist.bench.projection`). The chief prints the table and writes the
report; the other tasks print one line. Nothing is asserted about speed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from tfdist.bench import allreduce as allreduce_lib
from tfdist.bench import figures
from tfdist.bench import link as link_lib
from tfdist.bench import models
from tfdist.bench import projection
from tfdist.bench import report as report_lib
from tfdist.bench import runner
from tfdist.bench import scaling
from tfdist.bench import schedules as schedules_lib
from tfdist.bench import why
from tfdist.errors import ConfigError
from tfdist.strategy import timeline

__all__ = ["HostsConfig", "HOSTS_QUICK", "HOSTS_FULL", "run", "build",
           "processor_cost"]

_SOURCE = "tfdist bench --across-hosts"


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
  report_lib.validate_hosts(report)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1, sort_keys=True)
  if plot_path:
    from tfdist.bench import plot  # pylint: disable=g-import-not-at-top
    plot.write_hosts_plot({"this cluster": report}, plot_path)
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
  fractions = {m: {size: found["busbw"] / rate
                   for size, found in per_size.items()}
               for m, per_size in sweep.items()}

  def smallest(method: str) -> float:
    """The method's lowest share of the link over sizes of 4 MiB and up."""
    return fractions[method][why.lowest_size(fractions, method)]

  speed = {v: found["samples_per_s"] / (config["batch"] * len(hosts))
           for v, found in train.items()}
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
      "allreduce_fraction_of_link": smallest("socket"),
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
  targets = {f.name: figures.score(f, headline[f.name], sweep=sweep,
                                   fractions=fractions, training=training,
                                   processor=processor)
             for f in figures.of("across_hosts", targeted=True)}
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

  Both are this process's CPU seconds, measured in the same run: the link's
  streams (``cpu_s_per_gb``) and the float32 ``ring`` at the largest size
  swept. A ring all-reduce of S bytes over n workers sends ``2 (n - 1) / n``
  S each way: per GB on the wire compares with the stream; per GB reduced is
  what training pays. ``exchange`` (the same bytes, no arithmetic) splits
  the ring's excess into its sockets' and its arithmetic's.

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
