"""Small all-reduces: the ring against recursive doubling, the ring alone.

`measure` starts ``n`` processes on this machine for each ``n`` of
``ranks`` (Python and numpy only, no TensorFlow, so 8 fit on 2 cores), each
a member of two `tfdist.ring.SocketRing` s joined through a directory: one
that always takes the ring (``schedule="ring"``) and one that always takes
recursive doubling (``schedule="doubling"``, `tfdist.ring.doubling`). Each process
times float32 all-reduces of each size by both, in alternating windows, and
rank 0 reports the medians: ``ring_s / doubling_s`` is what doubling gains
where the ring's ``2 (n - 1)`` steps, not the bytes, are the cost.
`tfdist.ring.socket_ring.choose` is what `SocketRing` takes by default.

Run as a module, it is one of those processes::

  python -m tfdist.bench.doubling --rank 0 --hosts 10.0.0.1,10.0.0.2 \\
      --dir DIR --sizes-kb 4,64 --windows 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Sequence

__all__ = ["measure", "main"]

_WINDOW_S = 0.05  # Aim of one timing window.


class _DirectoryRendezvous:
  """Ports published as files of one directory (every process on this host)."""

  def __init__(self, path: str):
    self._path = path

  def _file(self, key: str) -> str:
    return os.path.join(self._path, key.replace("/", "_"))

  def publish(self, key: str, value: str) -> None:
    staged = self._file(key) + ".staged"
    with open(staged, "w") as f:
      f.write(value)
    os.replace(staged, self._file(key))

  def lookup(self, key: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        with open(self._file(key)) as f:
          return f.read()
      except FileNotFoundError:
        if time.monotonic() > deadline:
          raise TimeoutError(key) from None
        time.sleep(0.01)


def measure(*, ranks: Sequence[int] = (2, 3, 4, 8),
            sizes_kb: Sequence[int] = (4, 64, 256, 1024), windows: int = 5,
            timeout_s: float = 300.0, hosts: Sequence[str] | None = None,
            wrap: Callable[[int, list[str]], list[str]] | None = None
            ) -> dict:
  """Times ring and recursive doubling at each size and process count.

  Args:
    ranks: process counts, one group after another.
    sizes_kb: float32 buffer sizes in KiB.
    windows: timing windows per size and schedule (alternating).
    timeout_s: limit on each group of processes.
    hosts: each rank's host or address, for one group spanning hosts
      (``ranks`` is then its size); 127.0.0.1 for every rank when ``None``.
    wrap: ``wrap(rank, argv)``: the command that runs ``argv`` on that
      rank's host (e.g. inside its network namespace); ``argv`` as it is
      when ``None``.

  Returns:
    ``{"ranks": {n: {kb: {"ring_s", "doubling_s", "speedup"}}},
    "chosen": {n: {kb: schedule}}}`` (keys as strings); ``speedup`` is
    ``ring_s / doubling_s``, ``chosen`` the rule's pick (`choose`).
  """
  from tfdist.bench import procs  # pylint: disable=g-import-not-at-top
  from tfdist.ring import socket_ring  # pylint: disable=g-import-not-at-top
  out: dict = {"ranks": {}, "chosen": {}}
  for n in ranks:
    where = list(hosts) if hosts else ["127.0.0.1"] * n
    if len(where) != n:
      raise ValueError(f"hosts: {len(where)} for a group of {n}")
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-doubling-") as d:
      commands = [procs.python_module(
          "tfdist.bench.doubling", "--rank", str(r), "--hosts",
          ",".join(where), "--dir", d, "--sizes-kb",
          ",".join(map(str, sizes_kb)), "--windows", str(windows))
                  for r in range(n)]
      if wrap:
        commands = [wrap(r, c) for r, c in enumerate(commands)]
      finished = procs.run_all(commands, [procs.worker_env()] * n,
                               timeout_s=timeout_s,
                               what=f"doubling with {n} processes")
    out["ranks"][str(n)] = procs.json_lines(finished[0].stdout)[-1]
    out["chosen"][str(n)] = {str(kb): socket_ring.choose(n, kb << 10)
                             for kb in sizes_kb}
  return out


def _time(fn, reps: int) -> float:
  start = time.perf_counter()
  for _ in range(reps):
    fn()
  return (time.perf_counter() - start) / reps


def main(argv: list[str] | None = None) -> int:
  """One process of a `measure` group; rank 0 prints the JSON."""
  parser = argparse.ArgumentParser(prog="tfdist.bench.doubling")
  parser.add_argument("--rank", type=int, required=True)
  parser.add_argument("--hosts", required=True,
                      help="every rank's host or address, comma-separated")
  parser.add_argument("--dir", required=True)
  parser.add_argument("--sizes-kb", required=True)
  parser.add_argument("--windows", type=int, default=5)
  args = parser.parse_args(argv)
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfdist import ring as ring_lib  # pylint: disable=g-import-not-at-top
  sizes = [int(s) for s in args.sizes_kb.split(",")]
  rendezvous = _DirectoryRendezvous(args.dir)
  hosts = args.hosts.split(",")
  common = dict(rank=args.rank, hosts=hosts, rendezvous=rendezvous,
                secret="tfdist bench", connect_timeout_s=60, timeout_s=60)
  ring = ring_lib.SocketRing(key="ring", schedule="ring", **common)
  doubled = ring_lib.SocketRing(key="doubling", schedule="doubling",
                                **common)
  figures = {}
  try:
    for kb in sizes:
      x = np.ones(kb * 256, np.float32)
      out = np.empty_like(x)
      calls = [lambda r=r: r.all_reduce(x, out=out) for r in (ring, doubled)]
      for call in calls:  # Connects, warms up.
        call()
      # The same repetitions on every rank (they call in step), from the
      # ring's time summed over the ranks: the same bits everywhere.
      probe = np.array([_time(calls[0], 3)], np.float32)
      total = float(ring.all_reduce(probe)[0])
      reps = int(max(3, min(1000, _WINDOW_S * len(hosts) / max(total, 1e-6))))
      times: list[list[float]] = [[], []]
      for _ in range(args.windows):
        for i, call in enumerate(calls):
          times[i].append(_time(call, reps))
      ring_s, doubling_s = (statistics.median(t) for t in times)
      figures[str(kb)] = {"ring_s": ring_s, "doubling_s": doubling_s,
                          "speedup": ring_s / doubling_s}
  finally:
    ring.close()
    doubled.close()
  if args.rank == 0:
    print(json.dumps(figures), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
