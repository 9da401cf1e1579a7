"""``tfdist bench``: runs `tfdist.bench.run` and prints its headline table."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from tfdist.cli import _args
from tfdist.errors import ConfigError

__all__ = ["add_arguments", "run"]

_SOURCE = "tfdist bench arguments"

# Keyword arguments of tfdist.bench.run.
_FLAGS: _args.FlagTable = {
    "json_path": ("--json", dict(metavar="PATH",
                                 help="write the report here")),
    "plot_path": ("--plot", dict(
        metavar="PATH.png",
        help="write throughput and bandwidth plots here")),
}


#: A flag -> the flags it cannot go with, and why.
_ALONE = {"project": (("quick", "across_hosts"), "it measures nothing"),
          "figures": (("quick", "across_hosts", "project"),
                      "it reads saved reports")}
#: Flags that only the bench across hosts reads.
_ACROSS_HOSTS_ONLY = ("model", "bucket_mib")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the flags of ``tfdist bench`` to ``parser``."""
  parser.add_argument("--quick", action="store_true",
                      help="the CI preset: checks the bench runs (minutes)")
  parser.add_argument(
      "--across-hosts", action="store_true",
      help="run in every task of a cluster spanning hosts (tfdist launch "
           "--nnodes, srun): all-reduce and training against the measured "
           "link between them; the chief prints and writes the report")
  parser.add_argument(
      "--model", metavar="NAME",
      help="with --across-hosts: the model trained, a name of "
           "tfdist.bench.models.MODELS (wide_mlp by default, 33.6 MB of "
           "gradients; deep_mlp, 134 MB in eight layers)")
  parser.add_argument(
      "--bucket-mib", metavar="N", type=int,
      help="with --across-hosts: tfdist's gradient buckets of N MiB "
           "(GradientOptions.bucket_bytes; 25 by default; 0 sends every "
           "gradient after the backward pass)")
  parser.add_argument(
      "--project", action="store_true",
      help="measure nothing: print the alpha-beta model of all-reduce and "
           "step time against host count (ring and tree at 1, 10 and 100 "
           "Gbit/s; tfdist.bench.projection)")
  parser.add_argument(
      "--figures", metavar="JSON", nargs="+",
      help="measure nothing: print the figures of these saved reports (a "
           "report, or label -> report) as one Markdown table, the method "
           "beside each (tfdist.bench.figures)")
  _args.add_flags(parser, _FLAGS)


def run(args: argparse.Namespace) -> int:
  """Runs the bench; prints the headline table.

  Raises:
    ConfigError: flags that cannot go together, or a report or plot path
      that cannot be written; checked before anything is measured.
  """
  # Imported here, not at the top: keeps `tfdist --help` fast.
  from tfdist.bench import runner  # pylint: disable=g-import-not-at-top
  outputs = _args.given(args, _FLAGS)
  with _args.config_errors(source=_SOURCE, renamed=_args.spellings(_FLAGS)):
    _check_together(args)
    # Across hosts, only the chief writes: it checks its directories below.
    runner.check_outputs(**outputs, local=not args.across_hosts)
  if args.project:  # Arithmetic only: no TensorFlow.
    return _project(outputs)
  if args.figures:
    from tfdist.bench import figures  # pylint: disable=g-import-not-at-top
    print(figures.markdown(figures.load(args.figures)))
    return 0
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from tfdist.bench import report  # pylint: disable=g-import-not-at-top
  if args.across_hosts:
    return _across_hosts(args, outputs)
  found = runner.run(runner.QUICK if args.quick else runner.FULL, **outputs,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
  print(report.format_table(found))
  return 0


def _check_together(args: argparse.Namespace) -> None:
  """Raises a `ConfigError` for flags given together that cannot be, flags
  of the bench across hosts given without ``--across-hosts``, and their
  values out of range."""
  for flag, (others, why) in _ALONE.items():
    given = [o for o in others if getattr(args, o)]
    if getattr(args, flag) and given:
      spelt = [f"--{f.replace('_', '-')}" for f in (flag, *given)]
      raise ConfigError(
          field=spelt[0], value=" ".join(spelt), source=_SOURCE,
          expected=f"{spelt[0]} without {' or '.join(spelt[1:])}: {why}",
          hint=f"Drop {' and '.join(spelt[1:])}, or {spelt[0]}")
  for flag in _ACROSS_HOSTS_ONLY:
    if getattr(args, flag) is not None and not args.across_hosts:
      spelt = f"--{flag.replace('_', '-')}"
      raise ConfigError(
          field=spelt, value=getattr(args, flag), source=_SOURCE,
          expected=f"{spelt} with --across-hosts: the bench on one machine "
                   "times models and buckets of its own",
          hint=f"Add --across-hosts, or drop {spelt}")
  from tfdist.bench import models  # pylint: disable=g-import-not-at-top
  if args.model is not None and args.model not in models.MODELS:
    raise ConfigError(
        field="--model", value=args.model, source=_SOURCE,
        expected=f"one of {', '.join(sorted(models.MODELS))}",
        hint="Name a model of tfdist.bench.models")
  if args.bucket_mib is not None and args.bucket_mib < 0:
    raise ConfigError(
        field="--bucket-mib", value=args.bucket_mib, source=_SOURCE,
        expected="an integer >= 0 (0: every gradient after the backward "
                 "pass)")


def _project(outputs: dict) -> int:
  import json  # pylint: disable=g-import-not-at-top
  from tfdist.bench import plot  # pylint: disable=g-import-not-at-top
  from tfdist.bench import projection  # pylint: disable=g-import-not-at-top
  table = projection.project()
  if outputs.get("json_path"):
    with open(outputs["json_path"], "w") as f:
      json.dump(table, f, indent=1)
  if outputs.get("plot_path"):
    plot.write_projection_plot(table, outputs["plot_path"])
  print(projection.format_table(table))
  return 0


def _across_hosts(args: argparse.Namespace, outputs: dict) -> int:
  from tfdist.bench import runner  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  from tfdist.bench import hosts  # pylint: disable=g-import-not-at-top
  from tfdist.bench import report  # pylint: disable=g-import-not-at-top
  if tfdist.resolve_cluster().is_chief:  # Only the chief writes.
    with _args.config_errors(source=_SOURCE,
                             renamed=_args.spellings(_FLAGS)):
      runner.check_outputs(**outputs)
  preset = hosts.HOSTS_QUICK if args.quick else hosts.HOSTS_FULL
  if args.model:
    preset = dataclasses.replace(preset, model=args.model)
  if args.bucket_mib is not None:
    preset = dataclasses.replace(preset, bucket_bytes=args.bucket_mib << 20)
  found = hosts.run(preset, **outputs,
                    log=lambda s: print(s, file=sys.stderr, flush=True))
  print(report.format_hosts(found) if found is not None else
        "tfdist bench: done; the chief prints the report")
  return 0
