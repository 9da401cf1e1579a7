"""``tfdist slurm``: writes an sbatch script.

Arguments only: they become a `tfdist.launch.SbatchSpec` (from a preset when
``--preset`` is given), and `tfdist.launch.render` writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tfdist.cli import _args
from tfdist.errors import ConfigError
from tfdist.launch import sbatch

__all__ = ["add_arguments", "build_spec", "run"]

_SOURCE = "tfdist slurm arguments"
_EXAMPLE = "tfdist slurm --nodes 2 -- python train.py"

# SbatchSpec's fields are spelt like their flags, so errors name the field.
_FLAGS: _args.FlagTable = {
    "job_name": ("--job-name", {}),
    "nodes": ("--nodes", dict(type=_args.matching(r"\d+(-\d+)?",
                                                  "N or MIN-MAX"),
                              help="N, or MIN-MAX: whatever SLURM grants "
                                   "(a requeue resumes at that size)")),
    "tasks_per_node": ("--tasks-per-node", dict(type=int)),
    "gpus_per_node": ("--gpus-per-node", dict(type=int)),
    "cpus_per_task": ("--cpus-per-task", dict(type=int)),
    "time": ("--time", dict(help="time limit, e.g. 04:00:00")),
    "partition": ("--partition", {}),
    "roles": ("--roles", dict(help="PS roles in rank order, e.g. "
                                   "chief=1,ps=1,worker=2")),
    "signal_seconds": ("--signal-seconds", dict(
        type=int, help="send USR1 this long before the time limit")),
    "requeue": ("--requeue", dict(action=argparse.BooleanOptionalAction,
                                  help="requeue after USR1 (default on)")),
    "max_requeues": ("--max-requeues", dict(
        type=int, metavar="K", help="requeue at most K times")),
    "requeue_from": ("--requeue-from", dict(
        metavar="{script,task}",
        help="who requeues after the tasks saved: the batch shell "
             "(script: --signal=B:USR1@N, the default) or the chief task "
             "itself (task: --signal=USR1@N to the tasks, "
             "TFDIST_SLURM_REQUEUE=1)")),
    "sbatch_options": ("--sbatch-option", dict(
        action="append", metavar="OPTION",
        help="one more #SBATCH line, e.g. --sbatch-option=--account=abc "
             "(repeatable)")),
    "setup": ("--setup", dict(
        action="append", metavar="LINE",
        help="a shell line run before srun, e.g. --setup 'module load cuda'"
             " (repeatable, in order)")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the flags of ``tfdist slurm`` to ``parser``."""
  parser.add_argument("--preset", choices=sorted(sbatch.PRESETS), default=None,
                      help="start from a cluster_configs/ template's spec")
  _args.add_flags(parser, _FLAGS)
  parser.add_argument("-o", "--output", default=None, metavar="FILE",
                      help="write the script to FILE instead of stdout")
  _args.add_command(parser, help_text="the program each task runs")


def build_spec(args: argparse.Namespace) -> sbatch.SbatchSpec:
  """The spec the arguments ask for; writes nothing.

  Raises:
    ConfigError: the arguments make an invalid spec.
  """
  with _args.config_errors(source=_SOURCE, renamed=_args.spellings(_FLAGS)):
    base = sbatch.PRESETS[args.preset] if args.preset else sbatch.SbatchSpec()
    changes = _args.given(args, _FLAGS)
    command = _args.command(args, source=_SOURCE, example=_EXAMPLE)
    if command:
      changes["command"] = command
    return dataclasses.replace(base, **changes)


def run(args: argparse.Namespace) -> int:
  """Prints or writes the script; writes nothing on errors.

  Raises:
    ConfigError: the arguments make an invalid spec, or FILE cannot be
      written.
  """
  spec = build_spec(args)
  fit = sbatch.fits_problem(spec)
  if fit:
    field, why = fit
    raise ConfigError(field=_args.spellings(_FLAGS)[field],
                      value=getattr(spec, field), source=_SOURCE,
                      expected="a request that fits a node of the partition",
                      hint=why)
  warning = sbatch.srun_problem(spec)
  if warning:
    print(f"tfdist: warning: {warning}", file=sys.stderr)
  text = sbatch.render(spec)
  if args.output is None:
    print(text, end="")
    return 0
  try:
    with open(args.output, "w") as f:
      f.write(text)
  except OSError as e:
    raise ConfigError(field="--output", value=args.output, source=_SOURCE,
                      expected="a file that can be written",
                      hint=e.strerror) from None
  return 0
