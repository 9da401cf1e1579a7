"""The ``tfdist`` command: a registry of subcommands.

Each subcommand is a module of `tfdist.cli` with ``add_arguments(parser)``
and ``run(args) -> int``; it turns arguments into the library's config and
calls the library. Errors in what the user gave print one line
``tfdist: ...`` on stderr and exit 2, with no traceback: argparse's own, and
any `TfdistError` a subcommand raises.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from types import ModuleType
from typing import Sequence

from tfdist.cli import bench
from tfdist.cli import config_file
from tfdist.cli import info
from tfdist.cli import launch
from tfdist.cli import slurm
from tfdist.errors import TfdistError

__all__ = ["main", "console_main", "build_parser", "EXIT_USAGE"]

EXIT_USAGE = 2

# name -> (help, the subcommand's module).
_COMMANDS: dict[str, tuple[str, ModuleType]] = {
    "bench": ("measure overhead, scaling, all-reduce, start-up and memory "
              "against raw TensorFlow", bench),
    "info": ("versions, devices, the resolved cluster and the strategy auto "
             "would build", info),
    "launch": ("run every task of a cluster as a local process, each with "
               "its own TF_CONFIG", launch),
    "slurm": ("write an sbatch script that trains with srun, checkpoints on "
              "USR1 and requeues", slurm),
}


class _Parser(argparse.ArgumentParser):
  """Prints argument errors as one ``tfdist:`` line and exits 2; flags are
  spelt in full (``--gpus`` must not mean ``--gpus-per-node``)."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("allow_abbrev", False)
    super().__init__(*args, **kwargs)

  def error(self, message):
    print(f"tfdist: {self.prog.removeprefix('tfdist').strip() or 'usage'}: "
          f"{message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
  """The parser of ``tfdist`` and every subcommand."""
  parser = _Parser(prog="tfdist",
                   description="Distributed TensorFlow training made to work.")
  parser.add_argument("--version", action="version",
                      version=f"tfdist {_version()}")
  parser.add_argument(
      "--config", metavar="FILE",
      help="defaults for the subcommand's flags from a TOML (or .json) file "
           f"whose tables are subcommands; also ${config_file.VARIABLE}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                              parser_class=_Parser)
  for name, (help_text, module) in _COMMANDS.items():
    module.add_arguments(
        sub.add_parser(name, help=help_text, description=help_text))
  parser.commands = sub.choices  # type: ignore[attr-defined]
  return parser


def _version() -> str:
  """tfdist's version, without importing TensorFlow."""
  from tfdist import __version__  # The facade loads its names lazily.
  return __version__


def usage_problem(parser: argparse.ArgumentParser,
                  argv: Sequence[str]) -> str | None:
  """What is wrong with the command and flags of ``argv``, before parsing.

  argparse names only the first unknown flag, and none at all when a
  command follows (``tfdist launch --wrokers 2 -- python x.py``): this names
  the subcommand and every unknown flag before ``--``, and suggests the
  subcommand meant by a misspelt one.
  """
  words = list(argv)
  if not words or words[0].startswith("-"):
    return None
  name, rest = words[0], words[1:]
  commands = parser.commands  # type: ignore[attr-defined]
  if name not in commands:
    close = difflib.get_close_matches(name, commands, n=1)
    hint = f"; did you mean `tfdist {close[0]}`?" if close else ""
    return (f"unknown command {name!r}: expected one of "
            f"{', '.join(commands)}{hint}")
  known = commands[name]._option_string_actions  # pylint: disable=protected-access
  unknown, value_next = [], False
  for word in rest:
    if word == "--":
      break
    if not word.startswith("-") or _number(word):
      if value_next:  # A flag's value.
        value_next = False
        continue
      break  # The program (or a stray word argparse names) starts here.
    flag = word.split("=", 1)[0]
    if flag not in known:
      unknown.append(flag)
    # A known flag that takes a value, or an unknown one (it may), given
    # without "=": the next bare word is its value.
    value_next = "=" not in word and (flag not in known
                                      or known[flag].nargs != 0)
  if not unknown:
    return None
  return (f"{name}: unknown flag{'s' * (len(unknown) > 1)} "
          f"{', '.join(unknown)} (see `tfdist {name} --help`)")


def _number(word: str) -> bool:
  try:
    float(word)
    return True
  except ValueError:
    return False


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the CLI; returns the exit code.

  Args:
    argv: the arguments after ``tfdist``; ``sys.argv[1:]`` when ``None``.
  """
  parser = build_parser()
  argv = sys.argv[1:] if argv is None else list(argv)
  config, argv = config_file.split_config(argv)
  if config and argv and argv[0] in parser.commands:  # type: ignore[attr-defined]
    try:
      argv = [argv[0], *config_file.config_arguments(config, argv[0], parser),
              *argv[1:]]
    except TfdistError as e:
      print(f"tfdist: {e}", file=sys.stderr)
      return EXIT_USAGE
  problem = usage_problem(parser, argv)
  if problem:
    print(f"tfdist: {problem}", file=sys.stderr)
    return EXIT_USAGE
  args = parser.parse_args(argv)
  if args.command is None:
    parser.print_help()
    return EXIT_USAGE
  try:
    return _COMMANDS[args.command][1].run(args)
  except TfdistError as e:
    print(f"tfdist: {e}", file=sys.stderr)
    return EXIT_USAGE


def console_main() -> None:
  """Entry point of the ``tfdist`` console script."""
  sys.exit(main())
