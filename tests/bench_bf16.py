"""Where a bfloat16 all-reduce's time goes, on two hosts of the test bed.

Issue 42's item 3 asks bf16 on the wire to reach 1.6x the link's float32
rate, the README's way (one ``tfdist launch`` per host), at 2 hosts and
10 Gbit/s. This script takes one call apart, side by side in one run: every
method of `tfdist.bench.allreduce` named in ``--methods`` at each size, in
rounds, each round once with the ring's casts as they are (ml_dtypes) and
once through a C loop compiled here (``cast: c``; the same bits,
checked). Each bed host gets one core's share
(``TF_NUM_INTRAOP_THREADS=1``, as `tfdist launch` gives a task on a shared
machine), so the ring moves each step in one thread
(`tfdist.ring.exchange.threaded_bytes`); with ``--threads``, a large step
in two, as every ring did before 2026-11-28. ``exchange`` at half a size is
what bf16's bytes alone cost at that size. It needs root
and gcc, as the bed does; about a minute::

  .venv/bin/python tests/bench_bf16.py --rate 10gbit [--threads]

The C loop is a measurement only: tfdist ships none (docs/benchmarks.md,
"bf16 at 10 Gbit/s: where the time goes").
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile

_C = r"""
#include <stdint.h>
#include <string.h>
void encode(const float* in, uint16_t* out, long n) {  /* nearest even */
  for (long i = 0; i < n; i++) {
    uint32_t u; memcpy(&u, in + i, 4);
    uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    out[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                                             : r;  /* NaN stays quiet */
  }
}
void decode(const uint16_t* in, float* out, long n) {
  for (long i = 0; i < n; i++) {
    uint32_t u = (uint32_t)in[i] << 16; memcpy(out + i, &u, 4);
  }
}
"""


def _c_casts(workdir: str):
  """(encode, decode) through the C loop, for `socket_ring`'s two names."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfdist.ring import wire  # pylint: disable=g-import-not-at-top
  source = os.path.join(workdir, "bf16.c")
  lib = os.path.join(workdir, "bf16.so")
  with open(source, "w") as f:
    f.write(_C)
  subprocess.run(["gcc", "-O3", "-march=native", "-shared", "-fPIC", "-o",
                  lib, source], check=True)
  c = ctypes.CDLL(lib)
  for fn in (c.encode, c.decode):
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long)
  bf16 = np.dtype(ml_dtypes.bfloat16)
  probe = np.array([np.nan, np.inf, -0.0, 3e38, 1.00390625, 1.01171875],
                   np.float32)
  got = np.empty(probe.size, bf16)
  c.encode(probe.ctypes.data, got.ctypes.data, probe.size)
  if got.view(np.uint16).tolist() != probe.astype(bf16).view(
      np.uint16).tolist():
    raise RuntimeError("the C loop's bits differ from ml_dtypes'")

  def encode(values, into):
    if into.dtype != bf16:
      return wire.encode(values, into)
    c.encode(values.ctypes.data, into.ctypes.data, values.size)
    return wire.as_bytes(into)

  def decode(received, into):
    if received.dtype != bf16:
      return wire.decode(received, into)
    c.decode(received.ctypes.data, into.ctypes.data, received.size)
    return into

  return encode, decode


def worker(args) -> None:
  """One task's part: every task runs it at once (under tfdist launch)."""
  import tfdist  # pylint: disable=g-import-not-at-top
  from tfdist.bench import allreduce  # pylint: disable=g-import-not-at-top
  from tfdist.bench import link as link_lib  # pylint: disable=g-import-not-at-top
  from tfdist.ring import exchange  # pylint: disable=g-import-not-at-top
  from tfdist.ring import socket_ring  # pylint: disable=g-import-not-at-top
  from tfdist.ring import wire  # pylint: disable=g-import-not-at-top
  from tfdist.strategy import transport  # pylint: disable=g-import-not-at-top
  if args.threads:  # Every ring's default, directly and through TensorFlow.
    exchange.threaded_bytes = lambda: exchange.THREADED_BYTES
  strategy = tfdist.make_strategy("multi_worker_mirrored",
                                  transport="collective")
  rank, hosts, _ = transport.peers(strategy)
  link = link_lib.measure(
      rank=rank, hosts=hosts, rendezvous=transport.CoordinationRendezvous(),
      key="bench_bf16/link", seconds=1.0, repeats=2, timeout_s=120)
  with tempfile.TemporaryDirectory() as workdir:
    casts = {"ml": (wire.encode, wire.decode), "c": _c_casts(workdir)}
  times: dict[tuple, list[float]] = {}
  for r in range(args.rounds):
    for cast in sorted(casts, reverse=r % 2 == 1):
      socket_ring.encode, socket_ring.decode = casts[cast]
      sweep = allreduce.sweep(strategy, sizes_mb=args.sizes_mb,
                              methods=args.methods, iterations=3)
      for method, by_size in sweep.items():
        for size, figures in by_size.items():
          times.setdefault((method, float(size), cast), []).append(
              figures["seconds"])
  if rank:
    return
  rate = link["bytes_per_s"]
  print(f"link {rate / 1e6:.0f} MB/s; {args.rounds} rounds; "
        f"{'two threads a large step' if args.threads else 'one a step'}")
  print("method       MiB  cast  ms (least-most)        x link (float32 "
        "bytes reduced a second over the link's)")
  for (method, size, cast), t in sorted(times.items()):
    median = statistics.median(t)
    print(f"{method:12s} {size:4g} {cast:4s} {median * 1e3:7.3f} "
          f"({min(t) * 1e3:.3f}-{max(t) * 1e3:.3f})  "
          f"{size * (1 << 20) / median / rate:5.2f}", flush=True)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rate", default="10gbit")
  parser.add_argument("--sizes-mb", type=float, nargs="+",
                      default=[2, 4, 8, 16])
  parser.add_argument("--methods", nargs="+", default=[
      "exchange", "ring", "ring_bf16", "socket_bf16"])
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--threads", action="store_true")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args)
    return 0
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import cluster_utils  # pylint: disable=g-import-not-at-top
  import netbed  # pylint: disable=g-import-not-at-top
  from tfdist import _net  # pylint: disable=g-import-not-at-top
  names = ("node1", "node2")
  with netbed.NetBed(hosts=names, rate=args.rate) as bed:
    env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: "bench-bf16",
                                  "TF_NUM_INTRAOP_THREADS": "1"})
    argv = ["--sizes-mb", *map(str, args.sizes_mb), "--methods",
            *args.methods, "--rounds", str(args.rounds),
            *(["--threads"] if args.threads else [])]
    procs = [bed.popen(host, [
        sys.executable, "-m", "tfdist", "launch", "--nnodes", "2",
        "--node-rank", str(rank), "--master-addr", bed.address(names[0]),
        "--master-port", "29400", "--", sys.executable,
        os.path.abspath(__file__), "--worker", *argv], env=env,
        cwd=cluster_utils.REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for rank, host in enumerate(names)]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
  codes = [p.returncode for p in procs]
  print("\n".join(line.split("] ", 1)[-1] for line in outs[0].splitlines()
                  if line.startswith("[worker:0] ") and "cudart" not in line
                  and "cuInit" not in line))
  if codes != [0, 0]:
    print(f"bench_bf16: exit codes {codes}\n" + "\n".join(outs),
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
