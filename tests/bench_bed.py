"""``tfdist bench --across-hosts`` on the network test bed, link rate by rate.

Two (or ``--hosts N``) hosts of a `netbed.NetBed` (network namespaces, their
links shaped with ``tc tbf``) each run ``tfdist launch --nnodes N`` of
``python -m tfdist bench --across-hosts``, as N machines would. The test
suite runs the quick preset at 1 and 10 Gbit/s between two hosts and at 10
Gbit/s between three (tests/test_bench_hosts.py); as a script it runs the
full bench at the rates given and writes one report and one plot for all of
them (needs root, as the bed does; minutes)::

  sudo .venv/bin/python tests/bench_bed.py --hosts 2 --rates 1gbit 10gbit \\
      --json docs/bench_hosts.json --plot docs/bench_hosts_plot.png

With ``--schedules`` it sweeps float32 all-reduces instead, every schedule
of the socket ring and the rule against the alpha-beta model, with the link
measured in the same run (`tfdist.bench.schedules`, no TensorFlow), on each
host count of ``--schedule-hosts`` at each rate, and at each one-way
latency of ``--delays-us`` added by relays (`tfdist.bench.relay`; up to
``--relay-max-kb``, the latency-bound sizes)::

  sudo .venv/bin/python tests/bench_bed.py --schedules --rates 1gbit \
      --schedule-hosts 2 4 8 16 --delays-us 0 25 250 \
      --json schedules.json --plot schedules.png

``--table JSON`` prints a saved sweep's table (as docs/benchmarks.md has
it) and a line for each point beyond 1.1x (`misses`), with no bed.

Each report of the script carries ``bed``: the host count, the rate, each
host's TensorFlow intra-op threads (its share of this machine's cores) and
the machine's load averages (``os.getloadavg``) just before and just after
its run, since the bed's hosts share this machine's cores with whatever else
runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

from tfdist import _net
from tfdist import _process
from tfdist.bench import plot as plot_lib
from tfdist.bench import report as report_lib
from tfdist.bench import schedules as schedules_lib

import cluster_utils
import netbed

SECRET = "bench-bed-secret"


def host_names(count: int) -> tuple[str, ...]:
  """The bed's host names for ``count`` hosts: node1, node2, ..."""
  if count < 2:
    raise ValueError(f"hosts: expected 2 or more, got {count}")
  return tuple(f"node{i + 1}" for i in range(count))


def intra_op_threads(hosts: int) -> str:
  """Each host's TensorFlow intra-op threads: ``TF_NUM_INTRAOP_THREADS``
  where set, else each of ``hosts`` hosts' share of this machine's cores
  (at least 1)."""
  return (os.environ.get(_process.INTRA_OP)
          or str(max(1, _process.cores() // hosts)))


def run_on_bed(rate: str, *, quick: bool, workdir: str, timeout: float,
               hosts: int = 2, model: str | None = None,
               bucket_mib: int | None = None
               ) -> tuple[dict | None, list[str], list[int]]:
  """The chief's report, every launcher's output and their exit codes.

  Args:
    rate: the ``tc tbf`` rate of every host's link (e.g. ``"10gbit"``).
    quick: the quick preset of the bench.
    workdir: where the chief writes its report.
    timeout: bound on the launchers, seconds.
    hosts: how many hosts (one worker each).
    model: ``tfdist bench --model``; the bench's default when ``None``.
    bucket_mib: ``tfdist bench --bucket-mib``; the default when ``None``.
  """
  names = host_names(hosts)
  json_path = os.path.join(workdir, f"hosts-{rate}.json")
  with netbed.NetBed(hosts=names, rate=rate) as bed:
    env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: SECRET})
    # Each host's launcher runs one task, so it would leave TensorFlow every
    # core; the bed's hosts share this machine's, so each gets its share, as
    # a host of its own would (docs/benchmarks.md, "Tasks that share cores").
    env["TF_NUM_INTRAOP_THREADS"] = intra_op_threads(hosts)
    procs = [bed.popen(host, [
        sys.executable, "-m", "tfdist", "launch", "--nnodes", str(hosts),
        "--node-rank", str(rank), "--master-addr", bed.address(names[0]),
        "--master-port", "29400", "--", sys.executable, "-m", "tfdist",
        "bench", "--across-hosts", *(["--quick"] if quick else []),
        *(["--model", model] if model else []),
        *(["--bucket-mib", str(bucket_mib)] if bucket_mib is not None
          else []),
        "--json", json_path], env=env, cwd=cluster_utils.REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, host in enumerate(names)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
  report = None
  if os.path.exists(json_path):
    with open(json_path) as f:
      report = json.load(f)
  return report, outs, [p.returncode for p in procs]


def schedules_on_bed(rate: str, *, hosts: int, delays_us: Sequence[int],
                     sizes_kb: Sequence[int], relay_max_kb: int,
                     windows: int, timeout: float) -> dict[int, dict]:
  """`tfdist.bench.schedules.measure` across ``hosts`` hosts of one bed,
  once per one-way delay (µs; 0: no relay), each with its ``bed`` entry:
  the host count, the rate, the delay and this machine's load averages
  just before and after."""
  names = host_names(hosts)
  out = {}
  with netbed.NetBed(hosts=names, rate=rate) as bed:
    for delay in delays_us:
      before = os.getloadavg()
      report = schedules_lib.measure(
          ranks=(hosts,), windows=windows, delay_s=delay * 1e-6,
          sizes_kb=[kb for kb in sizes_kb if not delay or kb <= relay_max_kb],
          timeout_s=timeout, hosts=[bed.address(h) for h in names],
          wrap=lambda rank, argv: bed.command(names[rank], argv)
      )["ranks"][str(hosts)]
      report["bed"] = {"hosts": hosts, "rate": rate, "delay_us": delay,
                       "load_before": list(before),
                       "load_after": list(os.getloadavg())}
      out[delay] = report
  return out


def _schedules_line(key: str, report: dict) -> str:
  """One line of a sweep: per size, the rule's pick and its time over the
  fastest schedule's."""
  sizes = ", ".join(f"{kb} KiB {s['rule']['pick']} {s['chosen_vs_best']:.2f}"
                    for kb, s in report["sizes"].items())
  return (f"bench_bed: {key}: alpha {report['alpha_s'] * 1e6:.1f} us, B "
          f"{report['bytes_per_s'] / 1e6:.1f} MB/s, same bits "
          f"{report['same_bits']}; rule / fastest: {sizes}")


#: Issue 42's pass: the rule's time within 1.1x of the fastest schedule's.
WITHIN = 1.1


def _beyond(ratio: float) -> bool:
  """Beyond `WITHIN`, as printed (two decimals)."""
  return round(ratio, 2) > WITHIN


def schedules_table(results: dict[str, dict]) -> str:
  """A markdown table of a `--schedules` JSON: a row per rate, delay and
  host count (the latency and rate the rule's ring measured), a column per
  size; each cell the rule's pick and its time over the fastest forced
  schedule's, median (its windows' least-most over the same), ``*`` beyond
  1.1x."""
  def order(key: str) -> tuple:  # 1gbit before 10gbit; delay, then hosts.
    rate, hosts, delay = key.split("/")
    return len(rate), rate, int(delay[:-2]), int(hosts)

  keys = sorted(results, key=order)
  sizes = sorted({kb for k in keys for kb in results[k]["sizes"]}, key=int)
  rows = ["| rate | added | hosts | rule's link | " + " | ".join(
      f"{kb} KiB" if int(kb) < 1024 else f"{int(kb) >> 10} MiB"
      for kb in sizes) + " |", "|---" * (4 + len(sizes)) + "|"]
  for key in keys:
    rate, hosts, delay = key.split("/")
    r = results[key]
    cells = []
    for kb in sizes:
      s = r["sizes"].get(kb)
      if s is None:
        cells.append("")
        continue
      best = min(v["measured_s"] for v in s["schedules"].values())
      least, most = (t / best for t in s["rule"]["spread_s"])
      ratio = s["chosen_vs_best"]
      cells.append(f"{s['rule']['pick']} {ratio:.2f}"
                   f"{'*' if _beyond(ratio) else ''} ({least:.2f}-{most:.2f})")
    link = r["rule_link"]
    rows.append(f"| {rate} | {delay[:-2]} us | {hosts} | "
                f"{link['latency_s'] * 1e6:.0f} us, "
                f"{link['bytes_per_s'] / 1e6:.0f} MB/s | " + " | ".join(cells)
                + " |")
  return "\n".join(rows)


def misses(results: dict[str, dict]) -> list[str]:
  """The points of a `--schedules` JSON where the rule took over 1.1x the
  fastest forced schedule's time, a line each: whether the pick's own forced
  windows were within 1.1x of the fastest (the rule's run's spread, not its
  pick) and how busy the processes kept this machine's cores."""
  out = []
  for key, r in sorted(results.items()):
    for kb, s in sorted(r["sizes"].items(), key=lambda item: int(item[0])):
      if not _beyond(s["chosen_vs_best"]):
        continue
      timed = {k: v["measured_s"] for k, v in s["schedules"].items()}
      pick, fastest = s["rule"]["pick"], min(timed, key=timed.get)
      forced = timed[pick] / timed[fastest]
      out.append(f"{key} {kb} KiB: {pick} {s['chosen_vs_best']:.2f} over "
                 f"{fastest}; {pick} forced {forced:.2f} "
                 f"({'pick' if _beyond(forced) else 'spread'}); "
                 f"{s['busy_cores']:.2f} of {r['cores']} cores busy")
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--hosts", type=int, default=2,
                      help="hosts of the bed, one worker each")
  parser.add_argument("--json")
  parser.add_argument("--table", metavar="JSON",
                      help="print a saved --schedules JSON's table and "
                           "misses; runs no bed")
  parser.add_argument("--plot")
  parser.add_argument("--model", help="tfdist bench --model")
  parser.add_argument("--bucket-mib", type=int,
                      help="tfdist bench --bucket-mib")
  parser.add_argument("--timeout", type=float, default=1200)
  parser.add_argument("--schedules", action="store_true",
                      help="all-reduce schedules against their model")
  parser.add_argument("--schedule-hosts", type=int, nargs="+",
                      default=[2, 4, 8, 16])
  parser.add_argument("--delays-us", type=int, nargs="+", default=[0],
                      help="one-way latencies added by relays (0: none)")
  parser.add_argument("--sizes-kb", type=int, nargs="+",
                      default=list(schedules_lib.SIZES_KB))
  parser.add_argument("--relay-max-kb", type=int, default=1024,
                      help="largest size swept through relays")
  parser.add_argument("--windows", type=int, default=5)
  args = parser.parse_args()
  if args.table:
    with open(args.table) as f:
      results = json.load(f)
    print("\n".join([schedules_table(results), ""] + misses(results)))
    return 0
  if not args.json:
    parser.error("--json is required unless --table is given")
  if args.schedules:
    results = {}
    for rate in args.rates:
      for n in args.schedule_hosts:
        by_delay = schedules_on_bed(
            rate, hosts=n, delays_us=args.delays_us, sizes_kb=args.sizes_kb,
            relay_max_kb=args.relay_max_kb, windows=args.windows,
            timeout=args.timeout)
        for delay, report in by_delay.items():
          key = f"{rate}/{n}/{delay}us"
          results[key] = report
          print(_schedules_line(key, report), flush=True)
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1, sort_keys=True)
    if args.plot:
      plot_lib.write_schedules_plot(results, args.plot)
    print(schedules_table(results))
    return 0
  reports = {}
  with tempfile.TemporaryDirectory() as workdir:
    for rate in args.rates:
      before = os.getloadavg()
      report, outs, codes = run_on_bed(rate, quick=args.quick,
                                       workdir=workdir, timeout=args.timeout,
                                       hosts=args.hosts, model=args.model,
                                       bucket_mib=args.bucket_mib)
      after = os.getloadavg()
      if codes != [0] * args.hosts or report is None:
        print(f"bench_bed: {rate}: exit codes {codes}\n" + "\n".join(outs),
              file=sys.stderr)
        return 1
      report["bed"] = {"hosts": args.hosts, "rate": rate,
                       "quick": args.quick, "load_before": list(before),
                       "load_after": list(after),
                       "intra_op_threads": intra_op_threads(args.hosts)}
      reports[rate] = report
      print(f"bench_bed: {rate}: load average {before[0]:.2f} before, "
            f"{after[0]:.2f} after", flush=True)
      print(f"== {rate}\n{report_lib.format_hosts(report)}", flush=True)
  with open(args.json, "w") as f:
    json.dump(reports, f, indent=1, sort_keys=True)
  if args.plot:
    plot_lib.write_hosts_plot(reports, args.plot)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
