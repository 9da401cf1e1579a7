"""The bench's reports checked and shown: one machine's and across hosts.

`build` assembles the one-machine report. `validate` and `validate_hosts`
are what CI relies on: a report's keys and types, read from the figures'
table (`tfdist.bench.figures`). They assert no speed.
"""

from __future__ import annotations

import math
from typing import Any

from tfdist.bench import figures
from tfdist.errors import TfdistError
from tfdist.ring import socket_ring

__all__ = ["ReportError", "build", "validate", "validate_hosts",
           "format_table", "format_hosts"]


class ReportError(TfdistError):
  """A bench report that lacks a key or holds a value of the wrong type."""


def build(*, overhead: dict, scaling: dict, allreduce: dict, startup: dict,
          memory: dict, config: dict, machine: dict) -> dict:
  """Assembles the report from each measurement's result: the headline
  figures (`tfdist.bench.figures`, read at their ``name`` in the results),
  each target scored, and the raw figures."""
  results = {"overhead": overhead, "scaling": scaling,
             "allreduce": allreduce, "startup": startup, "memory": memory,
             "options": overhead["options"]}
  report: dict[str, Any] = {
      f.name: figures.lookup(results[f.section], f.name)
      for f in figures.of("one_host", headline=True)}
  report["targets"] = {
      f.name: figures.score(f, figures.lookup(report, f.name), **results)
      for f in figures.of("one_host", targeted=True)}
  report["raw"] = {**results, "overhead": overhead["cases"]}
  report["config"] = config
  report["machine"] = machine
  return report


def validate(report: dict) -> None:
  """Checks a one-machine report's keys and types.

  Raises:
    ReportError: naming the first key missing or of the wrong type.
  """
  _figures(report, "one_host", lambda key: report.get(key))
  for section in {f.section for f in figures.of("one_host")}:
    expect(report.get("raw", {}).get(section), dict, f"raw.{section}")
  for name, case in report["raw"]["overhead"].items():
    windows = case.get("windows", {})
    where = f"raw.overhead.{name}.windows"
    expect(windows.get("ratios"), list, f"{where}.ratios")
    for ratio in windows["ratios"]:
      expect(ratio, float, f"{where}.ratios")
    expect(windows.get("told_apart"), bool, f"{where}.told_apart")
  expect(report.get("config"), dict, "config")


def validate_hosts(report: dict) -> None:
  """Checks an across-hosts report's keys and types, and that every target
  missed says why.

  Raises:
    ReportError: naming the first key missing or of the wrong type.
  """
  headline = report.get("headline", {})
  _figures(report, "across_hosts", headline.get)
  schedules = report["raw"].get("schedules") or {}
  for where, targets in (("targets", report.get("targets", {})),
                         ("schedules.targets", schedules.get("targets", {}))):
    for key, entry in targets.items():
      _entry(entry, f"{where}.{key}")
  for method, per_size in report["raw"]["allreduce"]["sweep"].items():
    for size, found in per_size.items():
      for key in ("seconds", "algbw", "busbw"):
        expect(found.get(key), float, f"sweep.{method}.{size}.{key}")
  expect(schedules.get("same_bits"), bool, "schedules.same_bits")
  expect(schedules.get("sizes"), dict, "schedules.sizes")
  for kb, size in schedules["sizes"].items():
    for name in socket_ring.SCHEDULES:
      row = size["schedules"].get(name, {})
      for key in ("measured_s", "model_s"):
        expect(row.get(key), float, f"schedules.sizes.{kb}.{name}.{key}")
    expect(size["chosen_vs_best"], float,
           f"schedules.sizes.{kb}.chosen_vs_best")
    if size["rule"]["pick"] not in socket_ring.SCHEDULES:
      raise ReportError(
          f"bench report: schedules.sizes.{kb}.rule.pick = "
          f"{size['rule']['pick']!r}; expected one of "
          f"{sorted(socket_ring.SCHEDULES)}")


def _figures(report: dict, bench: str, headline) -> None:
  """``bench``'s headline figures (read by ``headline(name)``) and targets."""
  for f in figures.of(bench, headline=True):
    expect(headline(f.name), f.kind, f.name)
    if f.kind is dict:
      for key, value in headline(f.name).items():
        expect(value, float, f"{f.name}.{key}")
  for f in figures.of(bench, targeted=True):
    _entry(report.get("targets", {}).get(f.name), f"targets.{f.name}")


def _entry(entry: Any, where: str) -> None:
  """A scored target: ``met``, a ``why`` when missed, a positive ceiling."""
  expect(entry, dict, where)
  expect(entry.get("met"), bool, f"{where}.met")
  if not entry["met"]:
    expect(entry.get("why"), str, f"{where}.why (a target not met)")
  if "machine_ceiling" in entry:
    expect(entry["machine_ceiling"], float, f"{where}.machine_ceiling")


def expect(value: Any, kind: type, where: str) -> None:
  """Refuses ``value`` at ``where`` unless it is a ``kind``: a positive
  finite number for float, a non-empty one for dict, list and str.

  Raises:
    ReportError: naming ``where``, the value and what was expected.
  """
  if kind is float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0)
  else:
    ok = isinstance(value, kind) and (kind is bool or bool(value))
  if not ok:
    what = {float: "a positive finite number", bool: "a boolean"}.get(
        kind, f"a non-empty {kind.__name__}")
    raise ReportError(f"bench report: {where} = {value!r}; expected {what}")


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
  for name, case in report["raw"]["overhead"].items():
    w = case["windows"]
    rows.append(f"| {name} | {case['ratio']:.3f} | {w['min']:.3f} / "
                f"{w['median']:.3f} / {w['max']:.3f} | {w['above_one']} of "
                f"{len(w['ratios'])} | {w['sign_test_p']:.2f} | "
                f"{'yes' if w['told_apart'] else 'no'} |")
  return "\n".join(rows)


def format_hosts(report: dict) -> str:
  """The headline and the sweep as text, one figure per line."""
  h = report["headline"]
  raw = report["raw"]
  lines = [f"across {raw['workers']} workers on {', '.join(raw['hosts'])}: "
           f"link {h['link_bytes_per_s'] / 1e6:.0f} MB/s (TCP streams)"]
  for f in figures.of("across_hosts")[1:]:  # The link is said above.
    lines += (_target_lines(f.name, report["targets"][f.name])
              if f.target is not None else [f"  {f.name:<36} {h[f.name]:7.3f}"])
  lines.append("  bus bandwidth / link, by tensor size (MiB):")
  fractions = raw["allreduce"]["fraction_of_link"]
  sizes = sorted(next(iter(fractions.values())), key=float)
  lines.append("    " + f"{'method':<14}" + "".join(f"{s:>8}" for s in sizes))
  for method, per_size in fractions.items():
    lines.append("    " + f"{method:<14}" +
                 "".join(f"{per_size[s]:8.3f}" for s in sizes))
  sweep = raw["allreduce"]["sweep"]
  if all("cpu_per_wall" in f for m in sweep.values() for f in m.values()):
    lines.append("  the chief's CPU seconds per second, by tensor size (MiB):")
    for method, per_size in sweep.items():
      lines.append("    " + f"{method:<14}" + "".join(
          f"{per_size[s]['cpu_per_wall']:8.2f}" for s in sizes))
  p = raw["processor"]
  lines.append(f"  processor s a GB sent at {p['size_mb']} MiB: ring "
               f"{p['ring_cpu_s_per_gb_wire']:.2f} "
               f"({p['ring_cpu_s_per_gb_reduced']:.2f} a GB reduced), TCP "
               f"stream {p['tcp_cpu_s_per_gb']:.2f}" + (
                   f", exchange {p['exchange_cpu_s_per_gb_wire']:.2f}"
                   if "exchange_cpu_s_per_gb_wire" in p else ""))
  speed = raw["training"]["steps_per_s"]
  lines.append(f"  {raw['training']['model']} steps/s: " + ", ".join(
      f"{v} {s:.2f}" for v, s in speed.items()))
  lines += _schedules_lines(raw["schedules"])
  model = report.get("model_check")
  if model:
    lines.append(f"  model (alpha {model['latency_s'] * 1e6:.1f} us a "
                 f"hop, the link): measured / predicted time, by size:")
    for size, row in sorted(model["by_size"].items(),
                            key=lambda kv: float(kv[0])):
      lines.append(f"    {size:>6} MiB  {row['schedule']} predicted "
                   f"{row['predicted_s'] * 1e3:8.2f} ms  " + "  ".join(
                       f"{m} {v['measured_over_predicted']:.2f}"
                       for m, v in row.items() if isinstance(v, dict)))
    step = model.get("training")
    if step:
      lines.append(f"    a step: predicted {step['predicted_s'] * 1e3:.1f} ms"
                   f" (overlapped; {step['serial_s'] * 1e3:.1f} without), "
                   f"measured {step['measured_s'] * 1e3:.1f} ms: "
                   f"{step['measured_over_predicted']:.2f}")
  return "\n".join(lines)


def _schedules_lines(schedules: dict) -> list[str]:
  """Each size's schedules, measured / model (ms), the rule's pick and its
  time over the fastest's; the sweep's targets."""
  lines = [f"  schedules (numpy buffers; model from alpha "
           f"{schedules['alpha_s'] * 1e6:.1f} us, B "
           f"{schedules['bytes_per_s'] / 1e6:.0f} MB/s; same bits "
           f"{schedules['same_bits']}): measured / model ms, by size:"]
  for kb, size in sorted(schedules["sizes"].items(),
                         key=lambda kv: int(kv[0])):
    lines.append(f"    {kb:>6} KiB  " + "  ".join(
        f"{name} {row['measured_s'] * 1e3:.3f}/{row['model_s'] * 1e3:.3f}"
        for name, row in size["schedules"].items())
        + f"  rule {size['rule']['pick']} {size['chosen_vs_best']:.2f}x "
        "the fastest")
  for key, t in schedules["targets"].items():
    lines += _target_lines(f"schedules {key}", t, f" (at {t['at_kb']} KiB)")
  return lines


def _target_lines(name: str, t: dict, at: str = "") -> list[str]:
  """A scored target on a line, and its ``why`` when missed."""
  return [f"  {name:<36} {t['value']:7.3f}  target {t['target']:<7} "
          f"{'met' if t['met'] else 'NOT met'}{at}"] + (
              [f"    why: {t['why']}"] if "why" in t else [])
