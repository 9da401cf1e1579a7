"""``tfdist info``: prints `tfdist.report`'s report on this process.

Exits 0 when every pre-flight check passed, 1 when one failed (TensorFlow
or Keras that cannot be imported fails one).
"""

from __future__ import annotations

import argparse
import json
import os

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the flags of ``tfdist info`` to ``parser``."""
  parser.add_argument("--json", action="store_true",
                      help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
  """Prints the report; 0 when every check passed, else 1.

  Raises:
    ConfigError: the cluster configuration is invalid.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Keep the report clean.
  # Imported here, not at the top: keeps `tfdist --help` fast.
  from tfdist import report  # pylint: disable=g-import-not-at-top
  found = report.gather()
  if args.json:
    print(json.dumps(found, sort_keys=True))
  else:
    print(report.format_report(found))
  return 0 if all(c["ok"] for c in found["checks"]) else 1
