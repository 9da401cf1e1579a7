"""``tfdist launch``: every task of a cluster as a local process.

Arguments only: they become a `tfdist.launch.LaunchSpec`, and
`tfdist.launch.launch` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses

from tfdist import launch as launch_lib
from tfdist.cli import _args

__all__ = ["add_arguments", "run"]

_SOURCE = "tfdist launch arguments"
_EXAMPLE = "tfdist launch --workers 2 -- python train.py"

_FLAGS: _args.FlagTable = {
    "num_workers": ("--workers", dict(type=int, metavar="N",
                                      help="worker tasks")),
    "num_ps": ("--ps", dict(type=int, metavar="N",
                            help="parameter-server tasks; adds a chief")),
    "chief": ("--chief", dict(action="store_true", help="add a chief task")),
    "evaluator": ("--evaluator", dict(action="store_true",
                                      help="add an evaluator task")),
    "host": ("--host", dict(help="address the tasks bind")),
    "port_base": ("--port-base", dict(
        type=int, metavar="PORT",
        help="first of consecutive ports (default: free ports)")),
    "log_dir": ("--log-dir", dict(
        metavar="DIR",
        help="also write each task's output to DIR/TYPE-INDEX.log")),
    "max_restarts": ("--max-restarts", dict(
        type=int, metavar="K",
        help="relaunch the cluster up to K times after a failure")),
    "grace_seconds": ("--grace-seconds", dict(
        type=float, metavar="S",
        help="time a task gets to exit after SIGTERM")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the flags of ``tfdist launch`` to ``parser``."""
  defaults = {f.name: f.default for f in dataclasses.fields(
      launch_lib.LaunchSpec)}
  _args.add_flags(parser, _FLAGS, defaults=defaults)
  _args.add_command(parser, help_text="the program to run in every task")


def run(args: argparse.Namespace) -> int:
  """Launches the cluster; returns the launcher's exit code.

  Raises:
    ConfigError: the arguments make an invalid spec, or this machine cannot
      run it (`tfdist.launch.preflight`); nothing has started.
  """
  with _args.config_errors(source=_SOURCE, renamed=_args.spellings(_FLAGS)):
    spec = launch_lib.LaunchSpec(
        command=_args.command(args, source=_SOURCE, example=_EXAMPLE),
        **_args.given(args, _FLAGS))
    launch_lib.preflight(spec)
  return launch_lib.launch(spec)
