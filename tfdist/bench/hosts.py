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
3. **training**: steps/s of ``wide_mlp`` (`tfdist.bench.models`, 33.6 MB of
   gradients a step), hand-written MultiWorkerMirroredStrategy code
   (``raw``) against tfdist's Runner with the socket transport
   (``tfdist``), in alternating windows.

The report's ``model_check`` sets each size's measured all-reduce times
beside the ring's alpha-beta model (`tfdist.bench.projection`), from the
link's rate and the hop latency measured in the same run.

The chief prints the table and writes the JSON report (and the plot); the
other tasks print one line. Nothing is asserted about speed: the report says
which targets (`TARGETS`) the figures meet.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from tfdist.bench import allreduce as allreduce_lib
from tfdist.bench import link as link_lib
from tfdist.bench import projection
from tfdist.bench import report as report_lib
from tfdist.bench import runner
from tfdist.bench import scaling
from tfdist.bench.report import Target
from tfdist.errors import ConfigError

__all__ = ["HostsConfig", "HOSTS_QUICK", "HOSTS_FULL", "TARGETS", "run",
           "validate", "format_table"]

_SOURCE = "tfdist bench --across-hosts"
_MODEL = "wide_mlp"
_HEADLINE_METHOD = "socket"  # What training uses (through TensorFlow).


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostsConfig:
  """How much the bench across hosts measures.

  Attributes:
    quick: the CI preset.
    sizes_mb: float32 tensor sizes of the all-reduce sweep (MiB).
    methods: `tfdist.bench.allreduce.METHODS` entries to time.
    iterations: timed all-reduces per size and method.
    link_seconds: seconds each link stream sends.
    link_repeats: link streams timed.
    batch: examples per replica per training step.
    train_steps: steps per timing window.
    train_rounds: timing windows per variant.
    warmup_steps: untimed steps per variant first.
    timeout_s: bound on connecting and on any one socket operation of the
      link measurement.
  """
  quick: bool = False
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
  timeout_s: float = 120.0


HOSTS_QUICK = HostsConfig(quick=True, sizes_mb=(4,),
                          methods=("none", "socket", "socket_bf16",
                                   "exchange"),
                          iterations=2, link_seconds=1.0, link_repeats=1,
                          train_steps=3, train_rounds=1, warmup_steps=1)
HOSTS_FULL = HostsConfig()

#: The targets across hosts, for ratios measured within one run.
TARGETS: tuple[Target, ...] = (
    Target(key="allreduce_fraction_of_link", bound=0.9),
    Target(key="bf16_fraction_of_link", bound=1.8),
    Target(key="training_speedup_vs_raw", bound=2.0),
)

#: Headline keys and their types.
HEADLINE_KEYS: dict[str, type] = {
    "link_bytes_per_s": float,
    "allreduce_fraction_of_link": float,
    "bf16_fraction_of_link": float,
    "collective_fraction_of_link": float,
    "ceiling_fraction_of_link": float,
    "training_speedup_vs_raw": float,
}


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
  log(f"tfdist bench: link between {n} workers on {', '.join(hosts)} ...")
  link = link_lib.measure(
      rank=rank, hosts=hosts, rendezvous=transport.CoordinationRendezvous(),
      key="tfdist/bench/link", seconds=config.link_seconds,
      repeats=config.link_repeats, timeout_s=config.timeout_s)
  log("tfdist bench: all-reduce sweep ...")
  sweep = allreduce_lib.sweep(strategy, sizes_mb=config.sizes_mb,
                              methods=config.methods,
                              iterations=config.iterations)
  log(f"tfdist bench: training {_MODEL} ...")
  spec = {"models": {_MODEL: [{"name": "raw"},
                              {"name": "tfdist", **scaling.RECOMMENDED}]},
          "batch": {_MODEL: config.batch}, "steps": config.train_steps,
          "rounds": config.train_rounds,
          "warmup_steps": config.warmup_steps}
  train = cluster_worker.train_variants(strategy, spec,
                                        sorted(os.sched_getaffinity(0)))
  if not tfdist.is_chief(strategy):
    return None
  report = build(config=dataclasses.asdict(config), hosts=hosts, link=link,
                 sweep=sweep, train=train[_MODEL],
                 machine=runner.machine())
  validate(report)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1, sort_keys=True)
  if plot_path:
    write_plot({"this cluster": report}, plot_path)
  return report


def build(*, config: dict, hosts: list[str], link: dict, sweep: dict,
          train: dict, machine: dict) -> dict:
  """The report: headline ratios, targets met, and every raw figure."""
  rate = link["bytes_per_s"]
  fractions = {m: {size: figures["busbw"] / rate
                   for size, figures in per_size.items()}
               for m, per_size in sweep.items()}

  def smallest(method: str) -> float:
    """The method's lowest share of the link over sizes of 4 MiB and up."""
    big = [f for size, f in fractions[method].items() if float(size) >= 4]
    return min(big or fractions[method].values())

  speed = {v: figures["samples_per_s"] / (config["batch"] * len(hosts))
           for v, figures in train.items()}
  headline = {
      "link_bytes_per_s": float(rate),
      "allreduce_fraction_of_link": smallest(_HEADLINE_METHOD),
      "bf16_fraction_of_link": smallest("socket_bf16"),
      "collective_fraction_of_link": smallest("none"),
      "ceiling_fraction_of_link": smallest("exchange"),
      "training_speedup_vs_raw": speed["tfdist"] / speed["raw"],
  }
  model = projection.check(
      sweep=sweep, p=len(hosts), link=projection.Link(
          bytes_per_s=rate, latency_s=link.get("hop_latency_s") or 0.0))
  return {
      "kind": "across_hosts",
      "headline": headline,
      "model_check": model,
      "targets": {t.key: {"target": t.text, "value": headline[t.key],
                          "met": t.met(headline[t.key])} for t in TARGETS},
      "raw": {"hosts": hosts, "workers": len(hosts), "link": link,
              "allreduce": {"sweep": sweep, "fraction_of_link": fractions},
              "training": {"model": _MODEL, "steps_per_s": speed,
                           "windows_s": {v: f["windows_s"]
                                         for v, f in train.items()}}},
      "config": config,
      "machine": machine,
  }


def validate(report: dict) -> None:
  """Checks keys and types (asserts no speed).

  Raises:
    ReportError: a key is missing or holds the wrong type.
  """
  for key, kind in HEADLINE_KEYS.items():
    value = report.get("headline", {}).get(key)
    if not isinstance(value, kind) or value != value or value <= 0:
      raise report_lib.ReportError(
          f"across-hosts report: headline.{key} = {value!r}; expected a "
          f"positive {kind.__name__}")
  for method, per_size in report["raw"]["allreduce"]["sweep"].items():
    for size, figures in per_size.items():
      for key in ("seconds", "algbw", "busbw"):
        if not isinstance(figures.get(key), float):
          raise report_lib.ReportError(
              f"across-hosts report: sweep.{method}.{size}.{key} = "
              f"{figures.get(key)!r}; expected a float")


def format_table(report: dict) -> str:
  """The headline and the sweep as text, one figure per line."""
  h = report["headline"]
  raw = report["raw"]
  lines = [f"across {raw['workers']} workers on {', '.join(raw['hosts'])}: "
           f"link {h['link_bytes_per_s'] / 1e6:.0f} MB/s (TCP streams)"]
  for key, t in report["targets"].items():
    lines.append(f"  {key:<30} {t['value']:7.3f}  target {t['target']:<7} "
                 f"{'met' if t['met'] else 'NOT met'}")
  for key in ("collective_fraction_of_link", "ceiling_fraction_of_link"):
    lines.append(f"  {key:<30} {h[key]:7.3f}")
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
  speed = raw["training"]["steps_per_s"]
  lines.append(f"  {raw['training']['model']} steps/s: " + ", ".join(
      f"{v} {s:.2f}" for v, s in speed.items()))
  model = report.get("model_check")
  if model:
    lines.append(f"  ring model (alpha {model['latency_s'] * 1e6:.1f} us a "
                 f"hop, the link): measured / predicted time, by size:")
    for size, row in sorted(model["by_size"].items(),
                            key=lambda kv: float(kv[0])):
      lines.append(f"    {size:>6} MiB  predicted {row['predicted_s'] * 1e3:8.2f}"
                   " ms  " + "  ".join(
                       f"{m} {v['measured_over_predicted']:.2f}"
                       for m, v in row.items() if m != "predicted_s"))
  return "\n".join(lines)


def write_plot(reports: dict[str, dict], path: str) -> None:
  """One panel per report (e.g. per link rate): bus bandwidth / link by size.

  Args:
    reports: label -> across-hosts report.
    path: the PNG to write (needs matplotlib).
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  from tfdist.bench import plot  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(reports), figsize=(5.5 * len(reports), 4.2),
                           squeeze=False)
  for ax, (label, report) in zip(axes[0], reports.items()):
    fractions = report["raw"]["allreduce"]["fraction_of_link"]
    for method, per_size in fractions.items():
      sizes = sorted(per_size, key=float)
      ax.plot([float(s) for s in sizes], [per_size[s] for s in sizes],
              marker="o", label=plot.METHOD_LABELS.get(method, method))
    ax.axhline(1.0, color="black", linestyle=":", label="the link (TCP)")
    speed = report["raw"]["training"]["steps_per_s"]
    ax.set(xlabel="tensor size (MiB, float32)",
           ylabel="bus bandwidth / link",
           title=(f"{label}: link {report['headline']['link_bytes_per_s'] / 1e6:.0f}"
                  f" MB/s; {_MODEL} x{speed['tfdist'] / speed['raw']:.2f}"))
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
