"""Every figure the bench reports, in one table: `FIGURES`.

A figure has its report key, the bench that measures it, its section of the
report's ``raw``, how it is measured, its target (if any) and whether it is
a headline. The reports (`tfdist.bench.report`, `tfdist.bench.hosts`, the
schedules' sweep) build, score, check and explain their figures from this
table; `score` is the one place a target is scored.

`markdown` renders the figures of saved reports as one table, the method
beside each (``tfdist bench --figures JSON...``; docs/benchmarks.md opens
with it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
from typing import Any, Callable

from tfdist.bench import why
from tfdist.errors import ConfigError

__all__ = ["Figure", "FIGURES", "BENCHES", "of", "get", "score", "lookup",
           "markdown", "load"]

_SOURCE = "tfdist bench --figures"
#: The benches, each a kind of report.
BENCHES = ("one_host", "across_hosts", "schedules")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Figure:
  """One figure of a bench report.

  Attributes:
    name: the report key (``key.model`` for one entry of a dict figure).
    bench: which of `BENCHES` measures it.
    section: the report's ``raw`` section it is computed from.
    method: how it is measured, in one line (docs/benchmarks.md shows it).
    target: the value to reach; ``None``: no target.
    higher_is_better: ``>=`` the target when true, ``<=`` otherwise.
    many_ranks_target: the target above `MANY_RANKS` ranks, where it differs.
    headline: a headline figure (a top-level key of the one-host report,
      a key of ``headline`` across hosts), checked for its type.
    kind: ``float``, or ``dict`` (a positive float by name).
    explain: ``explain(figure, value=..., **context) -> dict``: the entry's
      ``why`` and the figures it rests on (``machine_ceiling``, ...), from
      the same run (`tfdist.bench.why`).
  """
  name: str
  bench: str
  section: str
  method: str
  target: float | None = None
  higher_is_better: bool = True
  many_ranks_target: float | None = None
  headline: bool = True
  kind: type = float
  explain: Callable[..., dict] | None = None

  def bound(self, ranks: int | None = None) -> float:
    """The target, for ``ranks`` ranks where that matters."""
    if self.many_ranks_target is not None and (ranks or 0) > MANY_RANKS:
      return self.many_ranks_target
    return self.target

  def text(self, ranks: int | None = None) -> str:
    return f"{'>=' if self.higher_is_better else '<='} {self.bound(ranks):g}"

  def met(self, value: float, ranks: int | None = None) -> bool:
    compare = operator.ge if self.higher_is_better else operator.le
    return compare(value, self.bound(ranks))

  def worst(self, values: dict[str, float]) -> str:
    """The key of ``values`` furthest from the target's side."""
    return (min if self.higher_is_better else max)(values, key=values.get)


MANY_RANKS = 8

_ALLREDUCE_METHOD = ("the {method} all-reduce's bus bandwidth (S / t * 2 (n - "
                     "1) / n for S float32 bytes) over the link's TCP "
                     "streams, the lowest over sizes of 4 MiB and up")

FIGURES: tuple[Figure, ...] = (
    # tfdist bench: one machine.
    Figure(name="overhead_ratio", bench="one_host", section="overhead",
           target=0.98, explain=why.overhead,
           method="tfdist's steps/s over hand-written MirroredStrategy code's "
                  "(2 logical CPUs, alternating windows), the lowest of fit, "
                  "keras_fit and runner"),
    Figure(name="overhead_by_case", bench="one_host", section="overhead",
           kind=dict, method="overhead_ratio of each case"),
    Figure(name="scaling_efficiency", bench="one_host", section="scaling",
           kind=dict,
           method="samples/s of N workers over N x 1 worker's, tfdist's "
                  "variant, each worker on a core of its own"),
    Figure(name="scaling_efficiency.cnn", bench="one_host", section="scaling",
           target=0.9, headline=False, explain=why.scaling,
           method="scaling_efficiency of the CNN, against the workers "
                  "training alone (nothing exchanged)"),
    Figure(name="mlp_speedup_vs_raw", bench="one_host", section="scaling",
           target=1.5,
           method="2 workers' MLP samples/s, tfdist's recommended options "
                  "over hand-written MultiWorkerMirrored code"),
    Figure(name="allreduce_fraction_of_loopback", bench="one_host",
           section="allreduce", target=0.5, explain=why.loopback,
           method="2 workers' socket all-reduce, float32 bytes reduced a "
                  "second over one loopback TCP stream's (median over sizes)"),
    Figure(name="startup_ratio", bench="one_host", section="startup",
           target=1.2, higher_is_better=False,
           method="seconds to the end of the first step of 2 workers, "
                  "tfdist launch over bare processes (median)"),
    Figure(name="memory_ratio", bench="one_host", section="memory",
           target=1.1, higher_is_better=False,
           method="peak RSS of a worker training deep_mlp, tfdist over raw "
                  "(median of runs)"),
    Figure(name="flight_recorder_ratio", bench="one_host", section="overhead",
           target=0.99,
           method="steps/s with the flight recorder over without"),
    # tfdist bench --across-hosts.
    Figure(name="link_bytes_per_s", bench="across_hosts", section="link",
           method="TCP streams between ring neighbours, all sending at once: "
                  "the slowest's receive rate (bytes/s)"),
    Figure(name="allreduce_fraction_of_link", bench="across_hosts",
           section="allreduce", target=0.9,
           explain=functools.partial(why.allreduce, method="socket",
                                     direct="ring", bytes_scale=1),
           method=_ALLREDUCE_METHOD.format(method="socket (float32)")),
    Figure(name="bf16_fraction_of_link", bench="across_hosts",
           section="allreduce", target=1.8,
           explain=functools.partial(why.allreduce, method="socket_bf16",
                                     direct="ring_bf16", bytes_scale=2),
           method=_ALLREDUCE_METHOD.format(method="socket_bf16")),
    Figure(name="collective_fraction_of_link", bench="across_hosts",
           section="allreduce",
           method=_ALLREDUCE_METHOD.format(method="TensorFlow collectives'")),
    Figure(name="ceiling_fraction_of_link", bench="across_hosts",
           section="allreduce",
           method=_ALLREDUCE_METHOD.format(
               method="exchange (the ring's bytes, no arithmetic)")),
    Figure(name="training_speedup_vs_raw", bench="across_hosts",
           section="training", target=2.0, explain=why.training,
           method="steps/s of wide_mlp, tfdist's Runner (socket transport) "
                  "over hand-written MultiWorkerMirrored code"),
    Figure(name="training_ceiling_vs_raw", bench="across_hosts",
           section="training",
           method="steps/s of a step of compute (alone) then the gradients "
                  "over the link, over raw's"),
    Figure(name="training_overlap_ceiling_vs_raw", bench="across_hosts",
           section="training",
           method="steps/s of a step of the longer of compute and the "
                  "gradients over the link, over raw's"),
    Figure(name="training_fraction_of_overlap_ceiling", bench="across_hosts",
           section="training", target=0.85, explain=why.overlap,
           method="tfdist's steps/s over the overlapped step's"),
    Figure(name="ring_cpu_vs_tcp", bench="across_hosts", section="processor",
           target=1.5, higher_is_better=False, explain=why.processor,
           method="processor seconds a GB sent: the float32 ring at the "
                  "largest size over the link's TCP streams"),
    # The socket ring's schedules (raw.schedules, tfdist.bench.schedules).
    Figure(name="chosen_vs_best", bench="schedules", section="schedules",
           target=1.25, higher_is_better=False, headline=False,
           explain=why.schedules,
           method="the rule's pick's time over the fastest forced "
                  "schedule's, the worst size (numpy buffers)"),
    Figure(name="busbw_fraction", bench="schedules", section="schedules",
           target=0.95, many_ranks_target=0.9, headline=False,
           explain=why.schedules,
           method="the rule's bus bandwidth over the link, the lowest size "
                  "of 4 MiB and up (0.9 wanted above 8 ranks)"),
)

_BY_NAME = {f.name: f for f in FIGURES}


def get(name: str) -> Figure:
  """The figure called ``name``.

  Raises:
    KeyError: no such figure, naming the figures there are.
  """
  try:
    return _BY_NAME[name]
  except KeyError:
    raise KeyError(f"no bench figure {name!r}; expected one of "
                   f"{sorted(_BY_NAME)}") from None


def of(bench: str, *, headline: bool | None = None,
       targeted: bool | None = None) -> tuple[Figure, ...]:
  """``bench``'s figures, in the table's order: headlines only (or none)
  with ``headline``, those with a target (or without) with ``targeted``."""
  return tuple(f for f in FIGURES if f.bench == bench
               and headline in (None, f.headline)
               and targeted in (None, f.target is not None))


def score(figure: Figure, value: float, *, ranks: int | None = None,
          **context: Any) -> dict:
  """The report's entry for ``figure`` measured at ``value``.

  Args:
    figure: a figure with a target.
    value: what was measured.
    ranks: the ranks it was measured on, where its target depends on them.
    **context: what ``figure.explain`` reads, from the same run.

  Returns:
    ``{"target", "value", "met"}``, with what ``explain`` found
    (``machine_ceiling`` and ``share_of_ceiling`` where there is a
    ceiling); when missed, ``short_by`` and a ``why``.
  """
  entry: dict[str, Any] = {"target": figure.text(ranks), "value": value,
                           "met": figure.met(value, ranks)}
  found = (figure.explain(figure, value=value, ranks=ranks, **context)
           if figure.explain else {})
  if not entry["met"]:
    entry["short_by"] = abs(figure.bound(ranks) - value)
    entry["why"] = found.get("why") or (
        "no ceiling measured for this figure; see docs/benchmarks.md")
  entry.update((k, v) for k, v in found.items()
               if k != "why" and v is not None)
  if found.get("machine_ceiling"):
    entry["share_of_ceiling"] = value / found["machine_ceiling"]
  return entry


def lookup(report: dict, dotted: str) -> Any:
  """``report[a][b]...`` for ``dotted`` = ``a.b...``."""
  value: Any = report
  for part in dotted.split("."):
    value = value[part]
  return value


#: Where each bench's reports hold a figure's value.
_VALUE: dict[str, Callable[[dict, str], Any]] = {
    "one_host": lookup,
    "across_hosts": lambda report, name: report["headline"][name],
    "schedules": lambda report, name: (
        report["raw"]["schedules"]["targets"][name]["value"]),
}


def _value(report: dict, figure: Figure) -> Any:
  """``figure``'s value in ``report`` (any bench's), or ``None``."""
  try:
    return _VALUE[figure.bench](report, figure.name)
  except (KeyError, TypeError):
    return None


def _shown(value: Any, figure: Figure) -> str:
  if value is None:
    return ""
  if isinstance(value, dict):
    return ", ".join(f"{k} {v:.3f}" for k, v in value.items())
  if figure.name.endswith("bytes_per_s"):
    return f"{value / 1e6:.0f} MB/s"
  return f"{value:.3f}"


def markdown(reports: dict[str, dict]) -> str:
  """The registry's figures of ``reports`` (label -> report) as one table:
  each figure, its target, its value in each report and how it is measured.
  A figure no report has is left out."""
  labels = list(reports)
  rows = ["| figure | target | " + " | ".join(labels) + " | method |",
          "|---|---|" + "---|" * len(labels) + "---|"]
  for figure in FIGURES:
    values = [_value(r, figure) for r in reports.values()]
    if all(v is None for v in values):
      continue
    cells = []
    for v, r in zip(values, reports.values()):
      met = "" if v is None or figure.target is None or isinstance(v, dict) \
          else (" (met)" if figure.met(v, _ranks(r)) else " (missed)")
      cells.append(_shown(v, figure) + met)
    target = figure.text() if figure.target is not None else ""
    if figure.many_ranks_target is not None:
      target += f" ({figure.text(MANY_RANKS + 1)} above {MANY_RANKS} ranks)"
    rows.append(f"| `{figure.name}` | {target} | " + " | ".join(cells)
                + f" | {figure.method} |")
  return "\n".join(rows)


def _ranks(report: dict) -> int | None:
  return (report.get("raw") or {}).get("workers")


def load(paths: list[str]) -> dict[str, dict]:
  """Reports by label from JSON files: a report (labelled by its file's
  name), or label -> report (each label after the file's name when there
  are several files).

  Raises:
    ConfigError: a file that cannot be read, or holds no reports.
  """
  out = {}
  for path in paths:
    try:
      with open(path) as f:
        found = json.load(f)
    except (OSError, ValueError) as e:
      raise ConfigError(field="--figures", value=path, source=_SOURCE,
                        expected=f"a bench report's JSON file ({e})") from None
    name = path.rsplit("/", 1)[-1]
    if isinstance(found, dict) and "raw" in found:
      out[name] = found
      continue
    if not isinstance(found, dict) or not all(
        isinstance(r, dict) and "raw" in r for r in found.values()):
      raise ConfigError(field="--figures", value=path, source=_SOURCE,
                        expected="a bench report, or label -> report")
    for label, report in found.items():
      out[f"{name} {label}" if len(paths) > 1 else label] = report
  return out
