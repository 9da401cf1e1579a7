"""The conventions every subcommand shares.

* A flag is spelt ``--kebab-case`` (never abbreviated) and sets one field of
  the library's config; a subcommand lists its flags once, in a `FlagTable`.
* A command to run comes last, after ``--``, and only there.
* A `ConfigError` raised while the config is built names the flag that set
  the field (where the table renames it) and the subcommand's arguments as
  its source; `tfdist.cli.main` prints any `TfdistError` as one ``tfdist: ``
  line and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from typing import Any, Callable, Iterator, Mapping

from tfdist.errors import ConfigError

__all__ = ["FlagTable", "add_flags", "given", "spellings", "add_command",
           "command", "config_errors", "matching"]

#: Config field -> (flag, keyword arguments of ``add_argument``).
FlagTable = Mapping[str, tuple[str, Mapping[str, Any]]]


def add_flags(parser: argparse.ArgumentParser, flags: FlagTable, *,
              defaults: Mapping[str, Any] | None = None) -> None:
  """Adds one flag per field; a flag left out leaves the field unset.

  Args:
    parser: the subcommand's parser.
    flags: its flag table.
    defaults: the config's defaults, named in the help where they say
      something (not ``None`` or ``False``; 0 does).
  """
  for field, (flag, options) in flags.items():
    options = dict(options)
    default = (defaults or {}).get(field)
    if options.get("help") and default is not None and default is not False:
      shown = f"{default:g}" if isinstance(default, float) else default
      options["help"] += f" (default {shown})"
    parser.add_argument(flag, dest=field, default=argparse.SUPPRESS, **options)


def matching(pattern: str, name: str) -> Callable[[str], str]:
  """An argparse ``type`` taking text that matches ``pattern`` whole, named
  ``name`` in its errors (and so in a config file's)."""
  compiled = re.compile(pattern)

  def check(text: str) -> str:
    if not compiled.fullmatch(text):
      raise ValueError(text)
    return text
  check.__name__ = name
  return check


def given(args: argparse.Namespace, flags: FlagTable) -> dict[str, Any]:
  """The fields whose flags were given: keyword arguments for the config."""
  return {field: getattr(args, field) for field in flags
          if hasattr(args, field)}


def spellings(flags: FlagTable) -> dict[str, str]:
  """Config field -> the flag that sets it."""
  return {field: flag for field, (flag, _) in flags.items()}


def add_command(parser: argparse.ArgumentParser, *, help_text: str) -> None:
  """The command to run: everything after ``--``."""
  parser.add_argument("program", nargs=argparse.REMAINDER,
                      metavar="-- COMMAND", help=f"-- then {help_text}")


def command(args: argparse.Namespace, *, source: str,
            example: str) -> tuple[str, ...]:
  """The words after ``--``; none when no command was given.

  Raises:
    ConfigError: words that are not options came without ``--`` first.
  """
  words = args.program
  if words and words[0] != "--":
    raise ConfigError(
        field="arguments", value=" ".join(words), source=source,
        expected=f"known options, then -- and the program, e.g. `{example}`")
  return tuple(words[1:])


@contextlib.contextmanager
def config_errors(*, source: str,
                  renamed: Mapping[str, str] | None = None) -> Iterator[None]:
  """Re-raises a `ConfigError` in terms of the command line.

  Its expectation and hint are kept word for word, and with them the user's
  values as given: the library writes them for API and CLI users alike.

  Args:
    source: the subcommand's arguments, e.g. ``"tfdist launch arguments"``.
    renamed: config field -> the flag that sets it, for configs whose fields
      are not spelt like their flags: the error's field becomes the flag.

  Raises:
    ConfigError: the error from the body, with ``source`` as its source.
  """
  try:
    yield
  except ConfigError as e:
    raise e.restated(field=(renamed or {}).get(e.field, e.field),
                     source=source) from None
