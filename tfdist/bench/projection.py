"""Time per step against host count, on paper: the alpha-beta cost model.

A message of m bytes between two hosts costs ``alpha + m / B``: ``alpha``
the latency of one hop (what a small message costs end to end: the kernel,
the switch and the Python calls on both sides), ``B`` the bytes per second
one host's link moves each way. Every host has one full-duplex link into a
non-blocking switch, so a schedule's time is its latency terms plus the
bytes the busiest host sends (or receives) over ``B``. For an all-reduce of
S bytes over p hosts:

* **ring** (reduce-scatter then all-gather, as tfdist's socket ring and
  NCCL's ring): ``2 (p - 1)`` steps, each moving one segment of ``S / p``
  to the next host while taking one from the previous::

      T_ring = 2 (p - 1) alpha + 2 (p - 1) / p * S / B

* **tree**: the pipelined double binary tree of Sanders, Speck and Traeff
  ("Two-tree algorithms for full bandwidth broadcast, reduction and scan",
  Parallel Computing 35(12), 2009), the tree NCCL uses since 2.4. Each half
  of the tensor is reduced up one binary tree and broadcast down it; a host
  is inside one tree and a leaf of the other. Pipelined in chunks small
  enough that filling the pipeline costs nothing but large enough that
  each hop's latency is paid once (the limit of the pipeline: optimistic
  for the tree by the fill term)::

      T_tree = 2 d alpha + w S / B

  with ``d = floor(log2 p)`` the depth of the tree (heap order: host i's
  children are 2i + 1 and 2i + 2) and ``w S`` the bytes the busiest host
  moves each way: half the tensor from (or to) each child and the parent
  in the tree it is inside, plus half as a leaf of the other (``w`` = 1 at
  p = 2, where the tree is the ring; 1.5 at 3 and 4; 2 from 5 on).

The ring moves fewer bytes (``2 (p - 1) / p < 2``), the tree pays fewer
latencies (``2 log2 p`` against ``2 (p - 1)``): the tree is faster below
`crossover_bytes`, the ring above. (Recursive halving and doubling,
Rabenseifner's algorithm, would pay ``2 log2 p`` latencies and move the
ring's bytes: in this model it is never slower than either for p a power
of two. What it ignores decides against it in practice: every step talks
to a different host, across the switch at growing distance.)

A training step (weak scaling: the same batch per host) computes, then
all-reduces its gradients, one call after the backward pass as tfdist's
socket transport does (no overlap)::

  T_step(p) = compute + T_allreduce(p, S)      (T_step(1) = compute)

``steps/s = 1 / T_step`` and scaling efficiency ``T_step(1) / T_step(p)``.

No TensorFlow here: `tfdist bench --project` prints `format_table` of
`project`; `check` sets a measured sweep beside the model's prediction
from the alpha and B measured in the same run.

Example::

  link = link_at(10)                      # 10 Gbit/s, DEFAULT_LATENCY_S
  ring_seconds(8, WIDE_MLP.gradient_bytes, link)
  step(WIDE_MLP, p=8, link=link, algorithm="tree").steps_per_s
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

__all__ = ["Link", "Workload", "Step", "ALGORITHMS", "WORKLOADS",
           "HOST_COUNTS", "RATES_GBIT", "DEFAULT_LATENCY_S",
           "DEFAULT_GOODPUT", "WIDE_MLP", "CNN", "link_at", "ring_seconds",
           "tree_seconds", "tree_depth", "tree_bytes_factor",
           "allreduce_seconds", "crossover_bytes", "step", "project",
           "check", "format_table"]

#: One hop's latency (s) when none is measured: the token round of
#: `tfdist.bench.link.hop_latency` between two hosts of the test bed
#: measured 20-60 us; a datacenter TCP hop with Python at both ends is of
#: that order.
DEFAULT_LATENCY_S = 30e-6
#: TCP payload per bit of line rate: the test bed's streams moved 119 MB/s
#: at 1 Gbit/s and 1182 MB/s at 10 Gbit/s (0.95 and 0.946).
DEFAULT_GOODPUT = 0.95
#: Host counts and link rates (Gbit/s) of the projection table.
HOST_COUNTS: tuple[int, ...] = (2, 3, 4, 8, 64)
RATES_GBIT: tuple[float, ...] = (1, 10, 100)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
  """One host's link into the switch.

  Attributes:
    bytes_per_s: payload bytes per second each way (B).
    latency_s: one hop's latency (alpha).
  """
  bytes_per_s: float
  latency_s: float

  def __post_init__(self):
    if not self.bytes_per_s > 0 or not self.latency_s >= 0:
      raise ValueError(
          f"Link: expected bytes_per_s > 0 and latency_s >= 0, got "
          f"bytes_per_s={self.bytes_per_s!r}, latency_s={self.latency_s!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """A training step: its gradients and its compute.

  Attributes:
    name: what to call it.
    gradient_bytes: float32 bytes all-reduced per step (S).
    compute_s: one host's step without the all-reduce (forward, backward,
      update), at the per-host batch.
  """
  name: str
  gradient_bytes: int
  compute_s: float


# The bench's models (tfdist/bench/models.py), counted without TensorFlow:
# wide_mlp 1024-4096-1024-10 is 8,403,978 parameters; the CNN's three 3x3
# convolutions (3->32->64->64) and 64->10 head 56,970. Compute: one process
# alone on one core of this 2-vCPU machine (the bench's thread settings: 1
# intra-op, 2 inter-op threads), batch 64 (wide_mlp) and 32 (cnn), the
# hand-written step with no strategy, median of 5 windows (docs/benchmarks.md,
# "Scale on paper"). A GPU would shrink it and lower every efficiency.
WIDE_MLP = Workload(name="wide_mlp", gradient_bytes=4 * 8_403_978,
                    compute_s=0.0167)
CNN = Workload(name="cnn", gradient_bytes=4 * 56_970, compute_s=0.0052)
WORKLOADS: dict[str, Workload] = {w.name: w for w in (WIDE_MLP, CNN)}


def link_at(gbit_per_s: float, *, latency_s: float = DEFAULT_LATENCY_S,
            goodput: float = DEFAULT_GOODPUT) -> Link:
  """A link of ``gbit_per_s`` line rate carrying ``goodput`` of it as TCP."""
  return Link(bytes_per_s=gbit_per_s * 1e9 / 8 * goodput, latency_s=latency_s)


def _check_hosts(p: int) -> None:
  if not isinstance(p, int) or p < 2:
    raise ValueError(f"p: expected an integer host count >= 2, got {p!r}")


def ring_seconds(p: int, size_bytes: float, link: Link) -> float:
  """``2 (p - 1) alpha + 2 (p - 1) / p * S / B``."""
  _check_hosts(p)
  return 2 * (p - 1) * (link.latency_s + size_bytes / p / link.bytes_per_s)


def tree_depth(p: int) -> int:
  """Hops from the root to the deepest host: ``floor(log2 p)``."""
  _check_hosts(p)
  return p.bit_length() - 1


def tree_bytes_factor(p: int) -> float:
  """``w``: the busiest host's bytes each way, in tensors, in a double tree.

  Inside its tree a host takes half the tensor from each child and from its
  parent (reduce up, broadcast down) and sends as much; as a leaf of the
  other tree, half once each way. Heap order: host i's children are
  ``2i + 1`` and ``2i + 2``.
  """
  _check_hosts(p)
  busiest = max(sum(1 for c in (2 * i + 1, 2 * i + 2) if c < p) + (i > 0)
                for i in range(min(p, 3)))  # Hosts 0-2 are the busiest.
  return (busiest + 1) / 2


def tree_seconds(p: int, size_bytes: float, link: Link) -> float:
  """``2 d alpha + w S / B`` (the pipelined double binary tree)."""
  return (2 * tree_depth(p) * link.latency_s
          + tree_bytes_factor(p) * size_bytes / link.bytes_per_s)


#: All-reduce schedules: name -> seconds(p, S, link).
ALGORITHMS: dict[str, Callable[[int, float, Link], float]] = {
    "ring": ring_seconds,
    "tree": tree_seconds,
}


def allreduce_seconds(algorithm: str, p: int, size_bytes: float,
                      link: Link) -> float:
  """The modelled all-reduce time by ``algorithm`` (`ALGORITHMS`).

  Raises:
    ValueError: an unknown algorithm, naming the known ones.
  """
  if algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm: expected one of {sorted(ALGORITHMS)}, got "
                     f"{algorithm!r}")
  return ALGORITHMS[algorithm](p, size_bytes, link)


def crossover_bytes(p: int, link: Link) -> float:
  """The size at which ring and tree take equally long.

  Below it the tree is faster, above it the ring. ``math.inf`` where the
  tree is never slower (p = 4: it moves the ring's bytes with fewer
  latencies); 0 at p = 2, where the two are the same schedule.
  """
  latency_gap = (2 * (p - 1) - 2 * tree_depth(p)) * link.latency_s
  bytes_gap = (tree_bytes_factor(p) - 2 * (p - 1) / p) / link.bytes_per_s
  if latency_gap <= 0:
    return 0.0
  if bytes_gap <= 1e-15 / link.bytes_per_s:
    return math.inf
  return latency_gap / bytes_gap


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
  """One modelled training step.

  Attributes:
    allreduce_s: the all-reduce of the gradients.
    step_s: compute plus all-reduce.
    steps_per_s: ``1 / step_s``.
    efficiency: ``compute / step_s``: the share of one host's speed each
      host keeps.
  """
  allreduce_s: float
  step_s: float
  steps_per_s: float
  efficiency: float


def step(workload: Workload, *, p: int, link: Link,
         algorithm: str = "ring") -> Step:
  """``workload``'s step on ``p`` hosts, the all-reduce by ``algorithm``."""
  ar = allreduce_seconds(algorithm, p, workload.gradient_bytes, link)
  total = workload.compute_s + ar
  return Step(allreduce_s=ar, step_s=total, steps_per_s=1 / total,
              efficiency=workload.compute_s / total)


def project(*, workloads: Sequence[Workload] = (WIDE_MLP, CNN),
            host_counts: Sequence[int] = HOST_COUNTS,
            rates_gbit: Sequence[float] = RATES_GBIT,
            latency_s: float = DEFAULT_LATENCY_S,
            goodput: float = DEFAULT_GOODPUT) -> dict:
  """The table: every workload, rate, host count and algorithm.

  Returns:
    ``{"assumptions": {...}, "crossover_bytes": {rate: {p: bytes}},
    "steps": {workload: {rate: {p: {algorithm: Step as a dict}}}}}``, rates
    and host counts as strings (JSON keys); an infinite crossover is
    ``None``.
  """
  steps: dict = {}
  crossover: dict = {}
  for rate in rates_gbit:
    link = link_at(rate, latency_s=latency_s, goodput=goodput)
    crossover[f"{rate:g}"] = {
        str(p): _finite(crossover_bytes(p, link)) for p in host_counts}
    for w in workloads:
      steps.setdefault(w.name, {})[f"{rate:g}"] = {
          str(p): {a: dataclasses.asdict(step(w, p=p, link=link,
                                              algorithm=a))
                   for a in ALGORITHMS}
          for p in host_counts}
  return {"assumptions": {"latency_s": latency_s, "goodput": goodput,
                          "workloads": {w.name: dataclasses.asdict(w)
                                        for w in workloads}},
          "crossover_bytes": crossover, "steps": steps}


def _finite(x: float) -> float | None:
  return None if math.isinf(x) else x


def check(*, sweep: Mapping[str, Mapping[str, Mapping[str, float]]],
          link: Link, p: int, methods: Sequence[str] = ("ring", "socket",
                                                       "none")) -> dict:
  """A measured all-reduce sweep beside the ring model's prediction.

  Args:
    sweep: `tfdist.bench.allreduce.sweep`'s result (``{method: {size_mb:
      {"seconds": ...}}}``); sizes in MiB of float32.
    link: alpha and B measured in the same run.
    p: hosts.
    methods: which measured methods to set beside the model (those
      present).

  Returns:
    ``{"latency_s", "bytes_per_s", "p", "by_size": {size_mb:
    {"predicted_s": ring model, method: {"measured_s", "measured_over_predicted"}}}}``.
  """
  sizes = sorted({s for m in methods if m in sweep for s in sweep[m]},
                 key=float)
  by_size = {}
  for size in sizes:
    predicted = ring_seconds(p, float(size) * (1 << 20), link)
    row: dict = {"predicted_s": predicted}
    for m in methods:
      if size in sweep.get(m, {}):
        measured = sweep[m][size]["seconds"]
        row[m] = {"measured_s": measured,
                  "measured_over_predicted": measured / predicted}
    by_size[size] = row
  return {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s,
          "p": p, "by_size": by_size}


def format_table(projection: dict) -> str:
  """`project`'s result as Markdown tables: steps/s and efficiency."""
  a = projection["assumptions"]
  lines = [f"alpha {a['latency_s'] * 1e6:g} us per hop, TCP carries "
           f"{a['goodput']:g} of the line rate; ring | tree",
           ""]
  for name, by_rate in projection["steps"].items():
    w = a["workloads"][name]
    lines += [f"{name}: {w['gradient_bytes'] / 1e6:.2f} MB of gradients, "
              f"compute {w['compute_s'] * 1e3:g} ms a step",
              "",
              "| Gbit/s | hosts | all-reduce ms (ring / tree) | "
              "steps/s (ring / tree) | efficiency (ring / tree) |",
              "|---|---|---|---|---|"]
    for rate, by_p in by_rate.items():
      for p, s in by_p.items():
        r, t = s["ring"], s["tree"]
        lines.append(
            f"| {rate} | {p} | {r['allreduce_s'] * 1e3:.2f} / "
            f"{t['allreduce_s'] * 1e3:.2f} | {r['steps_per_s']:.2f} / "
            f"{t['steps_per_s']:.2f} | {r['efficiency']:.3f} / "
            f"{t['efficiency']:.3f} |")
    lines.append("")
  lines += ["ring vs tree: the tree is faster below these sizes (MB), "
            "the ring above", "",
            "| Gbit/s | " + " | ".join(
                f"p={p}" for p in next(iter(
                    projection["crossover_bytes"].values()))) + " |",
            "|---|" + "---|" * len(next(iter(
                projection["crossover_bytes"].values())))]
  for rate, by_p in projection["crossover_bytes"].items():
    cells = ["tree always" if b is None else "same schedule" if b == 0
             else f"{b / 1e6:.3g}" for b in by_p.values()]
    lines.append(f"| {rate} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
