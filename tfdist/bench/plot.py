"""The bench plots: throughput against workers, bandwidth against size, the
model's efficiency against hosts (``tfdist bench --project --plot``), the
all-reduce schedules' times against their model by host count, and the
bench across hosts' bandwidth against the link and its timeline."""

from __future__ import annotations

__all__ = ["write_plot", "write_projection_plot", "write_schedules_plot",
           "write_hosts_plot", "pyplot", "METHOD_LABELS"]


_LINES = {"raw": "--", "tfdist": "-", "alone": ":"}
_VARIANTS = {"raw": "raw MultiWorkerMirrored", "tfdist": "tfdist",
             "alone": "alone (nothing exchanged: ceiling)"}
#: How the plots name the all-reduce sweep's methods.
METHOD_LABELS = {
    "none": "TF collectives, float32",
    "fp16": "TF collectives, fp16",
    "bf16": "TF collectives, bf16",
    "socket": "tfdist socket, float32",
    "socket_fp16": "tfdist socket, fp16",
    "socket_bf16": "tfdist socket, bf16",
    "socket_unaligned": "tfdist socket, float32, gradients off 64-byte bounds",
    "ring": "ring alone, float32",
    "ring_bf16": "ring alone, bf16",
    "ring_polled": "ring alone, float32, one polling thread",
    "exchange": "exchange, no arithmetic (ceiling)",
}


def pyplot():
  """matplotlib's pyplot, drawing to files only (no display); imported at
  the first plot, so the bench runs without matplotlib until then."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def write_plot(report: dict, path: str) -> None:
  """Writes a two-panel PNG of ``report`` to ``path`` (needs matplotlib)."""
  plt = pyplot()
  scaling = report["raw"]["scaling"]
  sweep = report["raw"]["allreduce"]["sweep"]
  loopback = report["raw"]["allreduce"]["loopback_bytes_per_s"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  counts = scaling["worker_counts"]
  for model, by_variant in scaling["samples_per_s"].items():
    for variant in ("raw", "tfdist", "alone"):
      if variant not in by_variant:
        continue
      ys = [by_variant[variant][str(n)] for n in counts]
      left.plot(counts, ys, marker="o", linestyle=_LINES[variant],
                label=f"{model} {_VARIANTS[variant]}")
    one = by_variant["tfdist"]["1"]
    left.plot(counts, [one * n for n in counts], color="grey", linewidth=0.6)
  left.set(xlabel="workers", ylabel="samples/s", xticks=counts,
           title="Throughput (grey: linear scaling)")
  left.set_yscale("log")
  left.legend(fontsize=8)
  for name, per_size in sweep.items():
    sizes = sorted(per_size, key=float)
    right.plot([float(s) for s in sizes],
               [per_size[s]["algbw"] / 1e6 for s in sizes], marker="o",
               label=METHOD_LABELS.get(name, name))
  right.axhline(loopback / 1e6, color="black", linestyle=":",
                label="one TCP stream, loopback")
  right.set(xlabel="tensor size (MiB, float32)",
            ylabel="effective float32 MB/s", title="All-reduce bandwidth")
  right.set_xscale("log", base=2)
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_projection_plot(table: dict, path: str) -> None:
  """Writes `tfdist.bench.projection.project`'s efficiencies as a PNG.

  One panel per workload: the share of one host's speed each host keeps
  against the number of hosts, a colour per link rate, the ring solid and
  the socket ring's pick (``tfdist``) dashed (needs matplotlib).
  """
  plt = pyplot()
  workloads = table["steps"]
  fig, axes = plt.subplots(1, len(workloads),
                           figsize=(5.5 * len(workloads), 4.2), squeeze=False)
  for ax, (name, by_rate) in zip(axes[0], workloads.items()):
    for i, (rate, by_hosts) in enumerate(by_rate.items()):
      hosts = sorted(by_hosts, key=int)
      for schedule, style in (("ring", "-"), ("tfdist", "--")):
        ax.plot([int(p) for p in hosts],
                [by_hosts[p][schedule]["efficiency"] for p in hosts],
                linestyle=style, marker="o", markersize=3, color=f"C{i}",
                label=f"{rate} Gbit/s, {schedule}")
    ax.set(xlabel="hosts", ylabel="efficiency (compute / step)",
           title=f"{name}: modelled scaling", ylim=(0, 1.05))
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_schedules_plot(reports: dict[str, dict], path: str) -> None:
  """Writes sweeps of `tfdist.bench.schedules.report` as a PNG.

  A panel per host count (columns) and per rate and relay delay (rows, from
  each report's ``bed``): each schedule's measured time against the size,
  solid, its model's dashed in the same colour, the rule's pick as black
  crosses (needs matplotlib).
  """
  plt = pyplot()
  columns = sorted({r["ranks"] for r in reports.values()})
  rows = sorted({(r["bed"]["rate"], r["bed"]["delay_us"])
                 for r in reports.values()})
  fig, axes = plt.subplots(len(rows), len(columns), squeeze=False,
                           figsize=(4.2 * len(columns), 3.6 * len(rows)))
  for report in reports.values():
    rate, delay = report["bed"]["rate"], report["bed"]["delay_us"]
    ax = axes[rows.index((rate, delay))][columns.index(report["ranks"])]
    sizes = sorted(report["sizes"], key=int)
    kib = [int(kb) for kb in sizes]
    names = list(report["sizes"][sizes[0]]["schedules"])
    for i, name in enumerate(names):
      rows_of = [report["sizes"][kb]["schedules"][name] for kb in sizes]
      ax.plot(kib, [r["measured_s"] * 1e3 for r in rows_of], marker="o",
              markersize=3, color=f"C{i}", label=name)
      ax.plot(kib, [r["model_s"] * 1e3 for r in rows_of], linestyle="--",
              color=f"C{i}", linewidth=0.8)
    ax.plot(kib, [report["sizes"][kb]["rule"]["measured_s"] * 1e3
                  for kb in sizes], "kx", label="the rule's pick")
    ax.set(xlabel="float32 KiB", ylabel="ms per all-reduce",
           title=f"{report['ranks']} hosts, {rate}"
                 + (f", +{delay} us (relay)" if delay else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend(fontsize=7, title="dashed: model", title_fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_hosts_plot(reports: dict[str, dict], path: str) -> None:
  """One panel per report (e.g. per link rate): bus bandwidth / link by size.

  Args:
    reports: label -> across-hosts report.
    path: the PNG to write (needs matplotlib).
  """
  plt = pyplot()
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
              marker="o", label=METHOD_LABELS.get(method, method))
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
