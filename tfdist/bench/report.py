"""The bench report: headline ratios, targets, raw figures; checked and shown.

`validate` is what CI relies on: ``tfdist bench --quick`` must produce a
report whose keys and types are right. It asserts no speed.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import statistics
from typing import Any, Callable

from tfdist.bench import overhead as overhead_lib
from tfdist.errors import TfdistError

__all__ = ["HEADLINE_KEYS", "TARGETS", "Target", "ReportError", "build",
           "validate", "format_table"]


class ReportError(TfdistError):
  """A bench report that lacks a key or holds a value of the wrong type."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """A goal for a headline figure.

  Attributes:
    key: the report key (for a per-model key, ``key.model``).
    bound: the value to reach.
    higher_is_better: ``>=`` when true, ``<=`` otherwise.
  """
  key: str
  bound: float
  higher_is_better: bool = True

  @property
  def text(self) -> str:
    return f"{'>=' if self.higher_is_better else '<='} {self.bound:g}"

  def met(self, value: float) -> bool:
    compare: Callable[[float, float], bool] = (
        operator.ge if self.higher_is_better else operator.le)
    return compare(value, self.bound)


#: The issue's targets, for ratios measured within one run.
TARGETS: tuple[Target, ...] = (
    Target(key="overhead_ratio", bound=0.98),
    Target(key="scaling_efficiency.cnn", bound=0.9),
    Target(key="mlp_speedup_vs_raw", bound=1.5),
    Target(key="allreduce_fraction_of_loopback", bound=0.5),
    Target(key="startup_ratio", bound=1.2, higher_is_better=False),
    Target(key="memory_ratio", bound=1.1, higher_is_better=False),
    Target(key="flight_recorder_ratio", bound=0.99),
)

#: Headline keys and their types (a dict maps model name to float).
HEADLINE_KEYS: dict[str, type] = {
    "overhead_ratio": float,
    "overhead_by_case": dict,
    "scaling_efficiency": dict,
    "mlp_speedup_vs_raw": float,
    "allreduce_fraction_of_loopback": float,
    "startup_ratio": float,
    "memory_ratio": float,
    "flight_recorder_ratio": float,
}

_SECTIONS = ("overhead", "options", "scaling", "allreduce", "startup",
             "memory")


def _lookup(report: dict, dotted: str) -> Any:
  value: Any = report
  for part in dotted.split("."):
    value = value[part]
  return value


def build(*, overhead: dict, scaling: dict, allreduce: dict, startup: dict,
          memory: dict, config: dict, machine: dict) -> dict:
  """Assembles the report from each measurement's result."""
  report: dict[str, Any] = {
      "overhead_ratio": overhead["overhead_ratio"],
      "overhead_by_case": {c: f["ratio"] for c, f in overhead["cases"].items()},
      "scaling_efficiency": scaling["scaling_efficiency"],
      "mlp_speedup_vs_raw": scaling["mlp_speedup_vs_raw"],
      "allreduce_fraction_of_loopback": allreduce["fraction_of_loopback"],
      "startup_ratio": startup["startup_ratio"],
      "memory_ratio": memory["memory_ratio"],
      "flight_recorder_ratio": overhead["options"]["flight_recorder"]["ratio"],
  }
  # What this machine allows, measured in the same run: N processes training
  # alone (nothing exchanged), and the bytes an all-reduce must move sent
  # over the same sockets with no arithmetic.
  ceilings = {
      **{f"scaling_efficiency.{m}": v
         for m, v in scaling.get("scaling_ceiling", {}).items()},
      "allreduce_fraction_of_loopback": allreduce.get(
          "ceiling_fraction_of_loopback"),
  }
  evidence = {"overhead_ratio": _overhead_evidence(overhead["cases"]),
              "allreduce_fraction_of_loopback": _allreduce_evidence(allreduce),
              **{f"scaling_efficiency.{m}": _straggler_evidence(
                  s, scaling["scaling_sync_ceiling"][m],
                  scaling["scaling_allreduce_ceiling"][m],
                  report["scaling_efficiency"][m])
                 for m, s in scaling.get("straggler", {}).items()}}
  report["targets"] = {}
  for t in TARGETS:
    value = _lookup(report, t.key)
    entry = {"target": t.text, "value": value, "met": t.met(value)}
    if ceilings.get(t.key):
      entry["machine_ceiling"] = ceilings[t.key]
      entry["share_of_ceiling"] = value / ceilings[t.key]
    if not entry["met"]:
      entry["short_by"] = abs(t.bound - value)
      entry["why"] = _why(t, value, ceilings.get(t.key), evidence.get(t.key))
    report["targets"][t.key] = entry
  report["raw"] = {"overhead": overhead["cases"],
                   "options": overhead["options"], "scaling": scaling,
                   "allreduce": allreduce, "startup": startup,
                   "memory": memory}
  report["config"] = config
  report["machine"] = machine
  return report


def _overhead_evidence(cases: dict) -> str:
  """Whether each case's windows tell tfdist from raw (`overhead.spread`)."""
  parts = []
  for name, figures in cases.items():
    w = figures["windows"]
    parts.append(f"{name} {figures['ratio']:.3f}, its windows "
                 f"{w['min']:.3f}-{w['max']:.3f} of raw's (median "
                 f"{w['median']:.3f}, {w['above_one']} of {len(w['ratios'])} "
                 f"above 1, sign test p {w['sign_test_p']:.2f})")
  apart = [n for n, f in cases.items() if f["windows"]["told_apart"]]
  verdict = (f"told apart from raw: {', '.join(apart)}" if apart else
             "no case told apart from raw (sign test p < "
             f"{overhead_lib.TOLD_APART_P:g} needed)")
  return "; ".join(parts) + f"; {verdict}"


def _allreduce_evidence(allreduce: dict) -> str | None:
  """What the sweep says of the headline method's gap to its ceiling.

  The same ring called without TensorFlow (``ring``), and how busy the
  machine's processors were while the headline method ran.
  """
  parts = []
  ring = allreduce.get("fractions", {}).get("ring")
  if ring:
    parts.append(f"the same ring without TensorFlow reached {ring:.3f}")
  method = allreduce.get("method")
  busy = [f["machine_busy"] for f in
          allreduce.get("sweep", {}).get(method, {}).values()
          if "machine_busy" in f]
  if busy:
    parts.append(f"the machine was {statistics.median(busy):.0%} busy "
                 f"during {method} (median over sizes)")
  return "; ".join(parts) or None


def _straggler_evidence(straggler: dict, sync_ceiling: float,
                        allreduce_ceiling: float, value: float) -> str:
  """What waiting for the slowest worker and the all-reduce leave of the
  ceiling (`tfdist.bench.scaling`)."""
  mean = straggler["mean_step_s"]
  return (f"a synchronous step waits for the slowest of "
          f"{straggler['workers']} workers: their own steps, timed one by "
          f"one, took {mean * 1e3:.1f} ms on average and each step's "
          f"slowest {mean / straggler['sync_factor'] * 1e3:.1f} ms (ceiling "
          f"{sync_ceiling:.3f}); one all-reduce of the gradients, timed "
          f"alone, took {straggler['gradients_allreduce_s'] * 1e3:.2f} ms "
          f"(ceiling {allreduce_ceiling:.3f}); tfdist reached "
          f"{value / allreduce_ceiling:.2f} of that")


def _why(target: Target, value: float, ceiling: float | None,
         evidence: str | None = None) -> str:
  """One line on a missed target, from the figures measured beside it."""
  if ceiling is None:
    line = "no ceiling measured for this figure; see docs/benchmarks.md"
  elif not target.met(ceiling):
    line = (f"out of reach on this machine in this run: its ceiling was "
            f"{ceiling:.3f}; tfdist reached {value / ceiling:.2f} of it")
  else:
    line = (f"the machine allowed {ceiling:.3f} in this run; tfdist reached "
            f"{value / ceiling:.2f} of it")
  return f"{line}; {evidence}" if evidence else line


def validate(report: dict) -> None:
  """Checks keys and types (never speed).

  Raises:
    ReportError: naming the first key missing or of the wrong type.
  """
  def fail(key: str, what: str) -> None:
    raise ReportError(f"bench report {key}: {what}")

  for key, kind in HEADLINE_KEYS.items():
    if key not in report:
      fail(key, "missing")
    value = report[key]
    if kind is float:
      if not isinstance(value, (int, float)) or isinstance(value, bool) or (
          not math.isfinite(value) or value <= 0):
        fail(key, f"expected a positive finite number, got {value!r}")
    elif not isinstance(value, dict) or not value or not all(
        isinstance(v, float) and math.isfinite(v) and v > 0
        for v in value.values()):
      fail(key, f"expected a non-empty dict of positive numbers, got {value!r}")
  for t in TARGETS:
    entry = report.get("targets", {}).get(t.key)
    if not isinstance(entry, dict) or not isinstance(entry.get("met"), bool):
      fail(f"targets.{t.key}", "missing or without a boolean 'met'")
    if "machine_ceiling" in entry:
      ceiling = entry["machine_ceiling"]
      if not isinstance(ceiling, (int, float)) or not (
          math.isfinite(ceiling) and ceiling > 0):
        fail(f"targets.{t.key}.machine_ceiling",
             f"expected a positive finite number, got {ceiling!r}")
  for section in _SECTIONS:
    if not isinstance(report.get("raw", {}).get(section), dict):
      fail(f"raw.{section}", "missing")
  for name, figures in report["raw"]["overhead"].items():
    windows = figures.get("windows", {})
    ratios = windows.get("ratios")
    if not isinstance(ratios, list) or not ratios or not all(
        isinstance(r, float) and math.isfinite(r) and r > 0 for r in ratios):
      fail(f"raw.overhead.{name}.windows.ratios",
           f"expected a non-empty list of positive numbers, got {ratios!r}")
    if not isinstance(windows.get("told_apart"), bool):
      fail(f"raw.overhead.{name}.windows.told_apart",
           f"expected a boolean, got {windows.get('told_apart')!r}")
  if not isinstance(report.get("config"), dict):
    fail("config", "missing")


def format_table(report: dict) -> str:
  """The headline figures against their targets, as Markdown rows.

  The last column is the machine's ceiling for the figure where the run
  measured one (see `build`).
  """
  rows = ["| figure | measured | target | met | machine ceiling |",
          "|---|---|---|---|---|"]
  for key, entry in report["targets"].items():
    ceiling = entry.get("machine_ceiling")
    rows.append(f"| {key} | {entry['value']:.3f} | {entry['target']} | "
                f"{'yes' if entry['met'] else 'no'} | "
                f"{f'{ceiling:.3f}' if ceiling else ''} |")
  rows += ["", "| overhead case | tfdist / raw | windows min / median / max "
           "| above 1 | sign test p | told apart |",
           "|---|---|---|---|---|---|"]
  for name, figures in report["raw"]["overhead"].items():
    w = figures["windows"]
    rows.append(f"| {name} | {figures['ratio']:.3f} | {w['min']:.3f} / "
                f"{w['median']:.3f} / {w['max']:.3f} | {w['above_one']} of "
                f"{len(w['ratios'])} | {w['sign_test_p']:.2f} | "
                f"{'yes' if w['told_apart'] else 'no'} |")
  return "\n".join(rows)
