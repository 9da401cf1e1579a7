"""The socket ring's all-reduce schedules, measured against their model.

`measure` starts ``n`` processes on this machine for each ``n`` of
``ranks`` (numpy, no TensorFlow; with ``wrap``, each in its own host of the
network bed), joined through a directory (`DirectoryRendezvous`). Each
holds one `tfdist.ring.SocketRing` per schedule of
`tfdist.ring.socket_ring.SCHEDULES`, forced, and one that follows the rule.
In one run: the link (`tfdist.bench.link`: B and alpha); with ``delay_s``,
relays holding each chunk that long (`tfdist.bench.relay`; alpha is then
measured through them, B is not); then float32 buffers of each size,
every ring in alternating windows, medians, each rank's processor seconds
and a hash of each ring's result.

`sweep` is one rank's part (``tfdist bench --across-hosts`` calls it in every
task); `report` sets each schedule's median beside its model's time and
scores the figures of `tfdist.bench.figures` (``chosen_vs_best``,
``busbw_fraction``).

Run as a module, it is one of those processes::

  python -m tfdist.bench.schedules --rank 0 --hosts 10.0.0.1,10.0.0.2 \\
      --dir DIR --sizes-kb 4,64 --windows 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Sequence

import numpy as np

from tfdist import _process
from tfdist.bench import figures
from tfdist.bench import link as link_lib
from tfdist.bench import procs
from tfdist.bench import relay as relay_lib
from tfdist.ring import socket_ring
from tfdist.ring.connection import Rendezvous

__all__ = ["DirectoryRendezvous", "SIZES_KB", "RULE", "measure", "sweep",
           "report", "main"]

#: float32 buffer sizes swept by default: 4 KiB to 64 MiB, powers of 4.
SIZES_KB = tuple(4 ** k for k in range(1, 9))
#: The report's name of the ring that follows the rule.
RULE = "rule"
BUSBW_FROM_KB = 4096  # Bus bandwidth is scored from this size up.
_WINDOW_S = 0.05  # Aim of one timing window.


class DirectoryRendezvous:
  """Values published as files of one directory (every process on this
  machine, the bed's hosts included)."""

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


class _Relayed:
  """A rendezvous that publishes, for each ring's listening port, the port
  of this rank's relay in front of it (`tfdist.ring.connection` publishes
  nothing else)."""

  def __init__(self, inner: Rendezvous, relay, delay_s: float):
    self._inner, self._relay, self._delay_s = inner, relay, delay_s

  def publish(self, key: str, value: str) -> None:
    self._inner.publish(key, str(self._relay.forward(int(value),
                                                     self._delay_s)))

  def lookup(self, key: str, timeout_s: float) -> str:
    return self._inner.lookup(key, timeout_s)


def measure(*, ranks: Sequence[int] = (2, 4, 8),
            sizes_kb: Sequence[int] = SIZES_KB, windows: int = 5,
            delay_s: float = 0.0, link_seconds: float = 1.0,
            link_repeats: int = 3, timeout_s: float = 600.0,
            hosts: Sequence[str] | None = None,
            wrap: Callable[[int, list[str]], list[str]] | None = None
            ) -> dict:
  """Times every schedule and the rule at each size and process count.

  Args:
    ranks: process counts, one group after another.
    sizes_kb: float32 buffer sizes in KiB.
    windows: timing windows per size and ring (alternating).
    delay_s: with more than 0, every ring connection goes through a relay
      holding each chunk this long one way (`tfdist.bench.relay`).
    link_seconds: how long each of the link's streams sends.
    link_repeats: the link's streams timed (median).
    timeout_s: limit on each group of processes, and on any one wait.
    hosts: each rank's host or address, for one group spanning hosts
      (``ranks`` is then its size); 127.0.0.1 for every rank when ``None``.
    wrap: ``wrap(rank, argv)``: the command that runs ``argv`` on that
      rank's host (e.g. inside its network namespace); ``argv`` as it is
      when ``None``.

  Returns:
    ``{"ranks": {n: report(...)}}`` (keys as strings).

  Raises:
    ValueError: ``hosts`` that are not one per rank.
    tfdist.bench.procs.BenchProcessError: a process failed or ran late.
  """
  out: dict = {"ranks": {}}
  for n in ranks:
    where = list(hosts) if hosts else ["127.0.0.1"] * n
    if len(where) != n:
      raise ValueError(f"hosts: {len(where)} for a group of {n}")
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-schedules-") as d:
      commands = [procs.python_module(
          "tfdist.bench.schedules", "--rank", str(r), "--hosts",
          ",".join(where), "--dir", d, "--sizes-kb",
          ",".join(map(str, sizes_kb)), "--windows", str(windows),
          "--delay-s", repr(delay_s), "--link-seconds", repr(link_seconds),
          "--link-repeats", str(link_repeats), "--timeout-s",
          repr(timeout_s)) for r in range(n)]
      if wrap:
        commands = [wrap(r, c) for r, c in enumerate(commands)]
      finished = procs.run_all(commands, [procs.worker_env()] * n,
                               timeout_s=timeout_s,
                               what=f"schedules with {n} processes")
    out["ranks"][str(n)] = report(procs.json_lines(finished[0].stdout)[-1])
  return out


def report(raw: dict) -> dict:
  """Rank 0's figures set against the model, the rule scored.

  Args:
    raw: what rank 0 printed: ``ranks``, ``cores``, ``link``
      (`tfdist.bench.link.measure`'s), ``relay`` (or ``None``), and
      ``sizes``: by KiB, each ring's ``seconds`` (median), the rule's
      ``pick``, every rank's ``cpu_s`` (its relay's included), ``wall_s``
      and result hashes.

  Returns:
    ``ranks``, ``cores``, ``link``, ``relay`` (``None``, or its delay,
    hop latencies and the figures it ``carried``), ``rule_link`` (what the
    rule's ring measured as it connected: `SocketRing.link`), ``alpha_s`` and
    ``bytes_per_s`` (the model's), ``same_bits`` (every rank's result
    hashes agree for every ring and size; ``differing`` names any that do
    not), ``sizes`` by KiB: ``schedules`` (each with ``measured_s``, its
    windows' ``spread_s`` (least, most), ``model_s``, ``measured_vs_model``),
    ``rule`` (``pick``, ``measured_s``, ``spread_s``), ``best`` (``measured``,
    ``model``), ``chosen_vs_best``
    (the rule's time over the fastest schedule's), ``busbw_fraction`` (the
    rule's bus bandwidth over B), ``busy_cores`` (the processes' CPU
    seconds per second) and ``cpu_s`` by rank; and ``targets``, each with
    ``value``, ``target``, ``met``, ``at_kb`` and, when missed, ``why``.
  """
  n, link, relay = raw["ranks"], raw["link"], raw["relay"]
  alpha = relay["hop_latency_s"] if relay else link["hop_latency_s"]
  rate = link["bytes_per_s"]
  if relay:
    relay = {**relay, "carried": ["alpha_s", "sizes"]}  # Not B.
  out = {"ranks": n, "cores": raw["cores"], "link": link, "relay": relay,
         "rule_link": raw["rule_link"], "alpha_s": alpha, "bytes_per_s": rate,
         "sizes": {}}
  differing = []
  for kb, got in raw["sizes"].items():
    nbytes = int(kb) << 10
    rows = {}
    for name, module in socket_ring.SCHEDULES.items():
      measured = got["seconds"][name]
      model = module.seconds(n, nbytes, latency_s=alpha, bytes_per_s=rate)
      rows[name] = {"measured_s": measured, "model_s": model,
                    "spread_s": got["spread"][name],
                    "measured_vs_model": measured / model}
    rule_s = got["seconds"][RULE]
    fastest = min(rows, key=lambda s: rows[s]["measured_s"])
    out["sizes"][kb] = {
        "bytes": nbytes, "schedules": rows,
        "rule": {"pick": got["pick"], "measured_s": rule_s,
                 "spread_s": got["spread"][RULE]},
        "best": {"measured": fastest,
                 "model": min(rows, key=lambda s: rows[s]["model_s"])},
        "chosen_vs_best": rule_s / rows[fastest]["measured_s"],
        "busbw_fraction": nbytes / rule_s * 2 * (n - 1) / n / rate,
        "busy_cores": sum(got["cpu_s"]) / max(got["wall_s"]),
        "cpu_s": got["cpu_s"]}
    differing += [f"{kb} KiB {name}" for name, digests in
                  got["digests"].items() if len(set(digests)) != 1]
  out["same_bits"] = not differing
  if differing:
    out["differing"] = differing
  out["targets"] = _targets(out)
  return out


def _targets(out: dict) -> dict:
  """The rule's worst size for each figure of the sweep, scored."""
  sizes, targets = out["sizes"], {}
  for f in figures.of("schedules"):
    scored = [kb for kb in sizes
              if f.name != "busbw_fraction" or int(kb) >= BUSBW_FROM_KB]
    if scored:
      kb = f.worst({kb: sizes[kb][f.name] for kb in scored})
      targets[f.name] = {**figures.score(f, sizes[kb][f.name],
                                         ranks=out["ranks"], out=out, kb=kb),
                         "at_kb": int(kb)}
  return targets


def _time(fn, reps: int) -> float:
  start = time.perf_counter()
  for _ in range(reps):
    fn()
  return (time.perf_counter() - start) / reps


def _cpu_s(relay: relay_lib.Relay | None) -> float:
  """This process's processor seconds, and its relay's."""
  t = os.times()
  return t.user + t.system + (relay.cpu_s() if relay else 0.0)


def _relay_hops(*, rank: int, hosts: list[str], rendezvous: Rendezvous,
                key: str, relay: relay_lib.Relay, delays: Sequence[float],
                timeout_s: float) -> list[float]:
  """Hop latencies round the ring through the relays, one per delay (rank
  0's; others' are ``None``)."""
  n = len(hosts)
  right, left = (rank + 1) % n, (rank - 1) % n
  hops = []
  for delay in delays:
    at = f"{key}/{delay!r}"
    with link_lib.listener(hosts[rank], timeout_s) as server:
      rendezvous.publish(f"{at}/{rank}", str(relay.forward(
          server.getsockname()[1], delay)))
      port = int(rendezvous.lookup(f"{at}/{right}", timeout_s))
      hops.append(link_lib.hop_latency(
          server=server, right=(hosts[right], port), rank=rank, left=left,
          key=at, n=n, timeout_s=timeout_s))
  return hops


def sweep(*, rank: int, hosts: Sequence[str], rendezvous: Rendezvous,
          key: str, link: dict, sizes_kb: Sequence[int], windows: int,
          delay_s: float = 0.0, secret: bytes | str | None = None,
          timeout_s: float = 600.0) -> dict | None:
  """One rank's part of the sweep: every rank calls it at once.

  Args:
    rank: this rank's place, 0 to ``len(hosts) - 1``.
    hosts: every rank's host or address, by rank.
    rendezvous: where the rings, relays and results are exchanged.
    key: a prefix no other use of ``rendezvous`` shares; the same on every
      rank.
    link: `tfdist.bench.link.measure`'s result between these ranks.
    sizes_kb: float32 buffer sizes in KiB.
    windows: timing windows per size and ring (alternating).
    delay_s: with more than 0, every ring connection goes through a relay
      holding each chunk this long one way (`tfdist.bench.relay`).
    secret: the rings' secret, the same on every rank; the job's
      (``TFDIST_JOB_SECRET``) when ``None``.
    timeout_s: bound on connecting and on any one wait.

  Returns:
    On rank 0, the raw figures `report` takes; ``None`` elsewhere.
  """
  hosts = list(hosts)
  relay, relayed, rings_rendezvous = None, None, rendezvous
  if delay_s > 0:
    relay = relay_lib.Relay(hosts[rank], timeout_s=timeout_s)
    zero, held = _relay_hops(rank=rank, hosts=hosts, rendezvous=rendezvous,
                             key=f"{key}/relay-hop", relay=relay,
                             delays=(0.0, delay_s), timeout_s=timeout_s)
    if rank == 0:
      relayed = {"delay_s": delay_s, "hop_latency_s": held,
                 "hop_latency_zero_s": zero,
                 "added_latency_s": zero - link["hop_latency_s"]}
    rings_rendezvous = _Relayed(rendezvous, relay, delay_s)
  common = dict(rank=rank, hosts=hosts, rendezvous=rings_rendezvous,
                secret=secret, connect_timeout_s=timeout_s,
                timeout_s=timeout_s)
  rings = {name: socket_ring.SocketRing(key=f"{key}/{name}", schedule=name,
                                        **common)
           for name in socket_ring.SCHEDULES}
  rings[RULE] = socket_ring.SocketRing(key=f"{key}/{RULE}", **common)
  try:
    mine = {str(kb): _timed(rings, kb=kb, windows=windows,
                            ranks=len(hosts), relay=relay,
                            rng=np.random.default_rng(rank))
            for kb in sizes_kb}
    # A relay may still hold a peer's last bytes: nobody closes before
    # every rank has its results.
    rendezvous.publish(f"{key}/result/{rank}", json.dumps(mine))
    ranks = [json.loads(rendezvous.lookup(f"{key}/result/{r}", timeout_s))
             for r in range(len(hosts))]
    rule_link = rings[RULE].link
  finally:
    for r in rings.values():
      r.close()
    if relay is not None:
      relay.close()
  if rank != 0:
    return None
  sizes = {kb: {"seconds": got["seconds"], "spread": got["spread"],
                "pick": got["pick"],
                "cpu_s": [r[kb]["cpu_s"] for r in ranks],
                "wall_s": [r[kb]["wall_s"] for r in ranks],
                "digests": {name: [r[kb]["digests"][name] for r in ranks]
                            for name in got["digests"]}}
           for kb, got in mine.items()}
  return {"ranks": len(hosts), "cores": _process.cores(),
          "link": link, "relay": relayed, "rule_link": rule_link,
          "sizes": sizes}


def _timed(rings: dict, *, kb: int, windows: int, ranks: int,
           relay: relay_lib.Relay | None, rng: np.random.Generator) -> dict:
  """One size: every ring's median time, the rule's pick, this rank's
  processor and wall seconds, and a hash of each ring's result."""
  x = rng.standard_normal(kb * 256, dtype=np.float32)
  out = np.empty_like(x)
  calls = {name: lambda r=r: r.all_reduce(x, out=out)
           for name, r in rings.items()}
  for call in calls.values():  # Connects, warms up.
    call()
  # The same repetitions on every rank (they call in step), from the
  # rule's time summed over the ranks: the same bits everywhere.
  probe = np.array([_time(calls[RULE], 1)], np.float32)
  total = float(rings[RULE].all_reduce(probe)[0])
  reps = int(max(1, min(1000, _WINDOW_S * ranks / max(total, 1e-6))))
  times: dict[str, list[float]] = {name: [] for name in calls}
  digests = {}
  start, start_cpu = time.perf_counter(), _cpu_s(relay)
  names = list(calls)
  for window in range(windows):
    # Each window starts with the next ring: none always follows the same
    # one.
    for name in names[window % len(names):] + names[:window % len(names)]:
      times[name].append(_time(calls[name], reps))
      if window == windows - 1:
        digests[name] = hashlib.blake2b(out.data, digest_size=16).hexdigest()
  return {"seconds": {k: statistics.median(t) for k, t in times.items()},
          "spread": {k: (min(t), max(t)) for k, t in times.items()},
          "pick": rings[RULE].schedule_for(kb << 10),
          "cpu_s": _cpu_s(relay) - start_cpu,
          "wall_s": time.perf_counter() - start, "digests": digests}


def main(argv: list[str] | None = None) -> int:
  """One process of a `measure` group: the link, then `sweep`, joined
  through a directory; rank 0 prints the raw JSON."""
  parser = argparse.ArgumentParser(prog="tfdist.bench.schedules")
  parser.add_argument("--rank", type=int, required=True)
  parser.add_argument("--hosts", required=True,
                      help="every rank's host or address, comma-separated")
  parser.add_argument("--dir", required=True)
  parser.add_argument("--sizes-kb", required=True)
  parser.add_argument("--windows", type=int, default=5)
  parser.add_argument("--delay-s", type=float, default=0.0)
  parser.add_argument("--link-seconds", type=float, default=1.0)
  parser.add_argument("--link-repeats", type=int, default=3)
  parser.add_argument("--timeout-s", type=float, default=600.0)
  args = parser.parse_args(argv)
  rank, hosts = args.rank, args.hosts.split(",")
  directory = DirectoryRendezvous(args.dir)
  link = link_lib.measure(rank=rank, hosts=hosts, rendezvous=directory,
                          key="link", seconds=args.link_seconds,
                          repeats=args.link_repeats, timeout_s=args.timeout_s)
  raw = sweep(rank=rank, hosts=hosts, rendezvous=directory, key="schedules",
              link=link, sizes_kb=[int(s) for s in args.sizes_kb.split(",")],
              windows=args.windows, delay_s=args.delay_s,
              secret="tfdist bench", timeout_s=args.timeout_s)
  if raw is not None:
    print(json.dumps(raw), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
