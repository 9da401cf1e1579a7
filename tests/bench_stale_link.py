"""What a ring loses by keeping the link it measured as it connected.

Issue 42 leaves it to us whether a ring re-measures its link when its picks'
times drift from their model (a link shared with other jobs). A ring of the
rule measures once, at connect (`tfdist.ring.socket_ring.SocketRing.link`).
This script prices that choice from a schedules sweep's own figures: for
every change of condition the sweep holds (10 -> 1 Gbit/s, no added latency
-> +250 us, ...) at each host count and size, the pick from the old
condition's link against the pick from the new one, both timed by the new
condition's forced schedules, over the fastest of them. It reads a JSON that
``tests/bench_bed.py --schedules`` wrote and needs no bed::

  .venv/bin/python tests/bench_stale_link.py docs/bench_schedules.json
"""

from __future__ import annotations

import argparse
import json
import statistics

from tfdist.ring import socket_ring

#: (from, to) conditions, as the sweep keys them with the host count as {}.
CHANGES = (("10gbit/{}/0us", "1gbit/{}/0us"),
           ("1gbit/{}/0us", "10gbit/{}/0us"),
           ("1gbit/{}/0us", "1gbit/{}/25us"),
           ("1gbit/{}/0us", "1gbit/{}/250us"),
           ("1gbit/{}/250us", "1gbit/{}/0us"))


def _pick(sweep: dict, hosts: int, nbytes: int) -> str:
  link = sweep["rule_link"]
  return socket_ring.choose(hosts, nbytes, latency_s=link["latency_s"],
                            bytes_per_s=link["bytes_per_s"])


def rows(sweeps: dict) -> list[str]:
  """One Markdown row per change of condition."""
  out = []
  counts = sorted({int(key.split("/")[1]) for key in sweeps})  # rate/N/delay
  for before, after in CHANGES:
    stale, fresh, differ = [], [], []
    for hosts in counts:
      old = sweeps.get(before.format(hosts))
      new = sweeps.get(after.format(hosts))
      if not (old and new):
        continue
      for kb, size in sorted(new["sizes"].items(), key=lambda s: int(s[0])):
        timed = {k: v["measured_s"] for k, v in size["schedules"].items()}
        fastest = min(timed.values())
        kept, remeasured = (_pick(s, hosts, size["bytes"]) for s in (old, new))
        stale.append(timed[kept] / fastest)
        fresh.append(timed[remeasured] / fastest)
        if kept != remeasured:
          differ.append(f"{hosts} hosts {kb} KiB {kept} for {remeasured} "
                        f"{timed[kept] / timed[remeasured]:.2f}")
    if stale:
      out.append(
          f"| {before.format('N')} -> {after.format('N')} | {len(stale)} | "
          f"{sum(r <= 1.1 for r in stale)} / {sum(r <= 1.1 for r in fresh)} | "
          f"{statistics.geometric_mean(stale):.3f} / "
          f"{statistics.geometric_mean(fresh):.3f} | "
          f"{'; '.join(differ) or 'none'} |")
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("json", help="tests/bench_bed.py --schedules's JSON")
  with open(parser.parse_args().json) as f:
    sweeps = json.load(f)
  print("| link at connect -> now | points | within 1.1x: kept / re-measured "
        "| geometric mean over the fastest: kept / re-measured | picks that "
        "differ (kept over re-measured) |\n|---|---|---|---|---|")
  print("\n".join(rows(sweeps)))


if __name__ == "__main__":
  main()
