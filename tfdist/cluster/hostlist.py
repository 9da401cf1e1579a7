"""SLURM hostlist and task-count expressions, expanded exactly as SLURM does.

`expand_hostlist` turns ``SLURM_STEP_NODELIST``-style expressions such as
``n[9-10],gpu[01-02]`` into host names, in the order SLURM's own parser
(``scontrol show hostnames``, ``src/common/hostlist.c``) gives them. That order
is the order SLURM assigns ranks in, so it must not be sorted.

The grammar, as SLURM 22.05 reads it:

* The list is split at commas, spaces, tabs and newlines outside brackets;
  empty items (``a,,b``) are skipped. Order and duplicates are kept.
* A name may hold bracket groups: ``prefix[RANGES]``. RANGES is a comma list
  of ``N`` or ``LO-HI`` (``LO <= HI``, at most 65536 names per range), padded
  with zeros to the width of ``LO`` as written: ``n[01-3]`` gives ``n01 n02
  n03``, ``n[1-03]`` gives ``n1 n2 n3``, ``n[8-10]`` gives ``n8 n9 n10``.
* Several groups may appear in one name, ``r[1-2]n[3-4]``. With groups
  ``g1 ... gk`` the last group varies fastest, then ``g1``, ``g2``, ...
  ``g(k-1)`` slowest: ``r[1-2]n[3-4]`` gives ``r1n3 r1n4 r2n3 r2n4`` and
  ``a[1-2]b[1-2][1-2]`` gives ``a1b11 a1b12 a2b11 a2b12 a1b21 ...`` (SLURM
  peels groups off the prefix from the right).
* Text after the last ``]`` is appended to every name: ``n[1-2]-ib`` gives
  ``n1-ib n2-ib``, as newer SLURM releases read it and as InfiniBand node
  names are written. SLURM 22.05 rejects such a name ("Invalid hostlist");
  tfdist accepts it on purpose (the one extension to 22.05's grammar).

Where SLURM silently accepts garbage this module raises `ConfigError`
instead: unbalanced or nested brackets, spaces or signs inside brackets, a
range with no upper bound, numbers past 2**64 - 1, a list that names no host,
lists of over 2**20 names, and a bad range in an early group of a name with
three or more groups. Everything else matches ``scontrol show hostnames``
name for name (``tests/test_hostlist.py`` checks it against SLURM).

This module does not import TensorFlow.
"""

from __future__ import annotations

import re
from typing import Union

from tfdist.errors import ConfigError

__all__ = ["expand_hostlist", "expand_tasks_per_node", "MAX_RANGE",
           "MAX_HOSTS"]

#: SLURM's limit on names in one ``LO-HI`` range (``MAX_RANGE`` in hostlist.c).
MAX_RANGE = 64 * 1024
#: SLURM's limit on comma-separated ranges inside one pair of brackets.
_MAX_RANGES = 64 * 1024
#: tfdist's own limit on the names one expression may expand to.
MAX_HOSTS = 1 << 20
_MAX_NUMBER = (1 << 64) - 1  # SLURM parses with strtoul into 64 bits.

_SEPARATORS = ", \t\n"
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")
_TASKS_RE = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?\Z")

# A range: (lo, hi, width).
_Range = tuple[int, int, int]
# A name split at its bracket groups: text, group, text, group, ..., text.
_Segment = Union[str, list[_Range]]

_HOSTLIST_EXPECTED = "a SLURM hostlist such as 'n[1-4,7],gpu[01-02]'"


def expand_hostlist(text: str, *, source: str = "argument",
                    field: str = "hostlist") -> list[str]:
  """Expands a SLURM hostlist expression into host names, in SLURM's order.

  Args:
    text: the expression, e.g. the value of ``SLURM_STEP_NODELIST``.
    source: where ``text`` came from, for error messages, e.g.
      ``"SLURM variables from the environment"``.
    field: the name to give ``text`` in error messages, e.g.
      ``"SLURM_STEP_NODELIST"``.

  Returns:
    The host names, in the order ``scontrol show hostnames`` prints them,
    duplicates included.

  Raises:
    ConfigError: ``text`` is not a hostlist SLURM accepts, or it names no
      host, or it would expand to more than `MAX_HOSTS` names.
  """

  def fail(why: str, value: object = text) -> ConfigError:
    return ConfigError(field=field, value=value,
                       expected=f"{_HOSTLIST_EXPECTED}; {why}", source=source)

  if not isinstance(text, str):
    raise fail(f"got a {type(text).__name__}, not a string")
  tokens = _split_top_level(text, fail)
  if not tokens:
    raise fail("it names no host")
  parsed = [_parse_token(token, fail) for token in tokens]
  total = 0
  for segments in parsed:
    total += _count(segments)
    if total > MAX_HOSTS:
      raise fail(f"it expands to more than {MAX_HOSTS} names")
  names: list[str] = []
  for segments in parsed:
    if len(segments) == 1:
      names.append(segments[0])
    else:
      start = len(names)
      _push(segments[:-2], segments[-2], names)
      names[start:] = [name + segments[-1] for name in names[start:]]
  return names


def _split_top_level(text: str, fail) -> list[str]:
  """Splits at separators outside brackets; checks brackets are balanced."""
  tokens, start, depth = [], 0, 0
  for i, char in enumerate(text):
    if char == "[":
      depth += 1
      if depth > 1:
        raise fail(f"nested '[' at position {i}")
    elif char == "]":
      depth -= 1
      if depth < 0:
        raise fail(f"']' without '[' at position {i}")
    elif depth == 0 and char in _SEPARATORS:
      tokens.append(text[start:i])
      start = i + 1
  if depth:
    raise fail("'[' without ']'")
  tokens.append(text[start:])
  return [t for t in tokens if t]


def _parse_token(token: str, fail) -> list[_Segment]:
  """Splits one name into ``text, ranges, text, ranges, ..., text``."""
  parts = re.split(r"\[([^\]]*)\]", token)  # Balanced, not nested: checked.
  segments: list[_Segment] = []
  for i, part in enumerate(parts):
    segments.append(_parse_ranges(part, token, fail) if i % 2 else part)
  return segments


def _parse_ranges(body: str, token: str, fail) -> list[_Range]:
  items = body.split(",")
  if len(items) > _MAX_RANGES:
    raise fail(f"more than {_MAX_RANGES} ranges in one bracket of {token!r}")
  ranges = []
  for item in items:
    match = _RANGE_RE.match(item)
    if not match:
      raise fail(f"range {item!r} in {token!r} is not N or LO-HI with "
                 "non-negative integers")
    lo_text, hi_text = match.group(1), match.group(2)
    lo = int(lo_text)
    hi = lo if hi_text is None else int(hi_text)
    if hi > _MAX_NUMBER:
      raise fail(f"range {item!r} in {token!r} exceeds 2**64 - 1")
    if hi < lo:
      raise fail(f"range {item!r} in {token!r} runs backwards")
    if hi - lo + 1 > MAX_RANGE:
      raise fail(f"range {item!r} in {token!r} has more than {MAX_RANGE} "
                 "names")
    ranges.append((lo, hi, len(lo_text)))
  return ranges


def _count(segments: list[_Segment]) -> int:
  total = 1
  for group in segments[1::2]:
    total *= sum(hi - lo + 1 for lo, hi, _ in group)
  return total


def _values(group: list[_Range]):
  for lo, hi, width in group:
    for number in range(lo, hi + 1):
      yield f"{number:0{width}d}"


def _push(prefix: list[_Segment], last: list[_Range], out: list[str]) -> None:
  """Mirrors SLURM's ``_push_range_list``.

  The prefix's rightmost group is expanded in the outer loop, recursing on
  the rest of the prefix; the last group is the innermost loop.
  """
  if len(prefix) == 1:
    out.extend(prefix[0] + value for value in _values(last))
    return
  head, group, tail = prefix[:-3], prefix[-2], prefix[-1]
  before = prefix[-3]
  for value in _values(group):
    _push(head + [before + value + tail], last, out)


def expand_tasks_per_node(text: str, *, source: str = "argument",
                          field: str = "tasks per node") -> list[int]:
  """Expands a ``SLURM_TASKS_PER_NODE`` value into one count per node.

  Args:
    text: e.g. ``"2(x3),1"``: a comma list of ``N`` or ``N(xREPEAT)``.
    source: where ``text`` came from, for error messages.
    field: the name to give ``text`` in error messages, e.g.
      ``"SLURM_STEP_TASKS_PER_NODE"``.

  Returns:
    The counts, e.g. ``[2, 2, 2, 1]``.

  Raises:
    ConfigError: ``text`` is not in that form, or a repeat is 0.
  """
  expected = ("a comma list of task counts N or N(xREPEAT) with REPEAT >= 1, "
              "as SLURM writes SLURM_TASKS_PER_NODE, e.g. '2(x3),1'")
  if not isinstance(text, str) or not text:
    raise ConfigError(field=field, value=text, expected=expected,
                      source=source)
  counts: list[int] = []
  for item in text.split(","):
    match = _TASKS_RE.match(item)
    repeat = int(match.group(2)) if match and match.group(2) else 1
    if not match or repeat < 1 or len(counts) + repeat > MAX_HOSTS:
      raise ConfigError(field=field, value=text,
                        expected=f"{expected} (bad item {item!r})",
                        source=source)
    counts.extend([int(match.group(1))] * repeat)
  return counts
