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

With ``--doubling`` it times small all-reduces instead, the ring against
recursive doubling (`tfdist.bench.doubling`, no TensorFlow), on 2, 3 and 4
hosts (``--doubling-hosts``) at each rate::

  sudo .venv/bin/python tests/bench_bed.py --doubling --rates 1gbit 10gbit \\
      --json docs/bench_doubling_hosts.json

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

from tfdist import _net
from tfdist.bench import doubling as doubling_lib
from tfdist.bench import hosts as hosts_lib

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
  return (os.environ.get("TF_NUM_INTRAOP_THREADS")
          or str(max(1, len(os.sched_getaffinity(0)) // hosts)))


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


def doubling_on_bed(rate: str, *, hosts: int, sizes_kb: list[int],
                    windows: int, timeout: float) -> dict:
  """`tfdist.bench.doubling.measure` across ``hosts`` hosts of the bed."""
  names = host_names(hosts)
  with netbed.NetBed(hosts=names, rate=rate) as bed:
    return doubling_lib.measure(
        ranks=(hosts,), sizes_kb=sizes_kb, windows=windows,
        timeout_s=timeout, hosts=[bed.address(h) for h in names],
        wrap=lambda rank, argv: bed.command(names[rank], argv))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--hosts", type=int, default=2,
                      help="hosts of the bed, one worker each")
  parser.add_argument("--json", required=True)
  parser.add_argument("--plot")
  parser.add_argument("--model", help="tfdist bench --model")
  parser.add_argument("--bucket-mib", type=int,
                      help="tfdist bench --bucket-mib")
  parser.add_argument("--timeout", type=float, default=1200)
  parser.add_argument("--doubling", action="store_true",
                      help="small all-reduces: ring against recursive "
                           "doubling")
  parser.add_argument("--doubling-hosts", type=int, nargs="+",
                      default=[2, 3, 4])
  args = parser.parse_args()
  if args.doubling:
    results = {}
    for rate in args.rates:
      for n in args.doubling_hosts:
        before = os.getloadavg()
        result = doubling_on_bed(rate, hosts=n, sizes_kb=[1, 4, 16, 64, 256],
                                 windows=3 if args.quick else 7,
                                 timeout=args.timeout)
        result["bed"] = {"hosts": n, "rate": rate,
                         "load_before": list(before),
                         "load_after": list(os.getloadavg())}
        results[f"{rate}/{n}"] = result
        print(f"bench_bed: {rate}, {n} hosts, ring time / doubling time by "
              "KiB: " + ", ".join(
                  f"{kb}: {v['speedup']:.2f}"
                  for kb, v in result["ranks"][str(n)].items()), flush=True)
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1, sort_keys=True)
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
      print(f"== {rate}\n{hosts_lib.format_table(report)}", flush=True)
  with open(args.json, "w") as f:
    json.dump(reports, f, indent=1, sort_keys=True)
  if args.plot:
    hosts_lib.write_plot(reports, args.plot)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
