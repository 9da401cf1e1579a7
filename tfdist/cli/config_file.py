"""Defaults for the ``tfdist`` subcommands from a file.

``tfdist --config FILE SUBCOMMAND ...`` (or ``TFDIST_CONFIG=FILE``) reads a
TOML file (``.toml``; Python 3.11 or newer) or a JSON file (``.json``) whose
tables are subcommands and whose keys are their flags without the leading
dashes; flags given on the command line win::

  [launch]
  workers = 2
  max-restarts = 3
  log-dir = "logs"

  [slurm]
  nodes = 4
  sbatch-option = ["--account=abc"]

A value becomes the flag it names (``true`` a switch, a list a repeated
flag) in front of the command line's own flags, so it is checked exactly as
typed flags are. An unknown table or key, or a value of the wrong type, is a
`ConfigError` naming the file, ``table.key``, the value and what was
expected.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from typing import Any, Mapping, Sequence

from tfdist.errors import ConfigError

__all__ = ["VARIABLE", "split_config", "config_arguments"]

#: The environment variable naming a config file when ``--config`` is not
#: given.
VARIABLE = "TFDIST_CONFIG"


def split_config(argv: Sequence[str],
                 environ: Mapping[str, str] | None = None
                 ) -> tuple[str | None, list[str]]:
  """``(config file, the other arguments)``: ``--config FILE`` or
  ``--config=FILE`` before the subcommand, else `VARIABLE`."""
  argv = list(argv)
  if argv and argv[0] == "--config" and len(argv) > 1:
    return argv[1], argv[2:]
  if argv and argv[0].startswith("--config="):
    return argv[0].split("=", 1)[1], argv[1:]
  environ = os.environ if environ is None else environ
  return environ.get(VARIABLE) or None, argv


def config_arguments(path: str, command: str,
                     parser: argparse.ArgumentParser) -> list[str]:
  """The flags that ``path``'s table ``command`` stands for.

  Raises:
    ConfigError: the file cannot be read or parsed, or names a table, key
      or value the subcommands do not take.
  """
  tables = _load(path)
  commands = parser.commands  # type: ignore[attr-defined]
  for table in tables:
    if table not in commands or not isinstance(tables[table], dict):
      raise ConfigError(
          field=table, value=tables[table], source=f"config file {path}",
          expected=f"a table named after a subcommand: {', '.join(commands)}")
  words: list[str] = []
  actions = commands[command]._option_string_actions  # pylint: disable=protected-access
  for key, value in tables.get(command, {}).items():
    words += _flag_words(path, command, key, value, actions)
  return words


def _load(path: str) -> dict[str, Any]:
  source = f"config file {path}"
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise ConfigError(field="--config", value=path, source="the command line",
                      expected="a readable file", hint=e.strerror) from None
  try:
    if path.endswith(".json"):
      data = json.loads(raw)
    else:
      data = tomllib.loads(raw.decode())
  except (ValueError, UnicodeDecodeError) as e:
    raise ConfigError(field="--config", value=path, source=source,
                      expected="valid TOML (or JSON for .json)",
                      hint=str(e)) from None
  if not isinstance(data, dict):
    raise ConfigError(field="--config", value=path, source=source,
                      expected="tables of subcommand flags")
  return data


def _flag_words(path: str, command: str, key: str, value: Any,
                actions: Mapping[str, argparse.Action]) -> list[str]:
  where = dict(field=f"{command}.{key}", value=value,
               source=f"config file {path}")
  flag = f"--{key}"
  action = actions.get(flag)
  if action is None or flag in ("--help",):
    known = sorted(a[2:] for a in actions if a.startswith("--")
                   and a != "--help")
    raise ConfigError(**where, expected=f"one of {', '.join(known)}")
  if action.nargs == 0:  # A switch.
    if not isinstance(value, bool):
      raise ConfigError(**where, expected="true or false")
    if isinstance(action, argparse.BooleanOptionalAction):
      return [flag if value else f"--no-{key}"]
    return [flag] if value else []
  values = value if isinstance(value, list) else [value]
  if isinstance(value, list) and not isinstance(action,
                                                argparse._AppendAction):  # pylint: disable=protected-access
    raise ConfigError(**where, expected="one value, not a list")
  words = []
  for item in values:
    if isinstance(item, (dict, list, bool)) or item is None:
      raise ConfigError(**where, expected="a number or a string")
    if action.type is not None:
      try:
        action.type(str(item))
      except (TypeError, ValueError):
        raise ConfigError(**where, expected=f"a value {flag} takes "
                          f"({getattr(action.type, '__name__', 'typed')})"
                          ) from None
    if action.choices is not None and item not in action.choices:
      raise ConfigError(**where,
                        expected=f"one of {', '.join(map(str, action.choices))}")
    words.append(f"{flag}={item}")
  return words
